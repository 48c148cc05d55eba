"""What a rank's user threads and its driver thread share (``Shared``, every field under one
lock, changed only through its methods), the failure path every thread takes (``Failure``),
and the driver's counters (``EngineStats``)."""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from typing import Any

from shardgen.generation.requests import Request, resolve_future
from shardgen.log import get_logger

log = get_logger()


@dataclass
class EngineStats:
    """Counters of one rank's driver (``engine.stats()``)."""

    ticks: int = 0
    forward_ticks: int = 0  # ticks that decided FORWARD (every rank forwarded)
    forwards: int = 0  # real forwards: prefill forwards + decode steps
    prefills: int = 0  # waves and refills
    refills: int = 0  # prefills that joined a running batch
    prefill_forwards: int = 0  # forwards that prefilled (more than prefills under max_prefill_tokens)
    prefill_tokens: int = 0  # prompt tokens computed (a prompt shared by n rows counts once)
    cached_prompt_tokens: int = 0  # prompt tokens taken from the prefix cache instead (counted alike)
    prefix_cache_evictions: int = 0  # entries the prefix cache's bound pushed out
    prefix_cache_drops: int = 0  # entries dropped because the weights may have changed
    decode_steps: int = 0  # decode forwards, verify forwards included
    decode_row_steps: int = 0  # live rows summed over decode forwards
    decode_tokens: int = 0  # tokens those forwards committed (decode_row_steps without drafts)
    verify_forwards: int = 0  # decode forwards that fed drafts (EngineConfig.speculate)
    folded_prefills: int = 0  # prefills whose last forward fed drafts after the prompt
    drafted: int = 0  # draft tokens fed
    accepted: int = 0  # draft tokens the rows kept
    forwards_saved: int = 0  # per verify forward, the furthest row's tokens beyond one
    drafts_received: int = 0  # finished rollouts other ranks shared to draft from
    shadow_forwards: int = 0
    idle_ticks: int = 0
    requests: int = 0
    generated_tokens: int = 0
    whole_gathers: int = 0  # gathers of the whole model (``once``): when work starts after an idle release
    forward_s: float = 0.0  # time in real and shadow forwards
    control_s: float = 0.0  # time in the tick's all-gather
    busy_s: float = 0.0  # time in real forwards only

    def as_dict(self) -> dict[str, Any]:
        """The counters and ``tokens_per_forward``: tokens a live row commits per decode forward
        (1.0 without drafts)."""
        out = asdict(self)
        rows = self.decode_row_steps
        out["tokens_per_forward"] = self.decode_tokens / rows if rows else 0.0
        return out


class Shared:
    """State that user threads and the driver thread exchange.

    ``lock`` guards every field: take it to read or write any of them together. A lone
    read of ``closed``, ``failed`` or ``conversing`` (one reference) may skip it. ``wake`` (work or a request
    arrived) is an event; ``changed`` (a condition on ``lock``) is notified when the driver
    enters a pause, a ``paused()`` block exits, or the engine fails.

    Pauses are counted, not flagged: ``pauses_entered`` (the driver entered its n-th agreed
    pause) and ``pauses_left`` (this rank's user thread left its n-th block). A block that
    exits and a ``paused()`` called right after it can then never be mistaken for each other,
    however late the driver wakes up (with two events, a set-then-cleared "resume" was missed
    and the next block ran inside the previous pause: fuzz seed 662).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.inbox: deque[Request] = deque()  # submitted, not yet seen by the driver
        # Every request handed to the driver whose future is not done, by its future. A request
        # leaves it when its future is resolved (a done callback), whoever resolves it: the
        # failure path then finds every future still waiting, whatever point the driver failed at.
        self.open_reqs: dict[Future, Request] = {}
        self.closed = False
        self.pause_wanted = False
        self.failed: BaseException | None = None  # the first failure; set once
        self.wake = threading.Event()
        self.changed = threading.Condition(self.lock)
        self.pauses_entered = 0  # driver: agreed pauses entered
        self.pauses_left = 0  # user thread: paused() blocks exited
        self.quota = 0  # user threads: quota calls begun (rows parked at their budget go back)
        self.conversing = 0  # user threads: multi-turn calls in progress (``turns()``)

    def enqueue(self, reqs: list[Request]) -> bool:
        """User thread: hand requests to the driver; False (nothing queued) once closed. Raises
        the engine's failure once it failed (the failure path has resolved the open requests
        already: one queued now would wait forever)."""
        with self.lock:
            if self.closed:
                return False
            failed = self.failed
            if failed is None:
                self.inbox.extend(reqs)
                self.open_reqs.update((r.future, r) for r in reqs)
        if failed is not None:
            raise failed
        for r in reqs:  # outside the lock: a future already done runs its callback right here
            r.future.add_done_callback(self._done)
        self.wake.set()
        return True

    def take_inbox(self) -> tuple[list[Request], bool, bool]:
        """Driver thread, once per tick: (new requests, closed, pause wanted)."""
        with self.lock:
            return self._drain(), self.closed, self.pause_wanted

    def take_requests(self) -> list[Request]:
        """Driver thread, between the forwards of a burst: the requests submitted since the tick
        (``take_inbox`` without the flags, which the next tick reads)."""
        with self.lock:
            return self._drain()

    def _drain(self) -> list[Request]:
        """The inbox's requests, taken (``lock`` held)."""
        reqs = list(self.inbox)
        self.inbox.clear()
        return reqs

    def close(self) -> None:
        with self.lock:
            self.closed = True
        self.wake.set()

    def want_pause(self, wanted: bool) -> None:
        """User thread: ask for a pause (True), or leave ``paused()`` (False: the block exited,
        or the wait for the pause failed)."""
        with self.lock:
            self.pause_wanted = wanted
            if not wanted:
                self.pauses_left = self.pauses_entered
                self.changed.notify_all()
        if wanted:
            self.wake.set()

    def begin_quota_call(self) -> int:
        """User thread: a quota call (``generation/partial.py``) begins: rows parked at their
        budget per call before it go back to decoding. Returns the call's number."""
        with self.lock:
            self.quota += 1
            number = self.quota
        self.wake.set()
        return number

    @contextlib.contextmanager
    def turns(self) -> Iterator[None]:
        """User thread: around a multi-turn call's stepping of its conversations (``env=``). While
        one is in progress on any rank, an idle tick keeps the whole weights gathered under
        ``once`` for the next turn (``core/driver.py``)."""
        with self.lock:
            self.conversing += 1
        try:
            yield
        finally:
            with self.lock:
                self.conversing -= 1

    def turns_open(self) -> int:
        """Driver thread, once per tick: the multi-turn calls in progress on this rank (a lone
        read: no lock taken on every tick)."""
        return self.conversing

    def quota_calls(self) -> int:
        """Driver thread: the quota calls begun so far."""
        with self.lock:
            return self.quota

    @property
    def version(self) -> int:
        """The weights' version: the pauses the driver has entered (any thread)."""
        with self.lock:
            return self.pauses_entered

    def wait_pause_entered(self, timeout: float) -> bool:
        """User thread: True once the driver entered a pause this thread has not left yet (or
        the engine failed); False after ``timeout`` s."""
        with self.lock:
            return self.changed.wait_for(
                lambda: self.pauses_entered > self.pauses_left or self.failed is not None, timeout
            )

    def enter_pause(self) -> int:
        """Driver thread: the agreed pause begins; returns its number."""
        with self.lock:
            self.pauses_entered += 1
            self.changed.notify_all()
            return self.pauses_entered

    def wait_block_left(self, pause: int, timeout: float) -> bool:
        """Driver thread: True once the user thread left its block of pause ``pause``."""
        with self.lock:
            return self.changed.wait_for(lambda: self.pauses_left >= pause, timeout)

    def notify(self) -> None:
        """Any thread: wake the waits above (e.g. after a failure)."""
        with self.lock:
            self.changed.notify_all()

    def _done(self, future: Future) -> None:
        """A request's future was resolved (its done callback, in the resolving thread)."""
        with self.lock:
            self.open_reqs.pop(future, None)

    def fail(self, err: BaseException) -> tuple[BaseException, list[Request], bool]:
        """Any thread: record ``err`` unless a failure came first. -> (the first failure, the
        requests whose futures are still waiting, whether ``err`` was the first). The caller
        resolves those futures; ``enqueue`` takes no request from now on."""
        with self.lock:
            first = self.failed is None
            if first:
                self.failed = err
            return self.failed, list(self.open_reqs.values()), first


class Failure:
    """The engine's failure path, for whichever thread meets the failure first: the driver's
    (``driver=True``), liveness's (``peer``: a peer stalled or raised), or a user thread's
    (``faults/leaving.py``). It records the first failure in ``shared``, resolves every waiting
    future with it and wakes the waits; it calls nothing back (no engine, no driver)."""

    def __init__(self, shared: Shared, rank: int) -> None:
        self.shared, self.rank = shared, rank

    def __call__(self, err: BaseException, driver: bool = False) -> None:
        """Fail every open request with ``err``. The first failure wins. Any thread; local."""
        err, reqs, first = self.shared.fail(err)
        if first and driver:
            log.error("rank %d: engine driver failed: %s: %s", self.rank, type(err).__name__, err)
        for r in reqs:
            resolve_future(r.future, error=err)
        self.shared.notify()  # unblock a waiting paused()

    def peer(self, err: BaseException) -> None:
        """Called by the liveness thread: a peer stalled or raised."""
        log.error("rank %d: %s", self.rank, err)
        self(err)
