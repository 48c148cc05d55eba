"""Scenarios for the gather-buffer pools (backends/buffer_pool.py); they run inside gloo ranks of a World."""

from __future__ import annotations

import ctypes
from collections import Counter

import torch
from ds_scenarios import install_recorder, record
from models import batch, hf_generate, tiny_model
from world import rank

import shardgen


def _mallinfo2():
    """glibc's ``mallinfo2()`` (2.33+) as a dict, or None where there is none."""

    class MallInfo2(ctypes.Structure):
        _fields_ = [
            (name, ctypes.c_size_t)
            for name in (
                "arena", "ordblks", "smblks", "hblks", "hblkhd",
                "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
            )
        ]  # fmt: skip

    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = MallInfo2
    info = fn()
    return {name: getattr(info, name) for name, _ in MallInfo2._fields_}


def mmapped_after_a_larger_free() -> int | None:
    """Blocks glibc maps for a 4 MiB ``malloc`` right after freeing a mapped 8 MiB one: 0 with its
    dynamic mmap threshold (the free raises it past 4 MiB, so the block comes from the heap), 1
    once someone fixed the threshold low (``mallopt(M_MMAP_THRESHOLD)``). None without glibc."""
    if _mallinfo2() is None:
        return None
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    big = libc.malloc(8 << 20)
    libc.free(big)
    before = _mallinfo2()["hblks"]
    block = libc.malloc(4 << 20)
    after = _mallinfo2()["hblks"]
    libc.free(block)
    return after - before


def allocator_untouched(backend: str) -> dict:
    """Open an engine of ``backend`` on the CPU, generate, close; then check glibc's dynamic mmap
    threshold in this process (``mmapped_after_a_larger_free``), before and after."""
    before = mmapped_after_a_larger_free()
    ref = tiny_model("llama", seed=31)
    ids, mask = batch([3, 5], seed=rank())
    with shardgen.Engine(tiny_model("llama", seed=31), backend=backend, gather="per-layer") as eng:
        got = eng.generate_ids(ids, mask, max_new_tokens=4)
    return dict(
        before=before,
        after=mmapped_after_a_larger_free(),
        equal=bool(torch.equal(got, hf_generate(ref, ids, mask, max_new_tokens=4))),
    )


_GATHER_OPS = ("all_gather_single", "all_gather_into_tensor", "_all_gather_base", "broadcast")


def pools_reused_and_emptied(backend: str, bucket_mb: float | None = None) -> dict:
    """Generate twice (the second run must allocate no gather memory), pause (the pools are empty
    during a training step), generate again, close (empty again); outputs equal HF's throughout.
    ``bucket_mb``: DeepSpeed's bucket size (tiny: one parameter per bucket)."""
    import shardgen.backends.deepspeed as ds_backend
    import shardgen.backends.fsdp2.pool as fsdp2_pool

    trims = [0]  # malloc_trim calls: at close only (a trim at a pause costs the next step)

    def counted() -> bool:
        trims[0] += 1
        return True

    saved = ds_backend.trim_heap, fsdp2_pool.trim_heap
    ds_backend.trim_heap = fsdp2_pool.trim_heap = counted  # put back before returning
    ref = tiny_model("llama", seed=32)
    options = {} if bucket_mb is None else {"bucket_mb": bucket_mb}
    eng = shardgen.Engine(tiny_model("llama", seed=32), backend=backend, **options, gather="per-layer")
    b = eng.backend

    def counts() -> dict:
        out = {"pool": (b.pool.allocated, b.pool.reused, len(b.pool), b.pool.nbytes())}
        storages = getattr(b, "storages", None)
        if storages is not None:
            out["storages"] = (storages.allocated, storages.reused, storages.nbytes())
        return out

    ids, mask = batch([3, 6, 4], seed=40 + rank())
    equal = []

    def gen() -> None:
        got = eng.generate_ids(ids, mask, max_new_tokens=5)
        equal.append(bool(torch.equal(got, hf_generate(ref, ids, mask, max_new_tokens=5))))

    gen()
    first = counts()
    install_recorder()
    with record() as rec:  # the collectives of the second run (any thread)
        gen()
    calls = Counter(c[0] for c in rec.calls if c[0] in _GATHER_OPS)
    second = counts()
    with eng.paused():
        paused = counts()
        trims_paused = trims[0]
    gen()
    after_pause = counts()
    eng.close()
    closed = counts()
    ds_backend.trim_heap, fsdp2_pool.trim_heap = saved
    return dict(
        first=first,
        second=second,
        paused=paused,
        after_pause=after_pause,
        closed=closed,
        equal=equal,
        calls=dict(calls),
        trims=(trims_paused, trims[0]),
    )


def check_pools(r: int, res: dict) -> None:
    """What ``sc.pools_reused_and_emptied`` must return (both backends)."""
    assert res["equal"] == [True, True, True], (r, res)
    (a1, u1, n1, b1), (a2, u2, n2, b2) = res["first"]["pool"], res["second"]["pool"]
    assert a1 > 0 and n1 > 0, (r, res)  # the first forwards filled the pool
    assert a2 == a1 and (n2, b2) == (n1, b1), (r, res)  # the second run allocated nothing ...
    assert u2 > u1, (r, res)  # ... it reused the kept buffers
    assert res["paused"]["pool"][2:] == (0, 0), (r, res)  # empty while the user trains
    assert res["after_pause"]["pool"][2] > 0, (r, res)  # refilled by the next forwards
    assert res["closed"]["pool"][2:] == (0, 0), (r, res)
    assert res["trims"] == (0, 1), (r, res)  # the heap is trimmed at close, not at the pause
    if "storages" in res["first"]:  # FSDP2's unsharded parameters
        (sa1, su1, _), (sa2, su2, _) = res["first"]["storages"], res["second"]["storages"]
        assert sa1 > 0 and sa2 == sa1 and su2 > su1, (r, res)
        assert res["paused"]["storages"][2] == 0 and res["closed"]["storages"][2] == 0, (r, res)
    # Pooled gathers are written in place, by broadcasts (buffer_pool.gather_in_place): gloo's all-gather
    # would allocate an output-sized temporary per call, which glibc's per-thread arenas keep.
    gathers = {k: v for k, v in res["calls"].items() if k != "broadcast"}
    assert res["calls"].get("broadcast", 0) > 0 and not any(gathers.values()), (r, res["calls"])


def gather_in_place_matches_all_gather() -> list[bool]:
    """``buffer_pool.gather_in_place`` against ``all_gather_into_tensor``: on the default group and on a
    group of every other rank (its global ranks not its group ranks), with the input a separate
    tensor and this rank's own slice of the output, in several dtypes. Every rank runs it."""
    import torch.distributed as dist

    from shardgen.backends.buffer_pool import gather_in_place

    world, me = dist.get_world_size(), dist.get_rank()
    evens = list(range(0, world, 2))
    sub = dist.new_group(evens, backend="gloo")  # every rank takes part in new_group
    results = []
    for group, members in ((dist.group.WORLD, list(range(world))), (sub, evens)):
        if me not in members:
            continue
        gw, gr = len(members), members.index(me)
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            inp = (torch.arange(7) + 100 * me).to(dtype)
            want = torch.empty(7 * gw, dtype=dtype)
            dist.all_gather_into_tensor(want, inp, group=group)
            out = torch.full((7 * gw,), -1).to(dtype)
            gather_in_place(out, inp, group).wait()
            results.append(bool(torch.equal(out, want)))
            own = torch.full((7 * gw,), -1).to(dtype)
            own.narrow(0, 7 * gr, 7).copy_(inp)
            gather_in_place(own, own.narrow(0, 7 * gr, 7), group).wait()
            results.append(bool(torch.equal(own, want)))
    dist.destroy_process_group(sub)
    return results
