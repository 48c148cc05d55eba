"""Running the examples and the README's scripts as a user would (tests/multirank/test_examples.py,
tests/multirank/test_readme.py): under torchrun and the DeepSpeed launcher, each in its own session, with
a hard timeout that kills its process group (the launcher and the ranks it started, nothing else).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ports import free_port

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
BIN = Path(sys.executable).parent
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
RUN_TIMEOUT_S = 300.0  # hard bound; a 2-core machine under load needs ~150 s for some


def launcher(console_script: str, module: str) -> list[str]:
    """The launcher's console script from this interpreter's venv, else ``python -m module``."""
    script = BIN / console_script
    return [str(script)] if script.exists() else [sys.executable, "-m", module]


def torchrun(script: str, *args: str, nproc: int = 2) -> list[str]:
    return [
        *launcher("torchrun", "torch.distributed.run"),
        "--nproc-per-node",
        str(nproc),
        "--master-port",
        str(free_port()),
        str(EXAMPLES / script),
        *args,
    ]


def deepspeed_launcher(script: str, *args: str, nproc: int = 2) -> list[str]:
    # On CPU (DS_ACCELERATOR=cpu) --num_gpus N starts N CPU ranks.
    return [
        *launcher("deepspeed", "deepspeed.launcher.runner"),
        "--num_gpus",
        str(nproc),
        "--master_port",
        str(free_port()),
        str(EXAMPLES / script),
        *args,
    ]


# The ranks print to one pipe, unbuffered: a line's text and its newline are two writes, so two
# ranks' lines may interleave ("rank 0: 'a'rank 1: 'b'\n\n"). Match a rank's line anywhere.
RANK_LINE = r"rank "


def run(cmd: list[str], timeout: float = RUN_TIMEOUT_S) -> tuple[int, str, float]:
    """Run ``cmd``; on a lost port race (another process bound the master port between our
    check and the store's bind) run it again on a new port, up to three times."""
    for _ in range(3):
        rc, out, elapsed = _run_once(cmd, timeout)
        if rc == 0 or "EADDRINUSE" not in out:
            break
        cmd = _new_port(cmd)
    return rc, out, elapsed


def _new_port(cmd: list[str]) -> list[str]:
    cmd = list(cmd)
    for i, arg in enumerate(cmd[:-1]):
        if arg in ("--master-port", "--master_port"):
            cmd[i + 1] = str(free_port())
    return cmd


def _run_once(cmd: list[str], timeout: float) -> tuple[int, str, float]:
    """Run ``cmd`` in a new session; kill its process group on timeout. (rc, output, seconds)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if not _cuda():
        env.setdefault("DS_ACCELERATOR", "cpu")
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    pgid = proc.pid  # a new session: the launcher leads its own process group
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(pgid)
        out, _ = proc.communicate()
        pytest.fail(f"timed out after {timeout:g}s: {' '.join(cmd)}\n--- output ---\n{out}")
    finally:
        if proc.returncode is None:
            _kill_group(pgid)
            proc.wait()
    if proc.returncode != 0:
        _kill_group(pgid)  # ranks the launcher may have left behind
    elapsed = time.monotonic() - t0
    print(f"$ {' '.join(cmd)}  ({elapsed:.1f}s, rc={proc.returncode})\n{out}")
    return proc.returncode, out, elapsed


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
