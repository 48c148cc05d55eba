"""Multi-turn rollouts: ``engine.rollout(prompts, n=4, env=step_fn, max_turns=8)``.

Each row is a conversation: the model answers, ``step_fn(row, completion)`` replies with token
ids (a tool's output, an environment's observation, a user turn), and the model goes on from
``completion.prompt_token_ids + completion.token_ids + reply``, exactly those ids: token-in,
token-out, nothing decoded and encoded again (a re-tokenized answer may not give back its
ids, and the next turn would then neither match the trained tokens nor the prefix cache). A
row ends when ``step_fn`` returns None, after ``max_turns`` model turns, or when the
conversation would reach the model's context.

Not collective, like ``rollout()``: rows take as many turns as they need, and ranks as many as
theirs. Each turn is a request of its own; the rank's prefix cache holds the conversation's KV
from the turn before (``prefix_cache.py``), so a turn prefills only the reply and the previous
answer's last token. ``step_fn`` runs in the caller's thread, as turns finish. A prompt's own
forward ``inputs`` (a VLM's images) go with every turn of its rows, since the conversation
still holds their tokens; the cache keys image tokens by their pixels, so it still serves.

The result is a ``RolloutBatch`` whose response is the whole conversation after the prompt:
``response_mask`` 1 on model tokens and 0 on environment tokens (TRL's tool mask, veRL's loss
mask), ``logprobs`` on model tokens (0 elsewhere), ``attention_mask`` 1 on every real token,
``turns`` the model turns per row.

With a quota (``groups=K``, ``partial.py``) the conversations outlive the call: ``Talk`` holds
them, and the next quota call steps those held at a turn boundary.
"""

from __future__ import annotations

import dataclasses
import queue
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any

from shardgen.config import context_length
from shardgen.errors import EngineClosedError
from shardgen.generation.partial import HELD, row_cut
from shardgen.generation.requests import Completion

StepFn = Callable[[int, Completion], "Sequence[int] | None"]
"""``step_fn(row, completion)``: row ``i * n + j`` is sample j of prompt i of the call that
submitted it (a held conversation's, stepped by a later call, too); ``completion`` is its last
turn (``prompt_token_ids`` the conversation so far). Returns the reply's token ids, or None to
end the row."""


class _Row:
    """One conversation: what the model and the environment said after the prompt."""

    def __init__(self) -> None:
        self.prompt: list[int] | None = None
        self.tokens: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []  # -1 on the environment's tokens
        self.turns = 0
        self.finish = "length"
        self.last: Completion | None = None  # its last model turn
        self.ended = False
        self.period, self.left = 0, 0  # a partial rollout's budget: the quota call, what is left in it

    def model_turn(self, c: Completion) -> None:
        if self.prompt is None:
            self.prompt = list(c.prompt_token_ids)
        self.tokens += c.token_ids
        self.mask += [1] * len(c.token_ids)
        self.logprobs += list(c.logprobs or [0.0] * len(c.token_ids))
        self.versions += list(c.versions or [-1] * len(c.token_ids))
        self.finish = c.finish_reason
        self.turns += 1

    def env_turn(self, reply: list[int]) -> None:
        self.tokens += reply
        self.mask += [0] * len(reply)
        self.logprobs += [0.0] * len(reply)
        self.versions += [-1] * len(reply)

    def completion(self) -> Completion:
        assert self.prompt is not None
        return Completion(
            token_ids=self.tokens, finish_reason=self.finish, prompt_token_ids=self.prompt,
            logprobs=self.logprobs, versions=self.versions,
        )  # fmt: skip


def check_turn_args(env: Any, max_turns: Any) -> int:
    """``max_turns`` as an int >= 1 (None: no bound but the context); ``env`` callable."""
    if not callable(env):
        raise ValueError(f"env must be a callable step_fn(row, completion), got {type(env).__name__}")
    if max_turns is None:
        return 2**31
    if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
        raise ValueError(f"max_turns must be None or an integer >= 1, got {max_turns!r}")
    return max_turns


def conversations(engine: Any, call: Any, env: StepFn, most: int) -> Iterator[tuple[int, Any]]:
    """``(i, group)`` per prompt as its ``n`` conversations end, in the order they end: the
    ``RolloutBatch`` of its rows. ``call``: the call's ``rollout._Call`` (its first turns already
    submitted; ``seed_of`` and ``pack``); ``most``: ``check_turn_args``'s. Not collective."""
    talk = Talk(engine, call, env, most)
    done: queue.SimpleQueue[tuple[int, Future | None]] = queue.SimpleQueue()
    for r in range(len(talk.rows)):
        talk.watch(r, done.put)
    live, left = len(talk.rows), [call.n] * call.prompts
    with engine._shared.turns():  # between turns, the engine keeps gathered weights for the next
        while live:
            r, f = done.get()
            if not talk.advance(r, f, 0, done.put):
                continue
            live -= 1
            i = r // call.n
            left[i] -= 1
            if not left[i]:
                yield i, talk.pack(range(i * call.n, (i + 1) * call.n))


Put = Callable[[tuple[int, "Future | None"]], None]


class Talk:
    """The conversations of one call's rows, stepped by ``advance`` in a caller's thread as their
    turns end. A partial rollout's (``holding``: each turn is a held row) outlives its call: its
    groups are held with it (``partial.Group.talk``), a turn ending between calls waits at its
    boundary, and the next quota call steps it with this ``env`` and the row numbers of this call.

    ``tokens_per_call`` (``holding.budget``) counts per quota call over a conversation's turns, as
    a Kimi-style budget bounds the work of an iteration: a turn starts with what the row has left
    of it in the call that starts it; a turn cut at its budget, or one that ends with nothing
    left, waits for the next quota call, which gives it a whole budget again."""

    def __init__(self, engine: Any, call: Any, env: StepFn, most: int, holding: Any = None, now: int = 0):
        text = engine.model.config.get_text_config(decoder=True)
        self.engine, self.call, self.env, self.most, self.holding = engine, call, env, most, holding
        self.ctx, self.vocab = context_length(text), int(text.vocab_size)
        self.rows = [_Row() for _ in call.futures]
        self.turn: list[Future | None] = list(call.futures)  # each row's turn in flight; None: none
        self.seqs: list[Any] = list(call.seqs) or [None] * len(call.futures)
        self.budget = None if holding is None else holding.budget
        for row in self.rows:
            row.period, row.left = now, self.budget or 0

    def watch(self, r: int, put: Put) -> None:
        """``put((r, turn))`` once row ``r``'s turn in flight ends (in the driver: only a put), or
        ``put((r, None))`` now if it waits at a turn boundary. Not for an ended row."""
        f = self.turn[r]
        if f is None:
            put((r, None))
        else:
            f.add_done_callback(lambda _f: put((r, _f)))

    def advance(self, r: int, f: Future | None, now: int, put: Put) -> bool:
        """Row ``r``'s turn ``f`` ended (None: the row waits at its boundary): record it, step the
        environment, start the next turn (watched with ``put``). True once the row ended. In the
        caller's thread; ``now``: the quota call's number (``Shared.begin_quota_call``)."""
        row = self.rows[r]
        if row.ended or f is not self.turn[r]:
            return False  # a turn an earlier call watched too, or one stepped already
        if f is not None:
            self.turn[r] = None
            c = f.result()
            row.model_turn(c)
            row.last = c
            if self.budget is not None and row.period == now:  # started in this call: all drawn in it
                row.left -= len(c.token_ids)
            elif self.budget is not None:  # started earlier: drawn in this call since this call resumed it
                s = self.seqs[r]
                row.period, row.left = now, self.budget - (len(s.tokens) - s.admitted_at if s.fed else 0)
        return self._step(r, now, put)

    def waits(self, r: int, now: int) -> bool:
        """Row ``r`` can draw no more before the next quota call: cut at its budget, or at a turn
        boundary with none left in call ``now``."""
        row, f = self.rows[r], self.turn[r]
        if f is None:
            return row.period == now and row.left <= 0
        return row_cut(self.seqs[r], now)

    def _step(self, r: int, now: int, put: Put) -> bool:
        row, h = self.rows[r], self.holding
        c = row.last
        assert c is not None, "a row stepped before its first turn ended"
        if c.finish_reason in (HELD, "stale") or row.turns >= self.most:
            return self._end(row)  # the engine closed, or the row outlived max_staleness
        if h is not None:
            if h.max_staleness is not None and self.engine.version - h.born > h.max_staleness:
                row.finish = "stale"  # cut at its turn boundary: no turn of too new weights
                return self._end(row)
            if self.budget is not None:
                if row.period != now:  # a later call steps it: a whole budget
                    row.period, row.left = now, self.budget
                if row.left <= 0:
                    return False  # waits at its boundary for the next quota call
        reply = self.env(r, c)
        if reply is None:
            return self._end(row)
        reply = _checked(reply, r, self.vocab)
        row.env_turn(reply)
        nxt = list(c.prompt_token_ids) + list(c.token_ids) + reply
        if self.ctx is not None and len(nxt) >= self.ctx:
            row.finish = "length"  # the reply is kept; no room for another model turn
            return self._end(row)
        try:
            self.turn[r], self.seqs[r] = self._submit(r, row, nxt)
        except EngineClosedError:
            if h is None:
                raise
            row.finish = HELD  # closed meanwhile: a held conversation ends where it stands
            return self._end(row)
        self.watch(r, put)
        return False

    def _submit(self, r: int, row: _Row, nxt: list[int]) -> tuple[Future, Any]:
        call, h = self.call, self.holding
        seed = call.seed_of(r, row.turns, nxt)
        # The conversation still holds the prompt's image tokens: its images go again (the
        # prefix cache keys them by their pixels, so the last turn's KV still serves).
        x = None if call.inputs is None else [call.inputs[r]]
        if h is None:
            return self.engine.submit_many([nxt], None, seed=[seed], inputs=x, **call.options)[0], None
        hold = h if self.budget is None else dataclasses.replace(h, budget=row.left)
        req = self.engine._submit_many(
            [nxt], None, {**call.options, "seed": [seed]}, inputs=x, holding=hold, as_requests=True
        )[0]
        return req.future, req.seq

    @staticmethod
    def _end(row: _Row) -> bool:
        row.ended = True
        return True

    def whole(self, rows: range) -> bool:
        return all(self.rows[r].ended for r in rows)

    def refresh(self, rows: range, budget: int | None) -> None:
        """Before a quota call takes the held rows: a turn parked at its budget resumes with a
        whole one (it was started with what its call had left). User thread; the driver leaves a
        row parked at its budget alone until the call begins."""
        if budget is None:
            return
        for r in rows:
            s = self.seqs[r]
            if s is not None and self.turn[r] is not None and s.parked and s.cut_in >= 0:
                s.holding = dataclasses.replace(s.holding, budget=budget)

    def pack(self, rows: range) -> Any:
        """The ``RolloutBatch`` of ``rows`` (every one ended)."""
        return _pack(self.engine, self.call, [self.rows[k] for k in rows], rows)


def _checked(reply: Any, row: int, vocab: int) -> list[int]:
    """The environment's reply as a list of token ids in the vocabulary."""
    if isinstance(reply, (str, bytes)):
        raise ValueError(f"env replied to row {row} with text: reply with token ids (token-in, token-out)")
    try:
        ids = [int(t) for t in reply]
    except (TypeError, ValueError):
        raise ValueError(f"env's reply to row {row} must be token ids or None, got {reply!r:.80}") from None
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"env's reply to row {row} has ids outside the vocabulary of {vocab}: {bad[:8]}")
    return ids


def _pack(engine: Any, call: Any, rows: list[_Row], index: range) -> Any:
    tok = getattr(engine, "tokenizer", None)
    done = [r.completion() for r in rows]
    if tok is not None:
        for c in done:
            c.text = tok.decode(c.token_ids, skip_special_tokens=True)
    return call.pack(done, index, masks=[r.mask for r in rows], turns=[r.turns for r in rows])
