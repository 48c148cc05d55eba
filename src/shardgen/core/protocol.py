"""The tick: how every rank's driver agrees, once per step, on what all ranks do next.

THE INVARIANT (why no rank can be left stuck by another's divergence)
----------------------------------------------------------------------
Every rank's driver runs the same sequence of ticks. A tick is:

1. ``agree()``: ONE ``all_gather`` of a CPU int64 row on the private gloo control
   group. Each rank sends its own row (a ``TickRow``: live sequences, pending requests,
   open, pause wanted, fingerprint, the shape of its next forward either way admission
   goes, the towers it runs either way, the rollouts it shares) and receives every rank's:
   all ranks hold the same ``TickState``. (An all-gather, not the all-reduce of a matrix
   that is zero but for each rank's row: on gloo it costs a quarter of the CPU and of the
   latency at 2 ranks.)
2. ``decide(state)``: a pure function of that agreed state, hence the same
   ``Decision`` on every rank.
3. If the decision is ``FORWARD`` and forwards gather (``backend.lockstep``), every rank
   runs EXACTLY ONE forward (its own planned prefill, chunk or decode step, or a shadow
   forward that issues the same parameter collectives); when no forward issues a parameter
   collective (the whole model gathered under ``once``, or the local backend), a rank with
   work runs up to ``burst_steps`` forwards, each planned when it runs with the requests
   submitted since the tick (so a rank with none at the tick may start), and a rank without
   work runs none. Otherwise no rank touches the parameter group.

Speculative decoding's shared rollouts (``generation/drafts.py``) ride in the same all-gather:
with ``speculate`` on, each rank's vector carries, after its row, a fixed region of ``payload``
ints (its ``shared`` column says how many it used), so sharing adds no collective and no rank
waits for another's drafts.

Because (1) is the only control collective, (2) is deterministic and (3) depends only on (2),
every rank issues the same collectives in the same order on each private group, whatever its
local work, its user thread, or its timing. What a rank does *inside* its forward (real or
shadow, batch size, prompt length) never changes the sequence of gathers, which depends only
on the module structure.
User collectives on the default group never interleave with these: they live on
other communicators.

Towers (``backends/towers.py``): a model's parts that a forward runs only for some inputs (a
VLM's vision encoder). Each rank's row carries, as a bit per tower, the towers its next forward
runs either way admission goes; the agreed set is their OR (``TickState.towers``), and every
rank's forward runs every tower in it, on a shadow input where its own inputs have none. So the
towers' gathers are in every rank's forward or in none: the invariant above holds for them,
with no collective added to the tick.

``debug_collectives`` folds a fingerprint of each rank's collective history into
its row; ranks that disagree raise ``CollectiveDivergenceError`` at the next tick.
"""

from __future__ import annotations

import datetime
import enum
import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from shardgen.errors import CollectiveDivergenceError


@dataclass(frozen=True)
class TickRow:
    """One rank's row of the tick: what it tells every other rank, a column each (in this order).

    ``live``: its unfinished rows; ``pending``: its requests not yet admitted; ``open``: not
    closed; ``pause``: it wants to pause; ``fingerprint``: its collective history
    (``debug_collectives``, else 0). ``tokens``, ``head_rows``: the shape of the forward it runs
    this tick if new requests may be admitted (``TickState.admit``), ``held_tokens``,
    ``held_head_rows`` if not ((0, 0): none, it shadows): the tokens every layer's input holds
    and the rows the LM head's holds (``ForwardPlan.shape``, generation/plan.py). The
    weight-stationary mode's exchanges size every rank's share from them (``TickState.shapes``).
    ``towers``, ``held_towers``: the towers (a bit each) its forward runs, either way
    (``TickState.towers``). ``shared``: the ints of finished rollouts it shares this tick, in
    the payload after its row (``TickState.payloads``). ``turning``: its multi-turn calls in
    progress (``env=``): while a rank has one, an idle tick keeps the whole weights of ``once``
    for the next turn (``core/driver.py``). A column is added here alone (``NCOLS``
    counts them, checked at import), and read by its name (``TickState.col``)."""

    live: int = 0
    pending: int = 0
    open: int = 0
    pause: int = 0
    fingerprint: int = 0
    tokens: int = 0
    head_rows: int = 0
    held_tokens: int = 0
    held_head_rows: int = 0
    towers: int = 0
    held_towers: int = 0
    shared: int = 0
    turning: int = 0

    def to_vector(self) -> list[int]:
        """The row as the tick's all-gather carries it: one int64 per column, in field order."""
        return [getattr(self, f.name) for f in fields(self)]

    @staticmethod
    def from_vector(values: list[int]) -> TickRow:
        """The row a vector of ``to_vector`` holds."""
        assert len(values) == NCOLS, f"a tick row of {len(values)} columns, not {NCOLS}"
        return TickRow(*values)


#: Columns of a row (``TickRow``'s fields): the size of the tick's vector, which the docs quote.
NCOLS = 13
assert len(fields(TickRow)) == NCOLS, "TickRow's columns changed: NCOLS (and the docs) say their count"

#: Off only in the test that shows the agreement is needed: each rank then runs the towers its
#: own inputs run, and a peer without them leaves it alone in the tower's gathers.
_AGREE_TOWERS = True


class Phase(str, enum.Enum):
    """What a rank's driver is doing; heartbeats and errors quote it (as its plain word)."""

    INIT = "init"
    TICK = "tick"  # in the tick's all-gather
    GATHER = "gather"
    PREFILL = "prefill"
    REFILL = "refill"
    DECODE = "decode"
    SCORE = "score"
    SHADOW = "shadow"
    IDLE = "idle"
    PAUSED = "paused"
    CLOSED = "closed"
    FAILED = "failed"
    COMM_ERROR = "comm-error"  # a collective broke; waiting for liveness to name the cause

    def __str__(self) -> str:
        return self.value


class Decision(enum.Enum):
    FORWARD = "forward"  # one forward per rank while forwards gather (a burst when none does)
    IDLE = "idle"  # nobody has work: no gathers, sleep, tick again
    PAUSE = "pause"  # every rank asked to pause and no sequence is live
    EXIT = "exit"  # every rank closed and no work is left anywhere


@dataclass(frozen=True)
class TickState:
    """The agreed view of all ranks after one tick: ``rows[r]`` is rank r's row.

    Plain Python ints: the decision runs on every tick, so it avoids tensor ops.
    """

    rows: list[TickRow]
    #: Each rank's shared ints this tick (its ``shared`` column's count of its payload), in row
    #: order; empty where the plane carries no payload.
    payloads: list[list[int]] = field(default_factory=list)

    @property
    def world(self) -> int:
        return len(self.rows)

    def col(self, name: str) -> list[int]:
        """Every rank's value of column ``name`` (a ``TickRow`` field), in row order."""
        return [getattr(row, name) for row in self.rows]

    def total(self, name: str) -> int:
        return sum(self.col(name))

    @property
    def all_pause(self) -> bool:
        return self.total("pause") == self.world

    @property
    def admit(self) -> bool:
        """May ranks admit new requests this tick? Not while everybody waits to pause."""
        return not self.all_pause

    def shapes(self) -> list[tuple[int, int]]:
        """``(tokens, head_rows)`` of every rank's forward this tick (``(0, 0)``: a shadow), as the agreed
        ``admit`` selects them: the same list on every rank."""
        if self.admit:
            return [(row.tokens, row.head_rows) for row in self.rows]
        return [(row.held_tokens, row.held_head_rows) for row in self.rows]

    def towers(self, own: int = 0) -> int:
        """The towers (a bit each) every rank's forward runs this tick: the OR of every rank's, as
        the agreed ``admit`` selects them; the same on every rank. ``own``: this rank's, which is
        all a rank runs when the agreement is switched off (``_AGREE_TOWERS``, a test's)."""
        if not _AGREE_TOWERS:
            return own
        out = 0
        for tower in self.col("towers" if self.admit else "held_towers"):
            out |= tower
        return out


def decide(state: TickState) -> Decision:
    """The whole protocol decision. Pure: same state -> same decision on every rank."""
    live = state.total("live")
    pending = state.total("pending") if state.admit else 0
    if live + pending > 0:
        return Decision.FORWARD
    if state.all_pause:
        return Decision.PAUSE
    if state.total("open") == 0:
        return Decision.EXIT
    return Decision.IDLE


def check_fingerprints(state: TickState, ranks: list[int] | None = None) -> None:
    """Raise ``CollectiveDivergenceError`` if ranks' collective histories differ (debug mode).

    ``ranks``: the global rank of each row (an engine over a subgroup), for the message."""
    fps = state.col("fingerprint")
    if len(set(fps)) > 1:
        names = ranks if ranks is not None else list(range(len(fps)))
        groups: dict[int, list[int]] = {}
        for r, fp in enumerate(fps):
            groups.setdefault(fp, []).append(names[r])
        desc = "; ".join(f"ranks {rs} -> {fp:#x}" for fp, rs in groups.items())
        raise CollectiveDivergenceError(f"ranks issued different collective sequences: {desc}")


class Fingerprint:
    """A running hash of the collectives a rank has issued (63 bits, fits int64)."""

    def __init__(self) -> None:
        self.value = 0

    def fold(self, *items: Any) -> None:
        h = hashlib.blake2b(repr((self.value, items)).encode(), digest_size=8).digest()
        self.value = int.from_bytes(h, "little") & 0x7FFF_FFFF_FFFF_FFFF


class ControlPlane:
    """The tick's collective on the private gloo control group.

    ``agree()`` is a collective: every rank's driver thread (and nobody else)
    calls it, once per tick, in the same order. ``payload``: the ints a rank may share per tick
    after its row (0: none; the same on every rank).
    """

    def __init__(self, group: Any, rank: int, world: int, payload: int = 0) -> None:
        self.group = group
        self.rank = rank
        self.world = world
        self.payload = payload
        self._mine = torch.zeros(NCOLS + payload, dtype=torch.int64)
        self._rows = [torch.zeros(NCOLS + payload, dtype=torch.int64) for _ in range(world)]
        # A view holds a C++ reference to its base as long as the plane lives, so that a gloo
        # worker releasing a tick's work never drops a tensor's count to its Python object's
        # alone: that transition takes the GIL (``TensorImpl::decref_pyobject``), and a
        # worker asking for it while the interpreter finalizes is ended by ``pthread_exit``
        # inside gloo's ``noexcept`` destructor: ``std::terminate`` at exit (see agree()).
        self._pins = [t.view(-1) for t in (self._mine, *self._rows)]

    def agree(
        self, row: TickRow, abort: Callable[[], BaseException | None] | None = None, shared: list[int] = ()
    ) -> TickState:
        """All-gather this rank's row (and its ``shared`` ints, ``row.shared`` of them, at most
        ``payload``) with every other rank's. Collective on the control group.

        Waits in short slices so that ``abort()`` (the liveness verdict: a peer stalled
        or failed) can end the wait with that error instead of blocking forever.

        The caller may drop the work before gloo's worker does (the worker releases it after
        marking it done); the worker's release then needs no GIL, thanks to ``_pins``.
        """
        import torch.distributed as dist

        assert len(shared) == row.shared <= self.payload, (
            f"{len(shared)} ints to share, room for {self.payload}"
        )
        if self.world == 1:
            return TickState([TickRow.from_vector(row.to_vector())], [list(shared)] if self.payload else [])
        self._mine[:NCOLS] = torch.tensor(row.to_vector(), dtype=torch.int64)
        if shared:
            self._mine[NCOLS : NCOLS + len(shared)] = torch.tensor(shared, dtype=torch.int64)
        work = dist.all_gather(self._rows, self._mine, group=self.group, async_op=True)
        _wait(work, abort)
        rows = [TickRow.from_vector(r[:NCOLS].tolist()) for r in self._rows]
        payloads = (
            [
                r[NCOLS : NCOLS + row.shared].tolist() if row.shared else []
                for r, row in zip(self._rows, rows, strict=True)
            ]
            if self.payload
            else []
        )
        return TickState(rows, payloads)


def _wait(work: Any, abort: Callable[[], BaseException | None] | None) -> None:
    """Wait for a control collective in short slices, so that ``abort()`` (the liveness verdict:
    a peer stalled or failed) can end the wait with that error instead of blocking forever."""
    while True:
        try:
            work.wait(timeout=_SLICE)
            return
        except RuntimeError as e:
            if "timed out" not in str(e).lower():
                raise
            err = abort() if abort is not None else None
            if err is not None:
                raise err from None


_SLICE = datetime.timedelta(seconds=0.2)
