"""The README's torchrun programs, one after another in one job (tests/multirank/test_readme.py):
``torchrun --nproc-per-node 2 tests/helpers/readme_programs.py a.py b.py ...`` (or its ranks forked
as torchrun starts them, tests/helpers/example_runs.py ``run_forked``) runs each file as its own
``__main__``, exactly as written, and prints ``=== done NAME`` on rank 0 once every rank has
finished it, so the output splits by program. One job instead of one per program: each launch
costs its ranks' imports.

A program ends with ``dist.destroy_process_group()``; while the others still follow it is a no-op
here (``shardgen.init()`` then finds the group initialized and returns it), and the job destroys
the group once, after the last.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import torch.distributed as dist


def main(paths: list[str]) -> None:
    destroy = dist.destroy_process_group
    dist.destroy_process_group = lambda *args, **kwargs: None  # the programs' last line
    try:
        for path in paths:
            runpy.run_path(path, run_name="__main__")
            dist.barrier()  # every rank's lines of this program are written before the marker
            if dist.get_rank() == 0:
                print(f"=== done {Path(path).name}", flush=True)
            dist.barrier()  # and none of the next program's before it
    finally:
        dist.destroy_process_group = destroy
    destroy()


if __name__ == "__main__":
    main(sys.argv[1:])
