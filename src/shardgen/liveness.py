"""Heartbeats on the c10d store, a watch on every peer's, and error propagation.

One thread per engine (``shardgen-liveness-r<R>``) does both jobs, so a driver
that is busy (a long prefill) or blocked in a collective never delays its own
heartbeat. Every ``timeouts.heartbeat`` seconds it:

1. writes ``<prefix>/hb/<rank>`` = JSON {seq, tick, phase, time, pid, host};
2. reads every peer's heartbeat: a peer whose ``seq`` has not changed for
   ``timeouts.stall`` (measured on this host's monotonic clock, so hosts' clocks
   never matter) is stalled; a peer that wrote ``<prefix>/error/<rank>`` failed.

On the first stalled or failed peer it calls ``on_failure(error)`` once and stops.
Nothing here is a collective: the store is shared, but no rank waits for another.

Stacks: each engine registers ``faulthandler`` on ``SIGUSR2`` writing to a per-pid
file; a rank that finds a stalled peer on its own host signals it and quotes the
dump. A peer stopped with SIGSTOP cannot answer; its process state says so.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .errors import PeerFailedError, PeerStalledError
from .log import get_logger
from .timeouts import Timeouts

log = get_logger()
STACK_SIGNAL = signal.SIGUSR2
_stack_file: Any = None


def stack_file_path(pid: int) -> Path:
    return Path(tempfile.gettempdir()) / "shardgen-stacks" / f"{pid}.txt"


def enable_stack_dumps() -> None:
    """Make this process dump all threads' Python stacks to its stack file on ``STACK_SIGNAL``."""
    global _stack_file
    if _stack_file is not None:
        return
    path = stack_file_path(os.getpid())
    path.parent.mkdir(parents=True, exist_ok=True)
    _stack_file = open(path, "w")  # faulthandler writes to it for the process lifetime
    faulthandler.register(STACK_SIGNAL, file=_stack_file, all_threads=True, chain=False)


def pid_namespace() -> str:
    """This kernel's boot id and PID-namespace inode: equal for two processes exactly when
    their pids mean the same thing (same host, same container), unlike hostnames."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return f"{socket.gethostname()}:?"


def _process_state(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]  # R, S, D, T (stopped), Z ...


def local_stack(pid: int, wait_s: float = 1.0) -> str:
    """Ask a process on this host for its Python stacks; explain when it cannot answer."""
    state = _process_state(pid)
    if state is None:
        return f"(process {pid} is gone)"
    if state in ("T", "t"):
        return f"(process {pid} is stopped (state {state}): it cannot dump its stack)"
    if state == "Z":
        return f"(process {pid} is a zombie: it exited)"
    path = stack_file_path(pid)
    before = path.stat().st_size if path.exists() else 0
    try:
        os.kill(pid, STACK_SIGNAL)
    except OSError as e:
        return f"(cannot signal process {pid}: {e})"
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if path.exists() and path.stat().st_size > before:
            time.sleep(0.1)  # let the dump finish
            with open(path) as f:
                f.seek(before)
                return f.read().strip()
        time.sleep(0.05)
    return f"(process {pid} did not dump its stack within {wait_s:g}s)"


class Liveness:
    """Heartbeat writer and peer watcher for one engine on one rank."""

    def __init__(
        self,
        store: Any,
        prefix: str,
        rank: int,
        world: int,
        timeouts: Timeouts,
        status: Callable[[], tuple[int, str]],
        on_failure: Callable[[BaseException], None],
    ) -> None:
        self.store = store
        self.prefix = prefix
        self.rank = rank
        self.world = world
        self.stall_timeout = timeouts.stall
        self.interval = timeouts.heartbeat
        self.status = status
        self.on_failure = on_failure
        self.host = socket.gethostname()
        self.pidns = pid_namespace()
        self._seq = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"shardgen-liveness-r{rank}", daemon=True)

    def start(self) -> None:
        enable_stack_dumps()
        self.beat()
        self._thread.start()

    def stop(self) -> None:
        """Stop beating and watching (after the engine closed or failed). Not collective."""
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(5)

    def beat(self, phase: str | None = None) -> None:
        tick, cur = self.status()
        self._seq += 1
        rec = {"seq": self._seq, "tick": tick, "phase": phase or cur, "time": time.time()}
        rec.update(pid=os.getpid(), host=self.host, pidns=self.pidns)
        self.store.set(f"{self.prefix}/hb/{self.rank}", json.dumps(rec))

    def report_error(self, err: BaseException) -> None:
        """Tell peers this rank's driver raised (they raise ``PeerFailedError``)."""
        try:
            self.store.set(f"{self.prefix}/error/{self.rank}", f"{type(err).__name__}: {err}")
            self.beat("failed")
        except Exception as e:  # the store may be gone with its host
            log.warning("rank %d: could not publish the error to peers: %s", self.rank, e)

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        peers = [r for r in range(self.world) if r != self.rank]
        last: dict[int, tuple[int, float]] = {r: (-1, time.monotonic()) for r in peers}
        records: dict[int, dict[str, Any]] = {}
        store_down_since: float | None = None
        while not self._stop.wait(self.interval):
            try:
                self.beat()
                err = self._check(peers, last, records)
                store_down_since = None
            except Exception as e:  # a dead store host is a failure of its own
                if self._stop.is_set():
                    return
                now = time.monotonic()
                store_down_since = store_down_since or now
                if now - store_down_since < self.stall_timeout:
                    continue
                err = PeerStalledError(
                    f"rank {self.rank}: the c10d store has been unreachable for {self.stall_timeout:g}s "
                    f"(its host, usually rank 0, is probably gone): {e}"
                )
            if err is not None and not self._stop.is_set():
                self.on_failure(err)
                return

    def _check(
        self, peers: list[int], last: dict[int, tuple[int, float]], records: dict[int, dict[str, Any]]
    ) -> BaseException | None:
        now = time.monotonic()
        errs = [f"{self.prefix}/error/{r}" for r in peers]
        for r, key in zip(peers, errs, strict=True):
            if self.store.check([key]):
                msg = self.store.get(key).decode()
                return PeerFailedError(f"rank {r} raised {msg}")
        hb_keys = [f"{self.prefix}/hb/{r}" for r in peers]
        for r, key in zip(peers, hb_keys, strict=True):
            if not self.store.check([key]):
                continue
            rec = json.loads(self.store.get(key))
            records[r] = rec
            if rec["phase"] in ("closed",):
                last[r] = (rec["seq"], now)
                continue
            if rec["seq"] != last[r][0]:
                last[r] = (rec["seq"], now)
            if rec.get("pidns") == self.pidns and _process_state(int(rec["pid"])) in (None, "Z"):
                return self._stalled(r, rec, now - last[r][1])  # dead on this host: no need to wait
            if now - last[r][1] > self.stall_timeout:
                return self._stalled(r, rec, now - last[r][1])
        return None

    def _stalled(self, r: int, rec: dict[str, Any], silent_s: float) -> PeerStalledError:
        where = f"host {rec.get('host')}, pid {rec.get('pid')}"
        why = (
            "is gone (its process exited)"
            if silent_s < self.stall_timeout
            else f"sent no heartbeat for {silent_s:.1f}s (stall_timeout={self.stall_timeout:g}s)"
        )
        msg = f"rank {r} ({where}) {why}; last phase {rec.get('phase')!r} at tick {rec.get('tick')}"
        if rec.get("pidns") == self.pidns and isinstance(rec.get("pid"), int):
            msg += "\n--- its Python stack ---\n" + local_stack(rec["pid"])
        return PeerStalledError(msg)


def is_comm_error(err: BaseException) -> bool:
    """A broken collective (a symptom: the cause is usually a peer that died or stalled)."""
    import torch.distributed as dist

    if isinstance(err, getattr(dist, "DistError", ())):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and any(
        w in text for w in ("gloo", "nccl", "connection", "timed out", "peer", "socket")
    )
