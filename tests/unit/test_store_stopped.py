"""Tier 1: a store whose host stopped (its calls block: the client waits for an answer that never
comes, whatever its timeout) never holds up a rank whose work is done. The schedule fuzzer found
it (docs/RELIABILITY.md: seed 2585, the store's host SIGSTOPped right after the last tick, while
its peer closed)."""

from __future__ import annotations

import threading
import time

import torch.distributed as dist
from models import tiny_model

import shardgen
from shardgen.core import comm
from shardgen.faults.liveness import Liveness
from shardgen.timeouts import derive


class StoppedHost:
    """A c10d store whose every call blocks once ``stopped`` is set, until ``go`` is."""

    def __init__(self) -> None:
        self._store = dist.HashStore()
        self.stopped, self.go, self.blocked = threading.Event(), threading.Event(), threading.Event()

    def clone(self) -> StoppedHost:  # Liveness's own connection: the same stopped host
        return self

    def set_timeout(self, _timeout) -> None:  # a stopped host ignores it (see the module docstring)
        pass

    def __getattr__(self, name: str):
        fn = getattr(self._store, name)

        def call(*args, **kwargs):
            if self.stopped.is_set():
                self.blocked.set()
                self.go.wait()
            return fn(*args, **kwargs)

        return call


def test_liveness_stop_leaves_a_heartbeat_blocked_on_a_stopped_store():
    t = derive(1.0, 5.0)
    store = StoppedHost()
    live = Liveness(store, "e", 1, 2, t, status=lambda: (0, "idle", 0, 0), on_failure=lambda e: None)
    live.start()
    try:
        time.sleep(3 * t.heartbeat)
        store.stopped.set()
        assert store.blocked.wait(5.0), "the heartbeat thread never reached the store"
        t0 = time.monotonic()
        live.stop()
        took = time.monotonic() - t0
        # it used to join each thread for up to 10 s, outliving a fault bound of stall_timeout + 8
        assert took <= t.stall + 2 * t.heartbeat + 1.0, f"stop() waited {took:.1f}s on a stopped store"
    finally:
        store.go.set()
        live.stop()


def test_close_leaves_the_store_keys_of_a_stopped_host():
    eng = shardgen.Engine(tiny_model("llama", seed=1), backend="local", stall_timeout=1.0)
    store = StoppedHost()
    eng._store = store  # as a multi-rank engine's: the default store, hosted by rank 0
    store.stopped.set()
    done = threading.Event()
    closer = threading.Thread(target=lambda: (eng.close(), done.set()), daemon=True)
    t0 = time.monotonic()
    closer.start()
    try:
        assert done.wait(eng.timeouts.store_call + 5.0), "close() waited on a stopped store host"
        assert time.monotonic() - t0 < eng.timeouts.store_call + 5.0
        assert store.blocked.is_set()  # it did try to delete the engine's keys
    finally:
        store.go.set()
        closer.join(5.0)


def test_bounded_returns_what_ended():
    assert comm.bounded(lambda: None, (), 1.0, "rank 0: test") is True
    gate = threading.Event()
    t0 = time.monotonic()
    assert comm.bounded(gate.wait, (), 0.2, "rank 0: test") is False
    assert time.monotonic() - t0 < 1.0
    gate.set()
