"""The tick's collective on gloo, side by side: the all-gather of every rank's row that
``ControlPlane.agree`` issues, against the all-reduce (SUM) of a ``[world, NCOLS]`` int64 matrix,
zero but for each rank's own row, that it issued before (the same agreed state).

    python benchmarks/tick.py                      # 2 gloo ranks on CPU
    python benchmarks/tick.py --nproc 3 --ticks 2000 --rounds 4 --json tick.json

Every rank issues ``--ticks`` back to back of one form, then of the other, rounds alternating
them so that drift hits both. Prints, per form, the process CPU (every thread: gloo's own
included) and the wall time per tick on rank 0, and the ratio old / new of each.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import run_as_ranks, script_args, write_json  # noqa: E402


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from shardgen.core.protocol import NCOLS, ControlPlane, TickRow

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(backend="gloo")  # the engine's control group is a gloo group of its own
    plane = ControlPlane(group, rank, world)
    row = TickRow(live=rank + 1, pending=0, open=1, pause=0, fingerprint=0, tokens=3, head_rows=3,
                  held_tokens=3, held_head_rows=3, towers=0, held_towers=0)  # fmt: skip
    matrix = torch.zeros((world, NCOLS), dtype=torch.int64)

    def all_gather() -> list[int]:
        return [r.live for r in plane.agree(row).rows]

    def all_reduce() -> list[int]:
        matrix.zero_()
        matrix[rank] = torch.tensor(row.to_vector(), dtype=torch.int64)
        dist.all_reduce(matrix, op=dist.ReduceOp.SUM, group=group, async_op=True).wait()
        return [TickRow.from_vector(v).live for v in matrix.tolist()]

    forms = {"all_gather": all_gather, "all_reduce": all_reduce}
    assert all_gather() == all_reduce() == list(range(1, world + 1))  # the same agreed state
    cpu = dict.fromkeys(forms, 0.0)
    wall = dict.fromkeys(forms, 0.0)
    for _ in range(args.rounds):
        for name, fn in forms.items():
            dist.barrier(group=group)
            c0, t0 = time.process_time(), time.perf_counter()
            for _ in range(args.ticks):
                fn()
            cpu[name] += time.process_time() - c0
            wall[name] += time.perf_counter() - t0
    n = args.rounds * args.ticks
    if rank == 0:
        res = {
            "world": world,
            "ticks": n,
            "cpu_ms_per_tick": {k: 1e3 * v / n for k, v in cpu.items()},
            "wall_ms_per_tick": {k: 1e3 * v / n for k, v in wall.items()},
            "cpu_ratio_old_new": cpu["all_reduce"] / cpu["all_gather"],
            "wall_ratio_old_new": wall["all_reduce"] / wall["all_gather"],
        }
        for k in forms:
            c, w = res["cpu_ms_per_tick"][k], res["wall_ms_per_tick"][k]
            print(f"{k:10s}: {c:.3f} ms CPU, {w:.3f} ms wall per tick")
        c, w = res["cpu_ratio_old_new"], res["wall_ratio_old_new"]
        print(f"all_reduce / all_gather: CPU {c:.2f}x, wall {w:.2f}x")
        write_json(args.json, res)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--ticks", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--json", default=None)
    args = p.parse_args(script_args())
    run_as_ranks(__file__, args.nproc, rank_main, args)


if __name__ == "__main__":
    main()
