"""Running the examples and the README's scripts as a user would (tests/multirank/test_examples.py,
tests/multirank/test_readme.py): under torchrun and the DeepSpeed launcher, each in its own session, with
a hard timeout that kills its process group (the launcher and the ranks it started, nothing else).

:func:`run_forked` starts a script's ranks as torchrun would (the same environment, each rank the
script's ``__main__``), forked from the server that the test ranks come from (tests/helpers/world.py):
a fresh interpreter spends about 5 s of CPU importing torch and transformers, most of a small
example's run. Launchers themselves are tested where they are the subject: ``shardgen run`` and
its torchrun agent in tests/multirank/test_cli*.py, the DeepSpeed launcher in test_examples.py.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from ports import free_port, lost_port_race

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
        if rc == 0 or not lost_port_race(out):
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


# ------------------------------------------------------------------ ranks forked, as torchrun starts them


def run_forked(
    script: str | Path, *args: str, nproc: int = 2, timeout: float = RUN_TIMEOUT_S
) -> tuple[int, str, float]:
    """Run ``script args`` on ``nproc`` ranks as ``torchrun --nproc-per-node nproc`` would: each rank
    gets torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...) and runs the script as
    ``__main__`` (tests/helpers/forked.py), all ranks writing to one output. As under torchrun, the
    first rank to fail ends the others (after a short grace); on ``timeout`` every rank is killed
    (by pid) and the test fails with the output. ``script``: a path, or an example's file name.
    -> (exit code, output, seconds); the exit code is the first failing rank's."""
    script = Path(script) if Path(script).is_absolute() else EXAMPLES / script
    for _ in range(3):  # a lost port race, as run() does
        rc, out, elapsed = _run_forked_once(script, list(args), nproc, timeout)
        if rc == 0 or not lost_port_race(out):
            break
    return rc, out, elapsed


def _run_forked_once(script: Path, args: list[str], nproc: int, timeout: float) -> tuple[int, str, float]:
    from forked import Forked

    port = str(free_port())
    fd, log = tempfile.mkstemp(prefix="shardgen-forked-", suffix=".log")
    os.close(fd)
    base = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port
    )
    if not _cuda():
        base.setdefault("DS_ACCELERATOR", "cpu")
    n = str(nproc)
    t0 = time.monotonic()
    ranks, rc, failed_at, timed_out = [], 0, 0.0, False
    try:
        for r in map(str, range(nproc)):
            env = dict(base, RANK=r, LOCAL_RANK=r, ROLE_RANK=r, GROUP_RANK="0")
            env.update(WORLD_SIZE=n, LOCAL_WORLD_SIZE=n, ROLE_WORLD_SIZE=n)
            ranks.append(Forked(str(script), args, env, log, cwd=str(ROOT)))
        while True:
            codes = [p.poll() for p in ranks]
            rc = rc or next((c for c in codes if c not in (None, 0)), 0)  # the first rank to fail
            now = time.monotonic()
            if None not in codes:
                break
            if now - t0 > timeout:
                timed_out = True
                break
            if rc and not failed_at:
                failed_at = now
            elif rc and now - failed_at > 5.0:  # torchrun's behaviour: a failed rank ends the job
                break
            time.sleep(0.05)
    finally:
        for p in ranks:
            p.kill()
        out = Path(log).read_text(errors="replace")
        os.unlink(log)
    if timed_out:
        pytest.fail(f"timed out after {timeout:g}s: {script} {' '.join(args)}\n--- output ---\n{out}")
    elapsed = time.monotonic() - t0
    print(f"$ ({nproc} forked ranks) {script} {' '.join(args)}  ({elapsed:.1f}s, rc={rc})\n{out}")
    return rc, out, elapsed
