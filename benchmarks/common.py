"""Shared by the benchmarks: relaunch a script under torch's launcher when not already a rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys

_ARGV = "SHARDGEN_BENCHMARK_ARGV"


def relaunch_as_ranks(script: str, nproc: int) -> None:
    """Run ``script`` with the same arguments on ``nproc`` local gloo ranks, then exit with its code.

    The arguments travel in the environment, not on the command line: torch's launcher parses
    the whole command line with abbreviations on, so a script flag such as ``--nproc`` after the
    script name is taken as an ambiguous abbreviation of its own ``--nproc-per-node``.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", script]
    env = {**os.environ, "OMP_NUM_THREADS": "1", _ARGV: json.dumps(sys.argv[1:])}
    sys.exit(subprocess.run(cmd, env=env, timeout=3600).returncode)


def script_args() -> list[str]:
    """This script's arguments: the relaunched rank's from the environment, else the command line."""
    return json.loads(os.environ[_ARGV]) if _ARGV in os.environ else sys.argv[1:]
