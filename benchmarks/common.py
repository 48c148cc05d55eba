"""Shared by the benchmarks: relaunch a script under torch's launcher when not already a rank."""

from __future__ import annotations

import ctypes
import gc
import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

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


def run_as_ranks(script: str, nproc: int, rank_main: Callable[[Any], None], args: Any) -> None:
    """``rank_main(args)`` when this process is a rank; else relaunch ``script`` on ``nproc`` ranks."""
    if "RANK" in os.environ:
        rank_main(args)
    else:
        relaunch_as_ranks(script, nproc)


def write_json(path: str | None, obj: Any) -> None:
    """Write the results as JSON when ``--json`` named a file."""
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2)


def vm_hwm_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise KeyError("VmHWM")


def reset_peak() -> float:
    """Free what is garbage, give free heap memory back, reset VmHWM; the baseline in MiB."""
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return vm_hwm_mb()
