"""Where an FSDP2 per-layer decode step's time goes, against its floor (PERFORMANCE section 18).

    PYTHONPATH=src .venv/bin/python benchmarks/fsdp2_split.py --rounds 3

The model, batch and step of ``allocator.py``'s per-layer measure (medium Llama: hidden 512, 6
layers, vocabulary 32000; 4 prompts of 8 tokens, greedy, no EOS; one step is
``(t(N tokens) - t(1 token)) / (N - 1)``), on 2 gloo ranks: ``Engine(model, backend="fsdp2",
gather="per-layer")`` beside the floor's two parts, the unsharded model's ``generate`` and one
broadcast per rank per layer of the same bytes into kept buffers (``allocator.py``'s
``floor broadcasts``).

The engine's step is split by timers wrapped around FSDP2's own hooks and shardgen's gather
(exclusive times: a timer nested in another is taken out of the outer one):

- ``gather wait``: waiting for the broadcasts of a unit's all-gather (``pool.InPlaceGather.wait``),
  the bytes the floor moves, plus whatever the rank waits for its peer;
- ``copy-in``: ``FSDPParamGroup.unshard`` less the wait: the shard copied into the gather buffer,
  the buffer taken from the pool, the broadcasts issued;
- ``copy-out``: ``FSDPParamGroup.wait_for_unshard``: the gathered buffer split into the unsharded
  parameters;
- ``reshard``: ``FSDPParamGroup.reshard`` (the unsharded storages freed back to the pool);
- ``hooks``: FSDP2's pre- and post-forward hooks less the above (its state machine, input casts);
- ``compute``: the engine's forward time (``stats()["forward_s"]``) less all of the above: the
  model's arithmetic and the forward's own Python;
- ``outside forwards``: the step less the forward time: the tick's all-gather
  (``control_s``, shown apart), sampling, the driver's bookkeeping;
- ``faults``: minor page faults per step of the process (the engine's, and the unsharded
  model's ``generate``).

A third model beside them, ``fsdp2 kept unsharded``: the same model sharded by FSDP2 per layer
with ``reshard_after_forward=False``, so after its first forward its steps run FSDP2's hooks on
gathered weights and gather nothing: the cost of FSDP2's forward itself, apart from the gathers.

Each rank's figures are its own; the table shows rank 0's and the worst of the two for the step.
"""

from __future__ import annotations

import argparse
import functools
import os
import resource
import sys
import threading
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(__file__))
from allocator import build_medium, floor_broadcasts, floor_buffers  # noqa: E402
from common import run_as_ranks, script_args, write_json  # noqa: E402

_local = threading.local()
TIMES: dict[str, float] = defaultdict(float)


def _timed(name: str, fn):
    """``fn`` with its exclusive time added to ``TIMES[name]`` (nested timed calls taken out)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        stack = getattr(_local, "stack", None)
        if stack is None:
            stack = _local.stack = []
        stack.append(0.0)  # time of the timed calls nested in this one
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            total = time.perf_counter() - t0
            nested = stack.pop()
            TIMES[name] += total - nested
            if stack:
                stack[-1] += total

    return wrapper


def instrument() -> None:
    """Wrap FSDP2's hooks and shardgen's in-place gather with timers (before any model is sharded:
    FSDP2 registers its hooks as bound methods)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    from shardgen.backends import buffer_pool as pool

    FSDPState._pre_forward = _timed("hooks", FSDPState._pre_forward)
    FSDPState._post_forward = _timed("hooks", FSDPState._post_forward)
    FSDPParamGroup.unshard = _timed("copy-in", FSDPParamGroup.unshard)
    FSDPParamGroup.wait_for_unshard = _timed("copy-out", FSDPParamGroup.wait_for_unshard)
    FSDPParamGroup.reshard = _timed("reshard", FSDPParamGroup.reshard)
    pool.InPlaceGather.wait = _timed("gather wait", pool.InPlaceGather.wait)


PARTS = ("gather wait", "copy-in", "copy-out", "reshard", "hooks")


def rank_main(args: argparse.Namespace) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch
    import torch.distributed as dist

    import shardgen

    torch.set_num_threads(1)
    shardgen.init()
    instrument()
    world, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(1234)  # the same batch on every rank
    ids = torch.randint(3, 32000, (args.batch, args.prompt_len), generator=g)
    mask = torch.ones_like(ids)
    engine = shardgen.Engine(build_medium(), backend="fsdp2", gather="per-layer", max_batch_size=args.batch)
    plain = build_medium()
    # The same model sharded by FSDP2 and kept unsharded after its first gather
    # (reshard_after_forward=False): its forwards run FSDP2's hooks on gathered weights, no gathers.
    from torch.distributed.fsdp import fully_shard

    kept = build_medium()
    for layer in kept.model.layers:
        fully_shard(layer, reshard_after_forward=False)
    fully_shard(kept, reshard_after_forward=False)

    bufs = floor_buffers(plain, world)
    group = dist.new_group(backend="gloo")

    def shardgen_run(n: int) -> None:
        engine.generate_ids(ids, mask, max_new_tokens=n, eos_token_id=[])

    def compute(n: int) -> None:
        with torch.no_grad():
            plain.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False)

    def unsharded(n: int) -> None:
        with torch.no_grad():
            kept.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, synced_gpus=False)

    def broadcasts(n: int) -> None:
        floor_broadcasts(bufs, n, group)

    def snapshot() -> dict[str, float]:
        s = engine.stats()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        return {**TIMES, "forward": s["forward_s"], "tick": s["control_s"], "faults": faults}

    def timed(fn, n: int) -> tuple[float, dict[str, float]]:
        dist.barrier()
        before = snapshot()
        t0 = time.perf_counter()
        fn(n)
        dist.barrier()
        wall = time.perf_counter() - t0
        after = snapshot()
        return wall, {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}

    methods = {
        "shardgen fsdp2": shardgen_run,
        "floor compute": compute,
        "floor broadcasts": broadcasts,
        "fsdp2 kept unsharded": unsharded,
    }
    for fn in methods.values():  # warm-up: first forwards, pools, kernels
        fn(2)
    rounds: list[dict[str, float]] = []
    for _ in range(args.rounds):
        row: dict[str, float] = {}
        for name, fn in methods.items():
            (full, fparts), (one, oparts) = timed(fn, args.new_tokens), timed(fn, 1)
            per = 1e3 / (args.new_tokens - 1)
            row[name] = per * (full - one)
            row[f"{name} faults"] = per / 1e3 * (fparts.get("faults", 0) - oparts.get("faults", 0))
            if name == "shardgen fsdp2":
                d = {k: per * (fparts[k] - oparts.get(k, 0.0)) for k in fparts if k != "faults"}
                for k in PARTS:
                    row[k] = d.get(k, 0.0)
                row["compute"] = d["forward"] - sum(row[k] for k in PARTS)
                row["outside forwards"] = row[name] - d["forward"]
                row["tick"] = d["tick"]
        row["floor"] = row["floor compute"] + row["floor broadcasts"]
        rounds.append(row)
    engine.close()
    gathered: list = [None] * world
    dist.all_gather_object(gathered, rounds)
    if rank == 0:
        out = {"config": vars(args), "ranks": gathered}
        print(report(gathered))
        write_json(args.json, out)
    dist.destroy_process_group()


def report(ranks: list[list[dict[str, float]]]) -> str:
    """A table: per round, rank 0's split of the step (ms) and the ratios to the floor."""
    cols = ["shardgen fsdp2", "floor", "floor compute", "floor broadcasts", "fsdp2 kept unsharded", "compute",
            *PARTS, "outside forwards", "tick"]  # fmt: skip
    cols += ["shardgen fsdp2 faults", "floor compute faults"]
    heads = [c if c.endswith("faults") else f"{c} ms" for c in cols]
    lines = ["| round | x floor (worst rank) | " + " | ".join(heads) + " |"]
    lines.append("|" + "---|" * (len(cols) + 2))
    for i, row in enumerate(ranks[0]):
        worst = max(r[i]["shardgen fsdp2"] / r[i]["floor"] for r in ranks)
        lines.append(f"| {i + 1} | {worst:.2f} | " + " | ".join(f"{row[c]:.1f}" for c in cols) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=12)
    p.add_argument("--json", default=None)
    args = p.parse_args(script_args())
    run_as_ranks(os.path.abspath(__file__), 2, rank_main, args)


if __name__ == "__main__":
    main()
