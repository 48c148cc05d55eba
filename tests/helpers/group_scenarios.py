"""Scenarios for engines over groups (tests/multirank/test_groups.py): 4 ranks, two shard groups of 2."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from models import batch, eos_after, hf_generate, tiny_model
from world import assert_no_thread, rank

import shardgen

GROUPS = [[0, 1], [2, 3]]


def _mine() -> int:
    return 0 if rank() in GROUPS[0] else 1


def _workload(eng, ref, n_calls: int, seed: int) -> int:
    """``n_calls`` HF-checked calls, EOS at a different step in each; returns prefills."""
    for c in range(n_calls):
        ids, mask = batch([3 + c, 5, 2 + rank()], seed=seed + 7 * c)
        eos = eos_after(ref, ids, mask, row=c % 3, step=2 + 3 * c + rank())
        kw = dict(max_new_tokens=6 + 3 * rank() + c, eos_token_id=eos, pad_token_id=0)
        got = eng.generate_ids(ids, attention_mask=mask, **kw)
        exp = hf_generate(ref, ids, mask, **kw)
        assert torch.equal(got, exp), f"rank {rank()} call {c}: {got.tolist()} != HF {exp.tolist()}"
    return n_calls


def _gather(gather: str | None) -> dict:
    return {"gather": gather or "per-layer"}  # the shadows these scenarios count are lockstep's


def explicit_groups(sleep_s: float, arch: str = "llama", gather: str | None = None):
    """Two engines on explicit groups [0, 1] and [2, 3]; rank 3 is away for ``sleep_s`` first.

    Group A: uneven calls, an all_reduce on its own subgroup while its peer still generates,
    a pause (with a collective inside), then close (timed: it must not wait for group B),
    then a world barrier. Group B: rank 2 generates, then sits in a world barrier while
    rank 3 (back from its sleep) generates, then an all_reduce on its subgroup, then close.
    """
    pgs = [dist.new_group(GROUPS[0]), dist.new_group(GROUPS[1])]  # every rank, same order
    g = _mine()
    ref = tiny_model(arch, seed=21)
    eng = shardgen.Engine(
        tiny_model(arch, seed=21), backend="fsdp2", group=pgs[g], stall_timeout=60, **_gather(gather)
    )
    assert eng.ranks == GROUPS[g] and eng.world == 2 and eng.rank == rank()
    t0 = time.monotonic()
    if rank() == 3:
        time.sleep(sleep_s)
    calls = [1, 3, 2, 1][rank()]
    _workload(eng, ref, calls, seed=40 + rank())
    t = torch.tensor([float(rank())])
    if g == 0:
        dist.all_reduce(t, group=pgs[g])  # a peer may still be generating
        with eng.paused():  # group A's ranks only; group B keeps generating
            dist.all_reduce(torch.ones(1), group=pgs[g])
        eng.close()
        closed_at = time.monotonic() - t0
        dist.barrier()
    else:
        dist.barrier()  # rank 2 sits here while rank 3 generates: its driver shadows
        dist.all_reduce(t, group=pgs[g])
        eng.close()
        closed_at = time.monotonic() - t0
    assert t.item() == sum(GROUPS[g]), t
    assert_no_thread("shardgen-", timeout=5)
    for pg in pgs:
        if rank() in dist.get_process_group_ranks(pg):
            dist.destroy_process_group(pg)
    return closed_at, eng.stats()["prefills"], eng.stats()["shadow_forwards"]


def hsdp(sleep_s: float, arch: str = "llama", gather: str | None = None):
    """A model the user wrapped with ``fully_shard`` on a 2-D (replicate, shard) mesh: the engine
    derives its group (the rank's shard group) by itself. Rank 1 is away for ``sleep_s``;
    group B closes without waiting for it; rank 0 sits in a world all_reduce while rank 1
    generates (its driver shadows); outputs equal HF."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = tiny_model(arch, seed=22)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    ref = tiny_model(arch, seed=22)
    eng = shardgen.Engine(model, backend="fsdp2", stall_timeout=60, **_gather(gather))
    g = _mine()
    assert eng.ranks == GROUPS[g], eng.ranks
    t0 = time.monotonic()
    if rank() == 1:
        time.sleep(sleep_s)
    calls = [2, 1, 1, 3][rank()]
    _workload(eng, ref, calls, seed=60 + rank())
    if g == 1:
        eng.close()  # group B is not held up by group A's sleeper
    closed_at = time.monotonic() - t0
    t = torch.tensor([1.0])
    dist.all_reduce(t)  # the world, while group A's engine is still open
    if g == 0:
        eng.close()
    assert t.item() == 4.0
    assert_no_thread("shardgen-", timeout=5)
    return closed_at, eng.stats()["shadow_forwards"]


def deepspeed_subgroup(kind: str, sleep_s: float, gather: str | None = None):
    """A ZeRO-3 model partitioned over a data-parallel subgroup ([0, 1] and [2, 3]): through
    ``deepspeed.initialize(mpu=...)`` (``kind="mpu"``) or ``zero.Init(module=...,
    data_parallel_group=...)`` (``kind="zero_init"``). The engine derives its group from the
    parameters; rank 3 is away for ``sleep_s`` and group [0, 1] closes without waiting."""
    import deepspeed

    pgs = [dist.new_group(GROUPS[0]), dist.new_group(GROUPS[1])]
    g = _mine()
    model, ref = tiny_model("llama", seed=23), tiny_model("llama", seed=23)
    zero = {"stage": 3, "memory_efficient_linear": False}
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero}
    if kind == "mpu":
        other = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # the "model-parallel" dimension

        class MPU:  # Megatron's interface, data parallelism over the subgroup
            def get_data_parallel_group(self):
                return pgs[g]

            def get_data_parallel_rank(self):
                return dist.get_rank(pgs[g])

            def get_data_parallel_world_size(self):
                return 2

            def get_model_parallel_group(self):
                return other[rank() % 2]

            def get_model_parallel_rank(self):
                return dist.get_rank(other[rank() % 2])

            def get_model_parallel_world_size(self):
                return 2

        model, *_ = deepspeed.initialize(model=model, config=cfg, mpu=MPU())
    else:
        deepspeed.zero.Init(module=model, data_parallel_group=pgs[g], config_dict_or_path=cfg)
    eng = shardgen.Engine(model, backend="deepspeed", stall_timeout=60, **_gather(gather))
    assert eng.ranks == GROUPS[g], eng.ranks
    t0 = time.monotonic()
    if rank() == 3:
        time.sleep(sleep_s)
    calls = [1, 2, 1, 1][rank()]
    _workload(eng, ref, calls, seed=80 + rank())
    eng.close()
    closed_at = time.monotonic() - t0
    dist.barrier()
    return closed_at


def replica_groups(shard_size: int):
    """``groups.replica_group`` on every rank: (ranks of my group or None, replica) or the error."""
    from shardgen.core.groups import replica_group

    try:
        group, replica = replica_group(shard_size)
    except ValueError as e:
        return str(e)
    ranks = dist.get_process_group_ranks(group) if group is not None else None
    if group is not None:
        # Every member through its group once before any closes it (as ``not_a_member``): under
        # load a member returned from new_group and closed the group while its peer was still
        # connecting its gloo pair ("Connection closed by peer" there).
        dist.barrier(group=group)
        dist.destroy_process_group(group)
    return ranks, replica


def not_a_member():
    """Ranks 2 and 3 pass a group of ranks [0, 1] (``new_group`` gave them NON_GROUP_MEMBER)."""
    pg = dist.new_group(GROUPS[0])
    if rank() in GROUPS[0]:
        # Both members through the group once before either closes it: under load, one member
        # can return from new_group while the other is still connecting its gloo pair.
        dist.barrier(group=pg)
        dist.destroy_process_group(pg)
        return None
    try:
        shardgen.Engine(tiny_model("llama", seed=1), backend="fsdp2", group=pg)
    except ValueError as e:
        return str(e)
    return "constructed"
