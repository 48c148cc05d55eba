"""Partial rollouts: a rollout that returns on a quota of whole groups and holds the rest.

    batch = engine.rollout(prompts, n=4, groups=8, max_staleness=1, max_new_tokens=512)
    # the first 8 whole groups (held groups of earlier calls first); the others stay in the engine
    with engine.paused():   # held rows park (no wait for them), resume after it under the new weights
        train(batch)        # batch.versions [R, G]: each token's weight version; batch.logprobs its
                            # logprob under those weights (the behaviour policy's)

In RL a rollout's wall time is that of its longest rows; answer lengths are long-tailed. With
``groups=K`` a call returns once K prompts' groups are whole (all ``n`` samples each: a group
comes back whole, exactly once, or not at all); the groups still decoding are held by the engine,
go on decoding in the background, and are served first by the next quota call (they count
toward its K before its new prompts do). Each rank's quota and held groups are its own.

A held row does not hold up a training step: when every rank asks to pause, held rows are
parked (``parking.py``: out of the batch, KV dropped, prompt and tokens kept), and after the
pause they resume from their prompt plus their tokens, prefilled again under the new weights,
their draws going on from their own generator's state. ``max_staleness`` (steps, i.e. pauses):
a held group whose call began more than that many pauses ago is not served: ``stale="drop"``
drops it, ``stale="finish"`` returns it with its unfinished rows cut where they stood
(finish reason ``"stale"``; their tokens are all of versions within ``max_staleness`` of the
group's first). ``tokens_per_call`` (Kimi k1.5's budget): a row that drew that many tokens since
the call that (re)started it parks until the next quota call, which resumes it from its tokens
(a row keeps the budget of the call that submitted it); a call returns once K groups are whole
or every group it waits on is cut. A held group keeps its call's ``max_staleness`` and ``stale``;
``held_groups(engine)`` counts those a next call can serve (not those it will drop), so
``rollout([], groups=held_groups(engine), ...)`` drains them. ``close()`` ends held rows where
they stand (finish reason ``"held"``, their futures resolved, no more tokens drawn): after it no
call can take held groups, so none is decoded for nobody.

Multi-turn (``env=step_fn, max_turns=T``, ``turns.py``): a group is whole once its ``n``
conversations ended; the others are held. A held conversation goes on decoding its turn in
the background; when the turn ends it waits at the turn boundary (``step_fn`` runs only in a
caller's thread). The next quota call, with or without ``env=``, steps it in its own thread with
the ``step_fn`` of the call that submitted it, and the row number that ``step_fn`` gets is the
row's number in that call (``i * n + j``, prompt i of that call's prompts), so it resumes at
its turn. At a pause a conversation mid-turn parks like any held row (re-prefilled after it
under the new weights); one at its boundary needs nothing: its next turn prefills the
conversation under the weights of then (the pause dropped the prefix cache). ``max_staleness``
and ``stale`` apply to it as to a held row (``"finish"``: cut where it stands, mid-turn or at
its boundary, finish reason ``"stale"``). ``tokens_per_call`` counts per call over a
conversation's turns (a Kimi-style budget bounds the work of an iteration, however many
turns it takes): a turn starts with what its conversation has left of it in the call that
starts it; a turn cut at its budget, or one that ends with nothing left, waits for the next
quota call, which gives it a whole budget again. ``close()`` ends a conversation's turn in
flight as ``"held"``; one at its boundary has nothing in flight, and no call can step it after.

Not collective, like every rollout. Refused by name: ``inputs=`` (images: a resumed row
re-prefills its ids only) and encoder-decoder models.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from shardgen.generation.sequence import Holding

#: The finish reason of a held row the engine's ``close()`` ended where it stood (``per_call.py``'s).
HELD = "held"

#: What ``stale=`` takes: what becomes of a held group past ``max_staleness``.
STALE_CHOICES = ("drop", "finish")


@dataclasses.dataclass(frozen=True)
class Quota:
    """A partial rollout's checked settings."""

    groups: int
    max_staleness: int | None
    stale: str
    budget: int | None

    @staticmethod
    def of(groups: Any, max_staleness: Any, stale: Any, tokens_per_call: Any) -> Quota | None:
        """The settings, checked (``ValueError`` with the values); None without ``groups``."""
        if groups is None:
            given = [
                f"{k}={v!r}"
                for k, v in (("max_staleness", max_staleness), ("tokens_per_call", tokens_per_call))
                if v is not None
            ] + ([f"stale={stale!r}"] if stale != "drop" else [])
            if given:
                raise ValueError(f"{', '.join(given)} go with groups=K (a partial rollout)")
            return None
        for name, v, low in (("groups", groups, 0), ("max_staleness", max_staleness, 0),
                             ("tokens_per_call", tokens_per_call, 1)):  # fmt: skip
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < low):
                raise ValueError(f"{name} must be an integer >= {low}, got {v!r}")
        if stale not in STALE_CHOICES:
            raise ValueError(f"stale must be one of {STALE_CHOICES}, got {stale!r}")
        return Quota(groups, max_staleness, stale, tokens_per_call)


@dataclasses.dataclass
class Group:
    """One prompt's ``n`` rows of a partial rollout: rows ``index * n ..`` of ``call``, submitted
    at weight version ``born`` (``Engine.version``) by a call with ``quota``: a held group keeps
    its call's ``max_staleness`` and ``stale``, as its rows keep their budget. Multi-turn
    (``env=``): ``talk`` is its call's conversations (``turns.Talk``), with that call's env."""

    call: Any  # rollout._Call
    index: int
    born: int
    quota: Quota
    talk: Any = None  # turns.Talk
    _seen: int = dataclasses.field(default=0, init=False, repr=False)  # rows done in the call serving it

    def dropped(self, version: int) -> bool:
        """Past its ``max_staleness`` at weight version ``version`` with ``stale="drop"``: never
        served (the driver cut its rows as ``"stale"`` at the pause)."""
        q = self.quota
        return q.stale == "drop" and q.max_staleness is not None and version - self.born > q.max_staleness

    @property
    def rows(self) -> range:
        return range(self.index * self.call.n, (self.index + 1) * self.call.n)

    def watch(self, put: Callable[[Any], None]) -> None:
        """``put(item)`` for each event the call serving it must ``advance`` it by: a row done
        (single-turn), a turn ended or a row waiting at its turn boundary (multi-turn), None if it
        is whole already. Callbacks run in the driver: only puts."""
        self._seen = 0
        if self.talk is None:
            for r in self.rows:
                self.call.futures[r].add_done_callback(lambda _f, r=r: put(r))
        elif self.talk.whole(self.rows):
            put(None)
        else:
            for r in self.rows:
                if not self.talk.rows[r].ended:
                    self.talk.watch(r, put)

    def advance(self, item: Any, now: int, put: Callable[[Any], None]) -> bool:
        """One event of ``watch``'s (a conversation steps in this, the caller's, thread; its next
        turn is watched with ``put``): True once the group is whole. ``now``: the call's number."""
        if self.talk is None:
            self._seen += 1
            return self._seen == self.call.n
        if item is not None:
            self.talk.advance(*item, now, put)
        return self.talk.whole(self.rows)

    def refresh(self) -> None:
        """Before a quota call takes it: its conversations' turns cut at their budget get a whole one."""
        if self.talk is not None:
            self.talk.refresh(self.rows, self.quota.budget)

    def batch(self) -> Any:
        """Its rows packed (every future is done, every conversation ended)."""
        if self.talk is not None:
            return self.talk.pack(self.rows)
        return self.call.pack([self.call.futures[r].result() for r in self.rows], self.rows)

    def cut(self, call: int) -> bool:
        """Every row not finished is parked at its budget in quota call ``call`` or later (or, a
        conversation, waits at its turn boundary with its budget spent in it): none can finish
        before the next call. Read from the user thread while the driver writes (single fields:
        a stale read only delays the answer to the next look)."""
        if self.talk is not None:
            live = [r for r in self.rows if not self.talk.rows[r].ended]
            return bool(live) and all(self.talk.waits(r, call) for r in live)
        seqs = [self.call.seqs[r] for r in self.rows]
        live = [s for s in seqs if s.finish_reason is None]
        return bool(live) and all(row_cut(s, call) for s in live)


def row_cut(seq: Any, call: int) -> bool:
    """``seq`` is parked at its budget in quota call ``call`` or later: it cannot draw again
    before the next quota call (one parked for a pause, or cut earlier, goes back first)."""
    return seq.parked and seq.cut_in >= call


class Held:
    """An engine's held groups, oldest first. A quota call takes them all and gives back those
    it did not serve (a call running meanwhile in another thread sees none of them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._groups: list[Group] = []

    def take(self) -> list[Group]:
        with self._lock:
            out, self._groups = self._groups, []
            return out

    def give_back(self, groups: list[Group]) -> None:
        with self._lock:
            self._groups = groups + self._groups

    def groups(self) -> list[Group]:
        """The groups held now (a copy)."""
        with self._lock:
            return list(self._groups)

    def __len__(self) -> int:
        with self._lock:
            return len(self._groups)


def quota_groups(
    engine: Any,
    prompts: Any,
    n: int,
    quota: Quota,
    inputs: Any,
    submit: Callable[[Holding, int], tuple[Any, Any]],
) -> Iterator[tuple[int | None, Any]]:
    """``(i, group)`` for the first ``quota.groups`` groups to be whole, held groups first
    (``i`` None for those, else the prompt's index in ``prompts``). Checks, then submits the new
    rows now (``submit(holding, call)``: the call's ``rollout._Call`` and, multi-turn, its
    ``turns.Talk``); the groups it does not yield stay held. Not collective."""
    said = "groups= (a partial rollout)"
    if inputs is not None:
        raise ValueError(f"{said} does not take inputs= (images): a resumed row re-prefills its ids only")
    if getattr(engine.model.config, "is_encoder_decoder", False):
        raise ValueError(f"{said} needs a decoder-only model: a resumed row re-prefills prompt and tokens")
    if isinstance(prompts, str):
        raise ValueError("rollout() takes a list of prompts (strings or token-id lists), not one prompt")
    engine._check_usable()  # closed: no call takes held groups (nor steps their conversations)
    version, held = engine.version, engine._held
    old = held.take()
    kept = []
    for g in old:
        if g.call.n != n:
            held.give_back(old)
            raise ValueError(f"held groups have n={g.call.n} samples, this call n={n}: keep n the same")
        if not g.dropped(version):
            kept.append(g)
    if quota.groups > len(kept) + len(prompts):
        held.give_back(kept)
        raise ValueError(
            f"groups={quota.groups}, but this rank holds {len(kept)} groups and was given "
            f"{len(prompts)} prompts: at most {len(kept) + len(prompts)} groups can be returned"
        )
    for g in kept:  # before the call begins: the driver resumes cut rows once it sees it
        g.refresh()
    try:
        call = engine._shared.begin_quota_call()
        holding = Holding(version, quota.max_staleness, quota.budget)
        rows, talk = submit(holding, call)  # this call's rows (``rollout._Call``), conversations
    except BaseException:
        held.give_back(kept)
        raise
    new = [Group(rows, i, version, quota, talk) for i in range(len(prompts))]
    return _serve(engine, held, kept + new, len(kept), quota, call)


def _serve(
    engine: Any, held: Held, groups: list[Group], carried: int, quota: Quota, call: int
) -> Iterator[tuple[int | None, Any]]:
    done: queue.SimpleQueue[tuple[int, Any]] = queue.SimpleQueue()
    puts = [lambda item, k=k: done.put((k, item)) for k in range(len(groups))]
    for k, g in enumerate(groups):  # a held group already whole is first in the queue
        g.watch(puts[k])
    left, served = set(range(len(groups))), 0
    # Between a conversation's turns the engine keeps gathered weights for the next turn.
    turns = engine._shared.turns() if any(g.talk is not None for g in groups) else contextlib.nullcontext()
    try:
        with turns:
            while served < quota.groups and left:
                try:
                    k, item = done.get(timeout=0.02)
                except queue.Empty:  # rows with a budget (held ones: their own call's) may all be cut
                    if all(groups[j].cut(call) for j in left):
                        return
                    continue
                g = groups[k]
                if k not in left or not g.advance(item, call, puts[k]):
                    continue
                left.discard(k)
                batch = g.batch()
                if HELD in batch.finish_reasons:
                    continue  # the engine closed meanwhile: its rows ended where they stood
                if g.quota.stale == "drop" and "stale" in batch.finish_reasons:
                    continue  # cut by a pause while this call ran
                served += 1
                yield (None if k < carried else g.index), batch
    finally:  # the groups not served stay held, in their order
        held.give_back([groups[k] for k in sorted(left)])


def held_groups(engine: Any) -> int:
    """How many groups this rank's engine holds for its next quota call, less those it will drop
    (past their call's ``max_staleness`` with ``stale="drop"``): ``rollout([], groups=held_groups(
    engine), ...)`` drains them. Any thread."""
    version = engine.version
    return sum(not g.dropped(version) for g in engine._held.groups())


__all__: Sequence[str] = ("HELD", "Quota", "Held", "quota_groups", "held_groups", "row_cut", "STALE_CHOICES")
