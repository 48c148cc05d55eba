"""One rank of a fuzz schedule with a fault, started by tests/helpers/fuzz.py (one process per rank).

    RANK=0 WORLD_SIZE=3 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 python tests/helpers/fuzz_rank.py SEED

Prints ``EVENT <name> <json>`` lines; exits non-zero on any error.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path[:0] = [os.path.dirname(__file__), os.path.join(os.path.dirname(__file__), "..", "..", "src")]


def event(name: str, **data) -> None:
    print(f"EVENT {name} {json.dumps({'t': time.time(), **data})}", flush=True)


def main(seed: int) -> None:
    import torch

    torch.set_num_threads(1)
    from fuzz_schedule import make_schedule, run_schedule

    import shardgen

    rank, _ = shardgen.init(timeout_s=60)
    event("started", pid=os.getpid())
    run_schedule(make_schedule(seed), rank, event)


if __name__ == "__main__":
    try:
        main(int(sys.argv[1]))
    except BaseException as e:
        event("error", type=type(e).__name__, msg=str(e))
        raise
