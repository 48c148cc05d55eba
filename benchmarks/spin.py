"""A peer whose user thread spins in pure Python: how long do the other ranks' 20 tokens take?

    python benchmarks/spin.py                          # the engine's default (0.2 ms switch interval)
    python benchmarks/spin.py --switch-interval 0.005  # Python's default: leave it alone

Rank 1's main thread spins (``while ...: i += 1``) for ``--spin-s`` seconds while rank 0
generates 20 tokens on a tiny FSDP2 Llama; prints rank 0's time. The driver thread needs
the GIL after every op, and a spinning thread gives it up only once per switch interval.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path[:0] = [os.path.dirname(__file__), os.path.join(os.path.dirname(__file__), "..", "tests", "helpers")]
from common import run_as_ranks, script_args  # noqa: E402


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from models import batch, tiny_model

    import shardgen

    torch.set_num_threads(1)
    rank, _ = shardgen.init()
    interval = None if args.switch_interval == 0.005 else args.switch_interval
    eng = shardgen.Engine(tiny_model("llama", seed=3), backend="fsdp2", gil_switch_interval=interval)
    ids, mask = batch([4, 6], seed=1)
    eng.generate_ids(ids, attention_mask=mask, max_new_tokens=5)  # warm-up
    dist.barrier()
    t0 = time.monotonic()
    if rank == 1:
        i = 0
        while time.monotonic() - t0 < args.spin_s:
            i += 1
    else:
        eng.generate_ids(ids, attention_mask=mask, max_new_tokens=20, eos_token_id=[])
        print(
            f"switch interval {sys.getswitchinterval() * 1e3:.1f} ms: rank 0's 20 tokens took "
            f"{time.monotonic() - t0:.2f} s while rank 1 spins",
            flush=True,
        )
    eng.close()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--switch-interval", type=float, default=0.0002)
    p.add_argument("--spin-s", type=float, default=6.0)
    args = p.parse_args(script_args())
    run_as_ranks(__file__, 2, rank_main, args)


if __name__ == "__main__":
    main()
