"""Gather buffers kept across forwards (backends/buffer_pool.py) instead of a process-wide allocator setting.

In-process: the pools' reuse rules. On 2 gloo ranks (FSDP2 here, DeepSpeed in
test_deepspeed_backend.py): an engine leaves glibc's mmap threshold alone, a second forward
allocates no gather memory, and the pools are empty during a training pause and after close.
"""

from __future__ import annotations

import pool_scenarios as sc
import pytest
import torch

from shardgen.backends.buffer_pool import BufferPool, StoragePool, trim_heap


# ----------------------------------------------------------------------------- in-process
def test_buffer_pool_hands_out_a_buffer_again_only_once_nothing_refers_to_it():
    pool = BufferPool()
    a = pool.take(10, torch.float32, "cpu")
    b = pool.take(10, torch.float32, "cpu")  # a is still in use
    assert (pool.allocated, len(pool)) == (2, 2)
    assert a.data_ptr() != b.data_ptr()
    ptr = a.data_ptr()
    del a
    c = pool.take(6, torch.float32, "cpu")  # a's buffer, free again, holds 6
    assert (pool.allocated, pool.reused, c.numel(), c.data_ptr()) == (2, 1, 6, ptr)
    d = c.view(2, 3)  # a view keeps the buffer in use
    del c
    e = pool.take(10, torch.float32, "cpu")
    assert pool.allocated == 3 and e.data_ptr() != ptr
    del d, e, b
    pool.take(20, torch.float32, "cpu")  # larger than any: replaces a free one, the pool stays at 3
    assert (pool.allocated, len(pool)) == (4, 3)
    assert len(pool.take(5, torch.bfloat16, "cpu")) == 5 and len(pool) == 4  # its own dtype
    held = pool.take(20, torch.float32, "cpu")
    lingering = held.view(4, 5)  # e.g. a finished collective's work object, not yet dropped
    pool.release(held)  # its user is done with it: it serves the next request despite `lingering`
    again = pool.take(20, torch.float32, "cpu")
    assert again.data_ptr() == lingering.data_ptr() and pool.allocated == 5
    pool.clear()
    assert (len(pool), pool.nbytes()) == (0, 0)


def test_buffer_pool_blocks_fit_the_largest_gather_from_the_first():
    pool = BufferPool(block_bytes=4000)
    small = pool.take(10, torch.float32, "cpu")
    assert pool.nbytes() == 4000 and small.numel() == 10
    del small
    big = pool.take(1000, torch.float32, "cpu")
    assert (pool.allocated, pool.reused, big.numel()) == (1, 1, 1000)


def test_storage_pool_lends_and_takes_back_the_same_memory():
    """FSDP2's pattern: a parameter's storage resized 0 <-> full around every unit's forward."""
    pool = StoragePool()
    if not pool.supported():
        pytest.skip("no UntypedStorage._swap_data_ptr_ in this torch")
    t = torch.empty(8)
    view = t.view(2, 4)  # the unsharded parameter: another tensor on the same storage
    t.untyped_storage().resize_(0)
    pool.lend(t.untyped_storage(), 32)
    t.copy_(torch.arange(8.0))
    assert torch.equal(view.reshape(-1), torch.arange(8.0)) and pool.nbytes() == 32
    ptr = t.data_ptr()
    assert pool.take_back(t.untyped_storage())
    assert t.untyped_storage().nbytes() == 0 and view.untyped_storage().nbytes() == 0
    assert not pool.take_back(t.untyped_storage())  # nothing lent any more
    pool.lend(t.untyped_storage(), 32)
    assert (pool.allocated, pool.reused, t.data_ptr()) == (1, 1, ptr)
    pool.clear()  # memory still lent stays with its storage
    assert t.untyped_storage().nbytes() == 32 and pool.nbytes() == 0
    assert trim_heap() in (True, False)


# ----------------------------------------------------------------------------- 2-3 ranks
@pytest.mark.multirank
def test_gather_in_place_equals_all_gather(world3):
    for r, res in enumerate(world3.run(sc.gather_in_place_matches_all_gather, timeout=60)):
        assert res and all(res), (r, res)


@pytest.mark.multirank
def test_an_fsdp2_engine_leaves_glibcs_mmap_threshold_alone(world2):
    for r, res in enumerate(world2.run(sc.allocator_untouched, "fsdp2", timeout=120)):
        if res["after"] is None:
            pytest.skip("no glibc mallinfo2")
        assert res["equal"], r
        assert res["after"] == 0, f"rank {r}: the engine fixed glibc's mmap threshold ({res})"


@pytest.mark.multirank
def test_fsdp2_gather_buffers_are_reused_across_forwards_and_emptied_at_pause_and_close(world2):
    for r, res in enumerate(world2.run(sc.pools_reused_and_emptied, "fsdp2", timeout=120)):
        sc.check_pools(r, res)
