"""The self-launcher: spawn local ranks with torch's launcher, each running ``python -m shardgen ...``.

    launch(["run", "--prompts", "p.jsonl", "--out", "r.jsonl"], nproc=4)
    # = python -m torch.distributed.run --standalone --nproc-per-node=4 -m shardgen run ...

Used by ``shardgen run --nproc``, ``shardgen demo`` and ``shardgen bench``. The ranks die with
the launcher (``PR_SET_PDEATHSIG`` on Linux), so killing it never leaves ranks running alone.
torch's launcher runs inside ``python -m shardgen.launch`` (``agent_main``): where a rank is
lost, that says so in one line, naming the rank and, for ``shardgen run``, the exact command
that resumes the job, in place of torch's ``ChildFailedError`` traceback and log lines.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading

from shardgen.errors import ExitCode


def launch(
    argv: list[str],
    nproc: int,
    *,
    max_restarts: int = 0,
    timeout: float | None = None,
    env: dict[str, str] | None = None,
    resume: str | None = None,
) -> ExitCode:
    """Run ``python -m shardgen <argv>`` on ``nproc`` local ranks (gloo/c10d, torch's launcher).

    Returns ``OK`` when every rank succeeded, ``FAILED`` otherwise, ``TIMEOUT`` past ``timeout``,
    ``INTERRUPTED`` / ``TERMINATED`` when this process got SIGINT / SIGTERM (passed on to the
    ranks, which end quietly; the caller says the one line). ``resume``: the command that
    resumes the job, said when a rank is lost.
    """
    cmd = [sys.executable, "-m", "shardgen.launch", "--standalone", f"--nproc-per-node={nproc}"]
    if max_restarts:
        cmd.append(f"--max-restarts={max_restarts}")
    cmd += ["-m", "shardgen", *argv]
    env = dict(os.environ if env is None else env)
    env.setdefault("OMP_NUM_THREADS", "1")  # torch's launcher would set it too, with a warning
    # A store shared with the agent keeps the keys of a failed attempt, and the restarted ranks
    # then connect their gloo groups to dead peers (pytorch/pytorch#135712): one store per attempt.
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    env[LAUNCHED_ENV] = "1"  # the ranks leave the one line of an interrupt to this process
    if resume:
        env[RESUME_ENV] = resume
    # The agent in a session of its own (as torch puts the ranks): a terminal's Ctrl-C reaches
    # this process alone, which passes it on once; a second SIGINT in the middle of the agent's
    # shutdown would cut it short with a traceback.
    proc = subprocess.Popen(cmd, env=env, preexec_fn=die_with_parent, start_new_session=True)
    got: list[int] = []

    def stop(signum: int, frame: object) -> None:
        if not got:
            got.append(signum)
            proc.send_signal(signum)  # the agent stops its ranks with the same signal
            # torch's agent gives its ranks 30 s, then SIGKILL; past that, it is stuck itself.
            kill = threading.Timer(STOP_WAIT_S, proc.kill)  # the ranks die with it (parent-death signal)
            kill.daemon = True
            kill.start()

    old = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            if not got:
                proc.terminate()
            try:
                proc.wait(timeout=15 if not got else STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                proc.kill()  # the ranks die with it (parent-death signal)
                proc.wait()
            rc = None
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    if got:
        return ExitCode(128 + got[0])
    if rc is None:
        return ExitCode.TIMEOUT
    return ExitCode.OK if rc == 0 else ExitCode.FAILED


#: How long the agent may take to stop its ranks after a signal before this process kills it.
STOP_WAIT_S = 45.0


RESUME_ENV = "SHARDGEN_RESUME_COMMAND"
LAUNCHED_ENV = "SHARDGEN_LAUNCHED"  # set for ranks spawned by launch()


def lost_ranks_line(failures: dict[int, object], resume: str | None) -> str | None:
    """One line for ranks that died by a signal (killed, out of memory): who, how, and how to go
    on. None when every failed rank exited by itself: such a rank said why on its own. A rank
    killed is said even when its peers then exited with an error of their own: they saw it gone
    (``PeerStalledError``) before the agent stopped them, and their lines do not say the signal."""
    codes = {r: _as_signal(int(getattr(f, "exitcode", 0))) for r, f in failures.items()}
    # The agent stops the others with SIGTERM once one fails: those are not the cause.
    cause = {r: c for r, c in codes.items() if c != -signal.SIGTERM} or codes
    lost = []
    for rank, f in sorted(failures.items()):
        code = codes[rank]
        if rank in cause and code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = "an unknown signal"
            lost.append(f"rank {rank} (pid {getattr(f, 'pid', '?')}) was killed by signal {-code} ({name})")
    if not lost:
        return None  # every failed rank exited with an error of its own, and said it
    line = f"shardgen: error: {'; '.join(lost)}; the other ranks were stopped."
    if resume:
        line += f" Results so far are in the journals, which are intact: resume with: {resume}"
    return line


def _as_signal(code: int) -> int:
    """A rank's exit code, with a ``shardgen run`` rank's quiet exit on SIGINT / SIGTERM (128 + the
    signal's number: ``core.process.exit_on_signals``) read as that signal (``-signum``)."""
    if code - 128 in (signal.SIGINT, signal.SIGTERM):
        return 128 - code
    return code


def agent_main(argv: list[str]) -> int:
    """torch's launcher (``torch.distributed.run``'s arguments), with a lost rank said in one
    line (``lost_ranks_line``) instead of its traceback; its own log lines below errors only.
    On SIGINT / SIGTERM it stops its ranks with the same signal (torch's agent does) and exits
    128 + the signal's number, silently: ``launch``, which sent it, says the line."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    # torch's elastic modules set each logger's own level at import: quiet them one by one (its
    # "Received 2 death signal, shutting down workers" would be a second line on Ctrl-C).
    for name in ["torch.distributed.elastic", *logging.root.manager.loggerDict]:
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        torchrun.run(torchrun.parse_args(argv))
    except SignalException as e:
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        line = lost_ranks_line(dict(e.failures), os.environ.get(RESUME_ENV))
        if line:
            print(line, file=sys.stderr, flush=True)
        return int(ExitCode.FAILED)
    return 0


def die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this process when its parent dies (no orphaned ranks)."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG


def is_rank() -> bool:
    """Is this process one rank of a launched world (``RANK`` set by torchrun or our launcher)?"""
    return "RANK" in os.environ


if __name__ == "__main__":
    try:
        sys.exit(agent_main(sys.argv[1:]))
    except KeyboardInterrupt:  # a SIGINT before torch's agent handles signals: no traceback either
        sys.exit(128 + signal.SIGINT)
