"""Shared by the benchmarks: relaunch a script under torch's launcher when not already a rank."""

from __future__ import annotations

import os
import subprocess
import sys


def relaunch_as_ranks(script: str, nproc: int) -> None:
    """Run ``script`` with the same arguments on ``nproc`` local gloo ranks, then exit with its code."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", script, *sys.argv[1:]]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    sys.exit(subprocess.run(cmd, env=env, timeout=3600).returncode)
