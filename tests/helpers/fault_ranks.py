"""Fault-injection worlds: one process per rank of tests/helpers/liveness_rank.py, killed by pid on exit.

Not under torchrun's agent (which would kill the survivors itself), so a test sees
exactly what a healthy rank does. Each rank runs the script as ``__main__`` in a process forked
from the test ranks' fork server (``forked.py``), with its own environment, its output in its log
file, and the interpreter's exit sequence, as ``python script.py scenario`` would.
``SHARDGEN_TEST_START=spawn`` starts each as a fresh interpreter instead.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from forked import Forked
from ports import free_port
from world import start_method

_FRESH = start_method() == "spawn"

HERE = Path(__file__).parent
STALL = 4.0


class Ranks:
    """N rank processes of tests/helpers/liveness_rank.py, killed by pid on exit."""

    def __init__(
        self,
        scenario: str,
        world: int = 2,
        victim: int | None = None,
        script: str = "liveness_rank.py",
        extra_env: dict[str, str] | None = None,
    ) -> None:
        port = free_port()
        tag = f"{scenario}-w{world}-v{victim}"
        self.logs = [HERE.parents[1] / f".liveness-{os.getpid()}-{tag}-{r}.log" for r in range(world)]
        self.procs = []
        for r in range(world):
            env = {
                **os.environ,
                "RANK": str(r),
                "WORLD_SIZE": str(world),
                "LOCAL_RANK": str(r),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1",
                "STALL_TIMEOUT": str(STALL),
                "GLOO_SOCKET_IFNAME": "lo",
                "VICTIM": str(world - 1 if victim is None else victim),
                **(extra_env or {}),  # the scenario's settings (GATHER, BACKEND, ...)
            }
            if _FRESH:
                out = open(self.logs[r], "w")
                cmd = [sys.executable, str(HERE / script), scenario]
                self.procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT))
            else:
                open(self.logs[r], "w").close()  # the test may read it before the rank starts
                self.procs.append(Forked(str(HERE / script), [scenario], env, str(self.logs[r])))
        self.t0 = time.monotonic()

    def text(self, r: int) -> str:
        return self.logs[r].read_text()

    def events(self, r: int, name: str) -> list[dict]:
        out = []
        for line in self.text(r).splitlines():
            if line.startswith(f"EVENT {name} "):
                out.append(json.loads(line.split(" ", 2)[2]))
        return out

    def wait_event(self, r: int, name: str, timeout: float = 300.0, count: int = 1) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ev = self.events(r, name)
            if len(ev) >= count:
                return ev[count - 1]
            if self.procs[r].poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"rank {r} never reported {name!r}:\n{self.dump()}")

    def wait_mid_run(self, r: int, calls: int, timeout: float = 300.0) -> None:
        """Rank ``r`` has finished ``calls`` calls and its peers have read a heartbeat of its from
        after construction: a fault now is one mid-run, with a phase past tick 0 to report. Calls
        of the tiny model take about 0.1 s on an idle machine, faster than the heartbeat interval
        (``timeouts.derive``: ``stall / 10``, 0.4 s here), so counting calls alone is not enough."""
        from shardgen.timeouts import derive

        built = self.wait_event(r, "constructed", timeout=timeout)["t"]
        self.wait_event(r, "call_done", timeout=timeout, count=calls)
        beat = derive(STALL, 120.0).heartbeat
        time.sleep(max(0.0, built + 3 * beat - time.time()))  # a beat of its, then a read of every peer

    def wait_exit(self, r: int, timeout: float) -> tuple[int, float]:
        """(exit code, seconds waited); a rank still running after ``timeout`` fails the test."""
        t = time.monotonic()
        try:
            code = self.procs[r].wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"rank {r} still running after {timeout:.0f}s:\n{self.dump()}") from None
        return code, time.monotonic() - t

    def dump(self) -> str:
        return "\n".join(f"--- rank {r} ---\n{self.text(r)[-6000:]}" for r in range(len(self.procs)))

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                for sig in (signal.SIGCONT, signal.SIGKILL):
                    try:
                        os.kill(p.pid, sig)
                    except ProcessLookupError:
                        pass
            p.wait(10)
        for log in self.logs:
            log.unlink(missing_ok=True)
