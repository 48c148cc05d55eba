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

import atexit
import contextlib
import datetime
import faulthandler
import json
import os
import signal
import socket
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardgen.faults import verdict
from shardgen.faults.stalls import find_laggard, progress_key
from shardgen.faults.verdict import Verdict, describe, last_seen
from shardgen.log import get_logger
from shardgen.timeouts import Timeouts

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
    """Heartbeat writer and peer watcher for one engine on one rank.

    ``rank`` and ``ranks`` are global ranks: the engine's group (default: all ``world``
    ranks); only those are watched, and messages name them as users know them.
    """

    def __init__(
        self,
        store: Any,
        prefix: str,
        rank: int,
        world: int,
        timeouts: Timeouts,
        status: Callable[[], tuple[int, str, int, int]],
        on_failure: Callable[[BaseException], None],
        ranks: list[int] | None = None,
    ) -> None:
        self.ranks = list(ranks) if ranks is not None else list(range(world))  # global ranks watched
        self.prefix = prefix
        self.rank = rank
        self.world = world
        self.stall_timeout = timeouts.stall
        self.interval = timeouts.heartbeat
        self.linger_s = timeouts.verdict_linger
        # Store calls on a connection of our own, bounded where the store allows (get, wait);
        # a stopped store host blocks the others (check, set): the watchdog thread sees that.
        self.store = _own_connection(store, timeouts.store_call)
        self.store_call_s = timeouts.store_call
        self.store_grace = timeouts.store_lost
        self._records: dict[int, dict[str, Any]] = {}
        self._alive_t = time.monotonic()  # the last time a round of store calls completed
        self._fired = threading.Lock()
        self.status = status  # () -> (tick, phase, forwards, gathers entered)
        self.on_failure = on_failure
        self.host = socket.gethostname()
        self.pidns = pid_namespace()
        self.verdict: Verdict | None = None
        self._seq = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"shardgen-liveness-r{rank}", daemon=True)
        self._watchdog = threading.Thread(target=self._watch, name=f"shardgen-watchdog-r{rank}", daemon=True)

    def start(self) -> None:
        enable_stack_dumps()
        self.beat()
        if self.rank == 0:  # the c10d store's host (see verdict.py)
            _register_host(self)
        self._alive_t = time.monotonic()
        self._thread.start()
        self._watchdog.start()

    def stop(self) -> None:
        """Stop beating and watching (after the engine closed or failed). Not collective.

        Joins the threads (a daemon thread still inside a store call at interpreter exit can
        abort the process), within 10 s in all, except one blocked on an unreachable store: once
        no round of store calls has completed for ``stall_timeout`` (the watchdog's own
        criterion, past a round's interval), it is left. The store's host may stop right after
        the engine's last tick, while this rank closes."""
        self._stop.set()
        deadline = time.monotonic() + 10.0
        for t in (self._thread, self._watchdog):
            while t is not threading.current_thread() and t.is_alive():
                now = time.monotonic()
                if now >= deadline or now - self._alive_t > self.stall_timeout + self.interval:
                    break
                t.join(0.05)

    def record(self, phase: str | None = None) -> dict[str, Any]:
        """This rank's heartbeat: where its driver is, and who it is."""
        tick, cur, forwards, gathers = self.status()
        rec = {"seq": self._seq, "tick": tick, "phase": phase or cur, "time": time.time()}
        rec.update(forwards=forwards, gathers=gathers, pid=os.getpid(), host=self.host, pidns=self.pidns)
        return rec

    def beat(self, phase: str | None = None) -> None:
        self._seq += 1
        self.store.set(f"{self.prefix}/hb/{self.rank}", json.dumps(self.record(phase)))

    def blame(self, culprit: int, kind: str, message: str) -> BaseException:
        """Propose ``culprit`` as the cause; return the error of the verdict that stands (the
        first one any rank wrote). Not collective."""
        proposal = Verdict(culprit, kind, message, self.rank)
        try:
            self.verdict = verdict.publish(self.store, self.prefix, proposal)
        except Exception as e:  # the store may be gone with its host
            log.warning("rank %d: could not publish the verdict to peers: %s", self.rank, e)
            self.verdict = proposal
        return self.verdict.error(self.rank)

    def blame_absent(self, culprit: int, message: str) -> BaseException:
        """``blame()`` for a user thread (``close()``/``paused()`` bounds): adds the culprit's last
        heartbeat and never blocks past ``store_call`` s (a stopped store host blocks store calls;
        the watchdog then names it)."""
        if self.verdict is not None:
            return self.verdict.error(self.rank)
        box: list[BaseException] = []

        def run() -> None:
            rec = self.peer(culprit)
            box.append(
                self.blame(culprit, "absent", f"{message}; {describe(culprit, rec)}, {last_seen(rec)}")
            )

        t = threading.Thread(target=run, name=f"shardgen-blame-r{self.rank}", daemon=True)
        t.start()
        t.join(self.store_call_s)
        if box:
            return box[0]
        rec = self._records.get(culprit)  # the store is unreachable: its last heartbeat seen here
        full = f"{message}; {describe(culprit, rec)}, {last_seen(rec)}"
        return Verdict(culprit, "absent", full, self.rank).error(self.rank)

    def report_error(self, err: BaseException, what: str | None = None) -> None:
        """This rank's driver raised (or, with ``what``, the user's code: ``Type: message where``):
        make it the verdict unless a peer's failure came first."""
        if self.verdict is not None:
            return  # the driver raised the verdict's own error
        rec = self.record()
        what = what if what is not None else f"{type(err).__name__}: {err}"
        self.blame(self.rank, "raised", f"{describe(self.rank, rec)} raised {what}; {last_seen(rec)}")
        if self.verdict is not None and self.verdict.culprit == self.rank:
            with contextlib.suppress(Exception):
                self.beat("failed")

    def peer(self, r: int) -> dict[str, Any] | None:
        """Rank ``r``'s last heartbeat, if the store has one."""
        with contextlib.suppress(Exception):
            key = f"{self.prefix}/hb/{r}"
            if self.store.check([key]):
                return json.loads(self.store.get(key))
        return None

    def where_is(self, r: int) -> str:
        """``rank R (host H, pid P)``, its last phase, and its Python stacks when it runs on this
        host: for messages about a peer that is alive but elsewhere (not a verdict)."""
        rec = self.peer(r)
        return f"{describe(r, rec)}, {last_seen(rec)}" + (self._stack(rec) if rec else "")

    def leave(self, v: Verdict) -> None:
        """Leaving because of ``v``: say so in the heartbeat (nobody blames a rank that left) and
        acknowledge, so the store's host may exit."""
        with contextlib.suppress(Exception):
            self.beat(f"left: peer {v.culprit} failed")
            verdict.acknowledge(self.store, self.prefix, self.rank)

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        peers = [r for r in self.ranks if r != self.rank]
        last: dict[int, tuple[int, float]] = {r: (-1, time.monotonic()) for r in peers}
        moved: dict[int, tuple[Any, float]] = {}
        records = self._records
        store_down_since: float | None = None
        while not self._stop.wait(self.interval):
            try:
                self.beat()
                v = verdict.read(self.store, self.prefix)
                if v is None:
                    found = self._check(peers, last, moved, records)
                    if found is not None:
                        self.blame(*found)
                        v = self.verdict
                store_down_since = None
                self._alive_t = time.monotonic()
            except Exception as e:  # a dead store host is a failure of its own
                if self._stop.is_set():
                    return
                now = time.monotonic()
                store_down_since = store_down_since or now
                if now - store_down_since < self.store_grace:
                    continue
                down = now - store_down_since + self.interval
                self._store_lost(f"unreachable for {down:.1f}s ({type(e).__name__}: {e})")
                return
            if v is not None and not self._stop.is_set():
                self._fire(v, leave=v.culprit != self.rank)
                return

    def _watch(self) -> None:
        """A store call that never returns (its host stopped) blocks ``_run``; name the host."""
        while not self._stop.wait(self.interval):
            blocked = time.monotonic() - self._alive_t
            if blocked > self.stall_timeout + self.interval:
                self._store_lost(f"its calls blocked for {blocked:.1f}s")
                return

    def _store_lost(self, how: str) -> None:
        """The store is unreachable, so no verdict can be read: its host (rank 0) is the culprit."""
        rec0 = self._records.get(0)
        msg = f"{describe(0, rec0)} is gone or stopped: it hosts the c10d store, {how}; {last_seen(rec0)}"
        self._fire(Verdict(0, "store", msg, self.rank), leave=False)

    def _fire(self, v: Verdict, leave: bool) -> None:
        """Adopt ``v`` once (the thread or the watchdog): mark, acknowledge, fail the engine."""
        if self._stop.is_set() or not self._fired.acquire(blocking=False):
            return
        self.verdict = v
        if leave:
            self.leave(v)
        self.on_failure(v.error(self.rank))

    def _check(
        self,
        peers: list[int],
        last: dict[int, tuple[int, float]],
        moved: dict[int, tuple[Any, float]],
        records: dict[int, dict[str, Any]],
    ) -> tuple[int, str, str] | None:
        """(culprit, kind, message) for the first peer found gone, silent or stuck; else None."""
        now = time.monotonic()
        for r in peers:
            key = f"{self.prefix}/hb/{r}"
            if not self.store.check([key]):
                continue
            rec = json.loads(self.store.get(key))
            records[r] = rec
            if rec["phase"] == "closed" or str(rec["phase"]).startswith("left"):
                last[r] = (rec["seq"], now)
                continue
            if rec["seq"] != last[r][0]:
                last[r] = (rec["seq"], now)
            silent = now - last[r][1]
            if rec.get("pidns") == self.pidns and _process_state(int(rec["pid"])) in (None, "Z"):
                return r, "gone", self._stalled(r, rec, silent)  # dead on this host: no need to wait
            if silent > self.stall_timeout:
                return r, "silent", self._stalled(r, rec, silent)
        records[self.rank] = self.record()
        frozen: dict[int, float] = {}
        for r, rec in records.items():
            key_now = progress_key(rec)
            if r not in moved or moved[r][0] != key_now:
                moved[r] = (key_now, now)
            frozen[r] = now - moved[r][1]
        found = find_laggard(records, frozen, self.stall_timeout)
        if found is None:
            return None
        r, ahead = found
        return r, "stuck", self._stuck(r, records, ahead, frozen[r])

    def _stalled(self, r: int, rec: dict[str, Any], silent_s: float) -> str:
        why = (
            "is gone (its process exited)"
            if silent_s < self.stall_timeout
            else f"sent no heartbeat for {silent_s:.1f}s (stall_timeout={self.stall_timeout:g}s)"
        )
        return f"{describe(r, rec)} {why}; {last_seen(rec)}" + self._stack(rec)

    def _stuck(self, r: int, records: dict[int, dict[str, Any]], ahead: list[int], frozen_s: float) -> str:
        rec = records[r]
        where = ", ".join(
            f"rank {a} at tick {ra['tick']} ({ra['phase']}, {ra.get('gathers')} gathers)"
            for a, ra in ((a, records[a]) for a in ahead)
        )
        return (
            f"{describe(r, rec)} stopped reaching the tick: its heartbeat runs but its driver has not "
            f"moved for {frozen_s:.1f}s (stall_timeout={self.stall_timeout:g}s) while its peers wait "
            f"ahead of it ({where}); {last_seen(rec)}, {rec.get('gathers')} parameter gathers entered"
            + self._stack(rec)
        )

    def _stack(self, rec: dict[str, Any]) -> str:
        if rec.get("pidns") == self.pidns and isinstance(rec.get("pid"), int) and rec["pid"] != os.getpid():
            return "\n--- its Python stack ---\n" + local_stack(rec["pid"])
        return ""


def _own_connection(store: Any, timeout_s: float) -> Any:
    """A second client of ``store`` whose calls time out after ``timeout_s`` (the default store's
    own timeout is the process group's, often 30 min)."""
    try:
        mine = store.clone()
        mine.set_timeout(datetime.timedelta(seconds=timeout_s))
        return mine
    except Exception:  # stores without clone(): share the caller's connection
        return store


_HOSTED: weakref.WeakSet[Liveness] = weakref.WeakSet()
_LINGER_REGISTERED: list[bool] = []


def _register_host(live: Liveness) -> None:
    if not _LINGER_REGISTERED:  # once per process (not each time _HOSTED empties: one per engine)
        atexit.register(linger)  # registered after process.py's exit guard: runs before it
        _LINGER_REGISTERED.append(True)
    _HOSTED.add(live)


def linger() -> None:
    """On the store's host (rank 0), before the process exits: wait, bounded, until every live
    peer has read the verdict, so none of them finds the store gone and blames rank 0.
    Call it before ``os._exit``; ``atexit`` calls it otherwise."""
    for live in list(_HOSTED):
        missing = verdict.wait_for_acks(live.store, live.prefix, live.ranks, live.rank, live.linger_s)
        if missing:
            log.warning(
                "rank %d: exiting; rank(s) %s never acknowledged the failure verdict", live.rank, missing
            )
        _HOSTED.discard(live)


def is_comm_error(err: BaseException) -> bool:
    """A broken collective (a symptom: the cause is usually a peer that died or stalled)."""
    import torch.distributed as dist

    if isinstance(err, getattr(dist, "DistError", ())):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and any(
        w in text for w in ("gloo", "nccl", "connection", "timed out", "peer", "socket")
    )
