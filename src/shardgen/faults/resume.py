"""The end of an agreed pause: no driver ticks again before every rank has left its ``paused()``.

Peers may stay inside their block for long (a training step), so the drivers wait on the c10d
store, not in the next tick's all-gather, whose group has a timeout. A rank still inside long
after this one left is named once, with its stack where it runs on this host: the usual cause is
a collective of the user's own inside the block that not every rank runs as often.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from shardgen.faults.liveness import Liveness
from shardgen.log import get_logger

log = get_logger()


class ResumeBarrier:
    """The store barrier after each agreed pause, over the engine's ranks (``ranks``, global;
    ``rank`` this one). ``store``, ``key_prefix``: the c10d store and this engine's keys in it;
    ``stall``: how long this rank waits before it names the ranks still inside; ``live``: this
    rank's liveness (None on one process), for their stacks."""

    def __init__(
        self, store: Any, key_prefix: str, rank: int, ranks: list[int], stall: float, live: Liveness | None
    ) -> None:
        self.store, self.key_prefix, self.rank, self.ranks = store, key_prefix, rank, list(ranks)
        self.stall, self.live = stall, live

    def wait(self, pause: int, failed: Callable[[], BaseException | None]) -> None:
        """Return once every rank has left pause number ``pause``; raise ``failed()`` as soon as the
        engine failed (a peer left or failed inside its block: none will come).

        Every rank's driver thread calls it once per agreed pause, after its own ``paused()`` block
        exited, with the same ``pause`` (agreed ticks: the n-th pause on every rank), before its
        next tick. A barrier on the store, not a collective: it waits without a bound (a peer may
        stay inside on purpose, a checkpoint save) and says so after ``stall`` s."""
        store, world = self.store, len(self.ranks)
        key = f"{self.key_prefix}/resume{pause}"  # the same number on every rank
        store.append(f"{key}/who", f"{self.rank},")  # who has left: for the message below
        if int(store.add(key, 1)) == world and pause > 1:
            # The last rank here: every rank has left the previous pause's wait, so its key
            # goes (one key per engine, not one per pause; the last goes at close).
            prev = f"{self.key_prefix}/resume{pause - 1}"
            store.delete_key(prev)
            store.delete_key(f"{prev}/who")
        left, told = time.monotonic(), False
        while int(store.add(key, 0)) < world:
            err = failed()
            if err is not None:  # a peer left or failed inside its block: none will come
                raise err
            if not told and time.monotonic() - left > self.stall:
                told = True  # once: a peer may stay inside on purpose (a checkpoint save)
                self._tell_still_inside(key, time.monotonic() - left)
            time.sleep(0.005)
        if told:
            log.warning("rank %d: every rank has left paused(), %.1fs after this one", self.rank,
                        time.monotonic() - left)  # fmt: skip

    def _tell_still_inside(self, key: str, waited: float) -> None:
        """This rank left ``paused()`` ``waited`` s ago and peers are still inside theirs: name
        them, with their stacks where they run on this host. The usual cause is a collective of
        the user's own inside the block that not every rank runs as often (which hangs there)."""
        out = {int(r) for r in self.store.get(f"{key}/who").decode().split(",") if r}
        inside = [r for r in self.ranks if r not in out]
        where = "".join(f"\n--- {self.live.where_is(r)}" for r in inside) if self.live is not None else ""
        names = ", ".join(map(str, inside))
        log.error(
            "rank %d: left paused() %.1fs ago (stall_timeout=%gs), but rank(s) %s are still inside "
            "theirs. Inside paused() every rank must run the same collectives in the same order: "
            "forwards and backwards of the sharded model, optimizer steps, all-reduces; a rank with "
            "fewer rows still runs as many forwards (a dummy row) and the rank with none one, and "
            "teacher or reference-model forwards belong in engine.score(), which is not collective. "
            "Still waiting for them.%s", self.rank, waited, self.stall, names, where,
        )  # fmt: skip
