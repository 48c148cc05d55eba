"""``generate()`` with a token budget per call (Kimi k1.5's, as ``rollout(tokens_per_call=)``).

    done = engine.generate(prompts, max_new_tokens=4096, tokens_per_call=512)
    while held := [c for c in done if c.finish_reason == "held"]:
        ...                                  # a training step, other requests: anything
        done = engine.resume(held)           # the same rows, at most 512 tokens further

A call returns once each of its rows has finished or drawn ``tokens_per_call`` tokens in it. A
row cut at its budget comes back as a ``Completion`` whose ``finish_reason`` is ``"held"``: its
tokens, logprobs and ``versions`` so far, and a ``handle``. The engine keeps the row parked (out
of the batch, its KV dropped, its generator's state kept); ``engine.resume(completions)`` takes
held Completions (of this engine) and returns each row as it stands once it finished or drew one
more budget: all of its tokens from the first, its prompt prefilled again with its tokens under
the weights of then (after a ``paused()`` step, the new ones: ``versions`` says which weights drew
each token). A row keeps the budget of the call that submitted it. Held rows park when every
rank asks to pause: a pause never waits for them.

A cut row goes back to decoding at the rank's next call with a budget of any kind (a
``resume``, a ``generate(tokens_per_call=)``, a ``rollout(groups=)``: the engine's quota calls,
``partial.py``), and after each pause (a training step: every parked row resumes under the new
weights), so one whose Completion is never resumed still draws a budget per such call or pause.
Closing the engine (``close()``, the end of ``with engine:``) ends every held row where it stands:
its future resolves as a ``Completion`` with finish reason ``"held"`` (its tokens so far), it
draws no more tokens, and ``resume()`` raises ``EngineClosedError`` from then on.
Not collective, like ``generate()``. Refused by name: ``inputs=`` (images: a resumed row
re-prefills its ids only) and encoder-decoder models.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
from collections.abc import Sequence
from typing import Any

from shardgen.config import SamplingParams
from shardgen.generation.partial import HELD, row_cut
from shardgen.generation.requests import Completion, completion_of
from shardgen.generation.sequence import Holding


@dataclasses.dataclass(frozen=True)
class Handle:
    """A held row (``Completion.handle``): what ``resume`` continues, on its own engine only."""

    owner: Any  # the engine's ``Shared``
    request: Any  # the row's ``requests.Request``


def check_budget(tokens_per_call: Any) -> int:
    if isinstance(tokens_per_call, bool) or not isinstance(tokens_per_call, int) or tokens_per_call < 1:
        raise ValueError(f"tokens_per_call must be an integer >= 1, got {tokens_per_call!r}")
    return tokens_per_call


def generate(
    engine: Any,
    prompts: list[Any],
    params: SamplingParams | None,
    inputs: Sequence[dict[str, Any] | None] | None,
    tokens_per_call: Any,
    overrides: dict[str, Any],
) -> list[Completion]:
    """``engine.generate(prompts, ..., tokens_per_call=B)`` (module docstring). Not collective."""
    budget = check_budget(tokens_per_call)
    said = "tokens_per_call= (rows cut at a budget per call)"
    if inputs is not None:
        raise ValueError(f"{said} does not take inputs= (images): a resumed row re-prefills its ids only")
    if getattr(engine.model.config, "is_encoder_decoder", False):
        raise ValueError(f"{said} needs a decoder-only model: a resumed row re-prefills prompt and tokens")
    call = engine._shared.begin_quota_call()  # before the rows exist: they are cut in it or later
    holding = Holding(engine.version, None, budget)
    reqs = engine._submit_many(prompts, params, overrides, as_requests=True, holding=holding)
    return _wait(engine, reqs, call)


def resume(engine: Any, completions: Sequence[Completion]) -> list[Completion]:
    """The rows of held ``completions`` (``finish_reason == "held"``, from this engine's
    ``generate(tokens_per_call=)`` or ``resume``), each once it finished or drew one more budget:
    one ``Completion`` per given one, in order, all of its tokens from the first; ``"held"``
    again where it was cut again. Not collective. (``shardgen.generation.per_call``.)"""
    if isinstance(completions, Completion):
        completions = [completions]
    reqs = []
    for i, c in enumerate(completions):
        h = getattr(c, "handle", None)
        if not isinstance(c, Completion) or c.finish_reason != HELD or not isinstance(h, Handle):
            why = c.finish_reason if isinstance(c, Completion) else type(c).__name__
            raise ValueError(f"completion {i} is not a held row ({why}): resume() takes those whose "
                             f"finish_reason is {HELD!r}")  # fmt: skip
        if h.owner is not engine._shared:
            raise ValueError(f"completion {i} is held by another engine (rank {c.rank}'s): resume it there")
        reqs.append(h.request)
    engine._check_usable()
    call = engine._shared.begin_quota_call()
    return _wait(engine, reqs, call)


def _wait(engine: Any, reqs: list[Any], call: int) -> list[Completion]:
    """Each row's ``Completion`` once every row finished or was cut at its budget in quota call
    ``call`` or later (a row cut in an earlier one goes back to decoding first). Rows parked for
    a pause are not cut: the call waits for them to resume. A failed engine resolves every
    future with its error, which ``result()`` raises here."""
    while True:
        waiting = [r.future for r in reqs if not r.future.done()]
        if not waiting or all(row_cut(r.seq, call) for r in reqs if not r.future.done()):
            break
        cf.wait(waiting, timeout=0.02, return_when=cf.FIRST_COMPLETED)  # the driver parks without a signal
    return [r.future.result() if r.future.done() else _held(engine, r) for r in reqs]


def _held(engine: Any, req: Any) -> Completion:
    """A parked row as it stands. Parked, the driver leaves it alone until a later quota call:
    one of another thread may release it meanwhile, so the lists are cut to a common length."""
    c = completion_of(req.seq, engine.tokenizer, engine.rank)
    lists = [c.token_ids, c.versions or []] + ([c.logprobs] if c.logprobs is not None else [])
    g = min(len(x) for x in lists)
    return dataclasses.replace(
        c, token_ids=c.token_ids[:g], logprobs=None if c.logprobs is None else c.logprobs[:g],
        versions=None if c.versions is None else c.versions[:g], finish_reason=HELD,
        handle=Handle(engine._shared, req),
    )  # fmt: skip


__all__: Sequence[str] = ("HELD", "Handle", "generate", "resume", "check_budget")
