"""A script's rank as its own process, forked from the test ranks' fork server (``world.py``: torch
and transformers imported once) instead of a fresh interpreter, which spends about 5 s of CPU on
those imports. The fault worlds (``fault_ranks.py``) and the examples' runs (``example_runs.py``)
start their ranks so.

The rank runs the script as ``__main__``, as ``python script.py args`` would: the script's folder
first on ``sys.path``, its output in a log file, and the interpreter's exit sequence (non-daemon
threads joined, then ``atexit``), which a forked multiprocessing child would otherwise skip.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

from world import _WATCHDOG_THREAD, _parent_watchdog, start_context


def _run_script(script: str, argv: list[str], env: dict, log: str, cwd: str | None, parent: int) -> None:
    """In the forked rank: ``python script *argv`` with exactly ``env``, stdout and stderr to ``log``."""
    import atexit
    import runpy

    os.environ.clear()
    os.environ.update(env)
    # the test process gone (even SIGKILLed), the rank goes too, as a World's ranks do
    threading.Thread(target=_parent_watchdog, args=(parent,), name=_WATCHDOG_THREAD, daemon=True).start()
    import rounding
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rounding.apply_env()  # SHARDGEN_TEST_SMALL_ROWS as this rank's environment says
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    if env.get("PYTHONUNBUFFERED"):  # read at start-up by a fresh interpreter; the fork started before
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(line_buffering=True, write_through=True)
    if cwd is not None:
        os.chdir(cwd)
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    code: object = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code
    except BaseException:
        sys.excepthook(*sys.exc_info())  # as the interpreter reports an uncaught exception
        code = 1
    # What the interpreter does at exit and a forked multiprocessing child skips: wait for the
    # non-daemon threads, then run the atexit hooks (shardgen's exit guard, rank 0's linger).
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else (0 if code is None else 1))


class Forked:
    """A rank forked from the fork server, with the ``subprocess.Popen`` calls the tests use."""

    def __init__(self, script: str, argv: list[str], env: dict, log: str, cwd: str | None = None) -> None:
        args = (script, argv, env, log, cwd, os.getpid())
        self._proc = start_context().Process(target=_run_script, args=args, daemon=False)
        self._proc.start()
        self.pid = self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout or 0)
        return self.returncode

    def kill(self) -> None:
        """SIGKILL by pid (nothing if it has exited), then reap it."""
        if self.returncode is None:
            self._proc.kill()
        self._proc.join(10)
