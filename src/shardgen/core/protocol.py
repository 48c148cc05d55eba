"""The tick: how every rank's driver agrees, once per step, on what all ranks do next.

THE INVARIANT (why no rank can be left stuck by another's divergence)
----------------------------------------------------------------------
Every rank's driver runs the same sequence of ticks. A tick is:

1. ``agree()``: ONE ``all_reduce(SUM)`` of a CPU int64 vector on the private
   gloo control group. Each rank writes its own row (live sequences, pending
   requests, open, pause wanted, fingerprint, the shape of its next forward
   either way admission goes, the towers it runs either way) and zeros elsewhere, so
   the sum is every rank's row: all ranks hold the same ``TickState``.
2. ``decide(state)``: a pure function of that agreed state, hence the same
   ``Decision`` on every rank.
3. If the decision is ``FORWARD`` and forwards gather (``backend.lockstep``), every rank
   runs EXACTLY ONE forward (its own planned prefill, chunk or decode step, or a shadow
   forward that issues the same parameter collectives); when no forward issues a parameter
   collective (the whole model gathered under ``once``, or the local backend), a rank with
   work runs up to ``burst_steps`` forwards and a rank without work runs none. Otherwise no
   rank touches the parameter group.

Because (1) is the only control collective, (2) is deterministic and (3) depends
only on (2), every rank issues the same collectives in the same order on each
private group, whatever its local work, its user thread, or its timing. What a
rank does *inside* its forward (real or shadow, batch size, prompt length) never
changes the sequence of gathers, which depends only on the module structure.
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
from dataclasses import dataclass
from typing import Any

import torch

from shardgen.errors import CollectiveDivergenceError

# Columns of a rank's row in the tick vector. TOKENS, HEAD_ROWS: the shape of the forward this
# rank runs this tick if new requests may be admitted (``TickState.admit``), HELD_TOKENS,
# HELD_HEAD_ROWS if not ((0, 0): none, it shadows): the tokens every layer's input holds and
# the rows the LM head's holds (``ForwardPlan.shape``, generation/scheduler.py). The weight-stationary mode's
# exchanges size every rank's share from them (``TickState.shapes``). TOWERS, HELD_TOWERS: the
# towers (a bit each) this rank's forward runs, either way (``TickState.towers``).
LIVE, PENDING, OPEN, PAUSE, FINGERPRINT, TOKENS, HEAD_ROWS, HELD_TOKENS, HELD_HEAD_ROWS = range(9)
TOWERS, HELD_TOWERS = 9, 10
NCOLS = 11

#: Off only in the test that shows the agreement is needed: each rank then runs the towers its
#: own inputs run, and a peer without them leaves it alone in the tower's gathers.
_AGREE_TOWERS = True


class Phase(str, enum.Enum):
    """What a rank's driver is doing; heartbeats and errors quote it (as its plain word)."""

    INIT = "init"
    TICK = "tick"  # in the tick's all-reduce
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
    """The agreed view of all ranks after one tick: ``rows[r][c]`` is rank r's column c.

    Plain Python ints: the decision runs on every tick, so it avoids tensor ops.
    """

    rows: list[list[int]]

    @property
    def world(self) -> int:
        return len(self.rows)

    def col(self, c: int) -> list[int]:
        return [row[c] for row in self.rows]

    def total(self, c: int) -> int:
        return sum(row[c] for row in self.rows)

    @property
    def all_pause(self) -> bool:
        return self.total(PAUSE) == self.world

    @property
    def admit(self) -> bool:
        """May ranks admit new requests this tick? Not while everybody waits to pause."""
        return not self.all_pause

    def shapes(self) -> list[tuple[int, int]]:
        """``(tokens, head_rows)`` of every rank's forward this tick (``(0, 0)``: a shadow), as the agreed
        ``admit`` selects them: the same list on every rank."""
        tokens, head = (TOKENS, HEAD_ROWS) if self.admit else (HELD_TOKENS, HELD_HEAD_ROWS)
        return [(row[tokens], row[head]) for row in self.rows]

    def towers(self, own: int = 0) -> int:
        """The towers (a bit each) every rank's forward runs this tick: the OR of every rank's, as
        the agreed ``admit`` selects them; the same on every rank. ``own``: this rank's, which is
        all a rank runs when the agreement is switched off (``_AGREE_TOWERS``, a test's)."""
        if not _AGREE_TOWERS:
            return own
        col = TOWERS if self.admit else HELD_TOWERS
        out = 0
        for row in self.rows:
            out |= row[col]
        return out


def decide(state: TickState) -> Decision:
    """The whole protocol decision. Pure: same state -> same decision on every rank."""
    live = state.total(LIVE)
    pending = state.total(PENDING) if state.admit else 0
    if live + pending > 0:
        return Decision.FORWARD
    if state.all_pause:
        return Decision.PAUSE
    if state.total(OPEN) == 0:
        return Decision.EXIT
    return Decision.IDLE


def check_fingerprints(state: TickState, ranks: list[int] | None = None) -> None:
    """Raise ``CollectiveDivergenceError`` if ranks' collective histories differ (debug mode).

    ``ranks``: the global rank of each row (an engine over a subgroup), for the message."""
    fps = state.col(FINGERPRINT)
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
    calls it, once per tick, in the same order.
    """

    def __init__(self, group: Any, rank: int, world: int) -> None:
        self.group = group
        self.rank = rank
        self.world = world
        self._buf = torch.zeros((world, NCOLS), dtype=torch.int64)
        # A view holds a C++ reference to ``_buf`` as long as the plane lives, so that a gloo
        # worker releasing a tick's work never drops ``_buf``'s count to its Python object's
        # alone: that transition takes the GIL (``TensorImpl::decref_pyobject``), and a
        # worker asking for it while the interpreter finalizes is ended by ``pthread_exit``
        # inside gloo's ``noexcept`` destructor: ``std::terminate`` at exit (see agree()).
        self._pin = self._buf.view(-1)

    def agree(self, row: list[int], abort: Callable[[], BaseException | None] | None = None) -> TickState:
        """All-reduce this rank's row with every other rank's. Collective on the control group.

        Waits in short slices so that ``abort()`` (the liveness verdict: a peer stalled
        or failed) can end the wait with that error instead of blocking forever.

        The caller may drop the work before gloo's worker does (the worker releases it after
        marking it done); the worker's release then needs no GIL, thanks to ``_pin``.
        """
        import torch.distributed as dist

        assert len(row) == NCOLS
        self._buf.zero_()
        self._buf[self.rank] = torch.tensor(row, dtype=torch.int64)
        if self.world > 1:
            work = dist.all_reduce(self._buf, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            while True:
                try:
                    work.wait(timeout=_SLICE)
                    break
                except RuntimeError as e:
                    if "timed out" not in str(e).lower():
                        raise
                    err = abort() if abort is not None else None
                    if err is not None:
                        raise err from None
        return TickState(self._buf.tolist())


_SLICE = datetime.timedelta(seconds=0.2)
