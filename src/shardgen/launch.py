"""The self-launcher: spawn local ranks with torch's launcher, each running ``python -m shardgen ...``.

    launch(["run", "--prompts", "p.jsonl", "--out", "r.jsonl"], nproc=4)
    # = python -m torch.distributed.run --standalone --nproc-per-node=4 -m shardgen run ...

Used by ``shardgen run --nproc``, ``shardgen demo`` and ``shardgen bench``. The ranks die with
the launcher (``PR_SET_PDEATHSIG`` on Linux), so killing it never leaves ranks running alone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

from shardgen.errors import ExitCode


def launch(
    argv: list[str],
    nproc: int,
    *,
    max_restarts: int = 0,
    timeout: float | None = None,
    env: dict[str, str] | None = None,
) -> ExitCode:
    """Run ``python -m shardgen <argv>`` on ``nproc`` local ranks (gloo/c10d, torch's launcher).

    Returns ``OK`` when every rank succeeded, ``FAILED`` otherwise, ``TIMEOUT`` past ``timeout``.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    if max_restarts:
        cmd.append(f"--max-restarts={max_restarts}")
    cmd += ["-m", "shardgen", *argv]
    env = dict(os.environ if env is None else env)
    env.setdefault("OMP_NUM_THREADS", "1")  # torch's launcher would set it too, with a warning
    # A store shared with the agent keeps the keys of a failed attempt, and the restarted ranks
    # then connect their gloo groups to dead peers (pytorch/pytorch#135712): one store per attempt.
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    proc = subprocess.Popen(cmd, env=env, preexec_fn=die_with_parent)
    old = signal.signal(signal.SIGTERM, lambda *_: proc.terminate())  # the agent stops its ranks
    try:
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()  # the ranks die with it (parent-death signal)
                proc.wait()
            return ExitCode.TIMEOUT
        except KeyboardInterrupt:  # the terminal sent SIGINT to the agent as well
            proc.wait()
            return ExitCode.FAILED
    finally:
        signal.signal(signal.SIGTERM, old)
    return ExitCode.OK if rc == 0 else ExitCode.FAILED


def die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this process when its parent dies (no orphaned ranks)."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG


def is_rank() -> bool:
    """Is this process one rank of a launched world (``RANK`` set by torchrun or our launcher)?"""
    return "RANK" in os.environ
