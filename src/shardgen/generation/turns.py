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
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any

from shardgen.config import context_length
from shardgen.generation.requests import Completion

StepFn = Callable[[int, Completion], "Sequence[int] | None"]
"""``step_fn(row, completion)``: row ``i * n + j`` is sample j of prompt i; ``completion`` is its
last turn (``prompt_token_ids`` the conversation so far). Returns the reply's token ids, or None
to end the row."""


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
    text = engine.model.config.get_text_config(decoder=True)
    ctx = context_length(text)
    vocab = int(text.vocab_size)
    rows = [_Row() for _ in call.futures]
    done: queue.SimpleQueue[tuple[int, Future]] = queue.SimpleQueue()

    def watch(r: int, f: Future) -> None:
        f.add_done_callback(lambda _f: done.put((r, _f)))  # runs in the driver: only a put

    for r, f in enumerate(call.futures):
        watch(r, f)
    live, left = len(rows), [call.n] * call.prompts
    while live:
        r, f = done.get()
        c, row = f.result(), rows[r]
        row.model_turn(c)
        reply = None if row.turns >= most else env(r, c)
        if reply is not None:
            reply = _checked(reply, r, vocab)
            row.env_turn(reply)
            nxt = list(c.prompt_token_ids) + list(c.token_ids) + reply
            if ctx is None or len(nxt) < ctx:
                seed = call.seed_of(r, row.turns, nxt)
                # The conversation still holds the prompt's image tokens: its images go again (the
                # prefix cache keys them by their pixels, so the last turn's KV still serves).
                x = None if call.inputs is None else [call.inputs[r]]
                watch(r, engine.submit_many([nxt], None, seed=[seed], inputs=x, **call.options)[0])
                continue
            row.finish = "length"  # the reply is kept; no room for another model turn
        live -= 1
        i = r // call.n
        left[i] -= 1
        if not left[i]:
            group = range(i * call.n, (i + 1) * call.n)
            yield i, _pack(engine, call, [rows[k] for k in group], group)


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
