"""The verdict: one agreed answer to "which rank failed first", kept in the c10d store.

The first rank that detects a fault (a peer gone, silent, stuck, absent, or its own
driver raising) writes ``<prefix>/verdict`` with ``compare_set(key, "", ...)``: the
store keeps the first value and returns it to every later writer, so all ranks adopt
the same culprit however detections race. Every rank reads the verdict before it
blames anyone, and a rank that leaves because of a peer first marks its heartbeat
``left: peer N failed`` and acknowledges (``<prefix>/ack/<rank>``), so the rank that
left is never mistaken for the cause.

The store lives in rank 0's process (or, under torchrun's agent store, in rank 0's
agent): ``linger()`` keeps rank 0's process alive, bounded, until every live peer has
acknowledged the verdict. When the store itself is unreachable, peers cannot read a
verdict at all; they then name rank 0, the store's host (see docs/RELIABILITY.md).
Nothing here is a collective: every function is a few store operations by one rank.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Any

from shardgen.errors import PeerFailedError, PeerStalledError, RendezvousTimeoutError, ShardgenError

#: What a verdict says happened to its culprit.
KINDS = ("raised", "gone", "silent", "stuck", "absent", "store")


@dataclass(frozen=True)
class Verdict:
    culprit: int
    kind: str
    message: str  # names the culprit: rank, host, pid, last phase and tick
    by: int  # the rank whose detection won

    def error(self, rank: int) -> ShardgenError:
        """The exception rank ``rank`` raises for this verdict."""
        text = self.message if self.by == rank else f"{self.message} [detected by rank {self.by}]"
        if self.kind == "raised":
            return PeerFailedError(text)
        if self.kind == "absent":
            return RendezvousTimeoutError(text)
        return PeerStalledError(text)


def _key(prefix: str) -> str:
    return f"{prefix}/verdict"


def publish(store: Any, prefix: str, verdict: Verdict) -> Verdict:
    """Propose ``verdict``; return the one that stands (the first ever written). Not collective."""
    assert verdict.kind in KINDS, verdict.kind
    raw = store.compare_set(_key(prefix), "", json.dumps(asdict(verdict)))
    return Verdict(**json.loads(raw))


def read(store: Any, prefix: str) -> Verdict | None:
    """The verdict, if a rank wrote one. Not collective."""
    if not store.check([_key(prefix)]):
        return None
    return Verdict(**json.loads(store.get(_key(prefix))))


def acknowledge(store: Any, prefix: str, rank: int) -> None:
    """Tell the store's host that ``rank`` has read the verdict (it may now exit)."""
    store.set(f"{prefix}/ack/{rank}", "1")


def unacknowledged(store: Any, prefix: str, world: int | list[int], verdict: Verdict, me: int) -> list[int]:
    """Ranks that may still need the store to read ``verdict``: not the culprit, not ``me``,
    no ack, and a heartbeat that does not say the rank already left or closed. ``world``: the
    engine's size, or its global ranks (an engine over a subgroup)."""
    waiting = []
    for r in range(world) if isinstance(world, int) else world:
        if r in (me, verdict.culprit) or store.check([f"{prefix}/ack/{r}"]):
            continue
        hb = f"{prefix}/hb/{r}"
        if store.check([hb]):
            phase = str(json.loads(store.get(hb)).get("phase", ""))
            if phase == "closed" or phase.startswith(("left", "failed")):
                continue
        waiting.append(r)
    return waiting


def wait_for_acks(store: Any, prefix: str, world: int | list[int], me: int, bound_s: float) -> list[int]:
    """Block up to ``bound_s`` until every peer acknowledged the verdict (if there is one);
    return the ranks that never did. Called by the store's host just before its process
    exits, so peers are not left without the verdict. Not collective."""
    deadline = time.monotonic() + bound_s
    pending: list[int] = []
    while True:
        try:
            verdict = read(store, prefix)
            if verdict is None:
                return []
            pending = unacknowledged(store, prefix, world, verdict, me)
        except Exception:  # noqa: BLE001 - the store is ours; if it fails there is nothing to wait for
            return pending
        if not pending or time.monotonic() > deadline:
            return pending
        time.sleep(0.02)


def describe(rank: int, rec: dict[str, Any] | None) -> str:
    """``rank R (host H, pid P)`` from its last heartbeat record (if any)."""
    if not rec:
        return f"rank {rank} (no heartbeat seen)"
    return f"rank {rank} (host {rec.get('host')}, pid {rec.get('pid')})"


def last_seen(rec: dict[str, Any] | None) -> str:
    """``last phase 'P' at tick T`` from a heartbeat record."""
    if not rec:
        return "never sent a heartbeat"
    return f"last phase {rec.get('phase')!r} at tick {rec.get('tick')}"
