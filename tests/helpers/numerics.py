"""The numeric promise across shapes, asserted in one place: ``assert_rows_agree``.

Two runs that compute a request in different shapes (another batch composition, shared prefill
on or off, refills, chunked prefill, a resumed job) may round differently in the last bits: GEMM
kernels are chosen by shape (tests/helpers/rounding.py reproduces a CPU whose kernels switch at 3 rows).
What is promised there (docs/USAGE.md, "Numerics: what is promised"):

* prompts, seeds and masks equal; tokens equal, except that a row may take another token where
  its draw or its argmax sits on a floating-point near-tie: the margin at the first differing
  step is under ``NEAR_TIE``. From there on the two rows are different samples and are not
  compared further;
* logprobs before the first difference within ``LOGPROB_ATOL``.

Runs of the same shapes keep their bit-for-bit assertions: this helper is for different shapes.

The margin at a differing step t, between the two tokens ``lo < hi`` the runs chose:

* greedy: the gap between the two tokens' logprobs at t (each run's own logprob of its token,
  or, given the model, both recomputed from one forward of the row's prefix);
* sampled: the draw (``sampling.draw_tokens``) takes the first token whose float64 CDF exceeds
  ``x = u * total``, u the row's t-th uniform from its seed. The run that took ``lo`` saw
  ``x < cdf[lo]``, the one that took ``hi`` saw ``x >= cdf[hi - 1]``; with the CDF recomputed from
  one forward of the row's prefix, the margin is ``max(x - cdf[lo], cdf[hi - 1] - x)``: how far
  the CDF had to move, in probability, for both draws. Last-bit noise moves it by about 1e-6; a
  genuine difference (another distribution, another uniform) by about a token's probability.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from shardgen.config import SamplingParams
from shardgen.generation.sampling import draw_uniforms, make_generator, warp_scores

LOGPROB_ATOL = 1e-5
"""Logprobs of the same token at the same step, computed in different shapes (fp32 tiny models).
Measured (``SHARDGEN_TEST_NUMERICS_LOG``, the shape-comparing tests, about 980 rows): at most
4.8e-7 (2**-21: one float32 ulp at logprobs of -4 to -8) under SHARDGEN_TEST_SMALL_ROWS, and
the same on an AMD EPYC CPU (MKL, AVX512) without it; 1e-5 leaves a factor 20."""

NEAR_TIE = 1e-4
"""The largest margin (module docstring) at which a differing token counts as a near-tie: 100x
the logprob noise above (a logprob 1 ulp off moves a CDF boundary by about p * 5e-7). In the
measured runs no token differed; a draw that sat 1e-3 or more from every boundary fails."""


@dataclass(frozen=True)
class Row:
    """One request's outcome, independent of the batch's padding."""

    prompt: list[int]
    tokens: list[int]
    """The generated tokens where the response mask is 1."""
    logprobs: list[float] | None
    seed: int | None
    finish: str | None = None


@dataclass
class Agreement:
    """What ``assert_rows_agree`` found: for the docs' figures and the tests' own checks."""

    rows: int = 0
    max_logprob_diff: float = 0.0
    diverged: list[tuple[int, int, float]] = field(default_factory=list)
    """(row, first differing step, its margin) for each row whose tokens differ."""


def as_row(r: Any) -> Row:
    """A ``Row`` from a ``Row``, a tuple of ``rollout_scenarios.rows`` (input_ids, attention_mask,
    response_mask, logprobs, seed, finish) or a ``Completion`` (``prompt_ids`` needed)."""
    if isinstance(r, Row):
        return r
    if isinstance(r, tuple):
        ids, attn, rmask, lps, seed, finish = r
        width = len(ids) - len(rmask)
        prompt = [t for t, m in zip(ids[:width], attn[:width], strict=True) if m]
        g = sum(rmask)
        assert rmask == [1] * g + [0] * (len(rmask) - g), f"response mask {rmask} is not a prefix"
        return Row(prompt, list(ids[width : width + g]), list(lps[:g]), seed, finish)
    return Row(list(r.prompt_ids), list(r.token_ids), None if r.logprobs is None else list(r.logprobs), None,
               r.finish_reason)  # fmt: skip


def rollout_rows(b: Any) -> list[Row]:
    """The rows of a ``RolloutBatch``."""
    from rollout_scenarios import rows

    return [as_row(r) for r in rows(b)]


def ids_rows(ids: torch.Tensor, mask: torch.Tensor, width: int, eos: Sequence[int]) -> list[Row]:
    """Greedy rows of an HF-shaped ``[B, width + G]`` output (prompts left-padded to ``width`` as
    ``mask`` [B, width] says, responses padded after their first EOS), without logprobs."""
    out = []
    for row, m in zip(ids.tolist(), mask.tolist(), strict=True):
        prompt = [t for t, k in zip(row[:width], m[:width], strict=True) if k]
        tokens = []
        for t in row[width:]:
            tokens.append(t)
            if t in eos:
                break
        out.append(Row(prompt, tokens, None, None))
    return out


def assert_ids_agree(
    got: torch.Tensor, expected: torch.Tensor, mask: torch.Tensor, model: Any, eos: Any = None, what: str = ""
) -> Agreement:
    """Greedy ``generate_ids`` against HF ``generate()`` on the same prompts when the engine's
    shapes may differ from HF's (rows that ended leave the engine's batch; HF keeps them): the
    tensors are equal, width and padding included, unless a row diverged at a near-tie.
    ``eos``: the call's ``eos_token_id`` (None: the model's)."""
    eos = model.generation_config.eos_token_id if eos is None else eos
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    width = mask.shape[1]
    mine, hf = ids_rows(got, mask, width, eos), ids_rows(expected, mask, width, eos)
    found = assert_rows_agree(mine, hf, model=model, what=what)
    if not found.diverged:
        assert torch.equal(got, expected), f"{what}: {got.tolist()} != HF {expected.tolist()}"
    return found


def _prefix_logits(model: Any, prefix: list[int]) -> torch.Tensor:
    """The next-token logits after ``prefix``, one unpadded row alone: [V] float32."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([prefix])).logits[0, -1].float()


def _uniform(seed: int, step: int) -> float:
    """The row's uniform at ``step``: one per step from its own generator (``requests.build_request``)."""
    g = make_generator(seed)
    for _ in range(step):
        draw_uniforms([g])
    return float(draw_uniforms([g])[0])


def draw_margin(logits: torch.Tensor, params: SamplingParams, seed: int, step: int, a: int, b: int) -> float:
    """How far the CDF of ``logits`` (warped by ``params``) had to move, in probability, for the
    draw at ``step`` of seed ``seed`` to take ``a`` in one run and ``b`` in the other."""
    scores = warp_scores(logits[None], [params])[0]
    cdf = torch.cumsum(torch.softmax(scores.double(), dim=-1), dim=-1)
    x = _uniform(seed, step) * float(cdf[-1])
    lo, hi = min(a, b), max(a, b)
    return max(x - float(cdf[lo]), float(cdf[hi - 1]) - x)


def greedy_margin(logits: torch.Tensor, a: int, b: int) -> float:
    """The gap between the logprobs (= logits) of ``a`` and ``b``."""
    return abs(float(logits[a]) - float(logits[b]))


def _first_difference(x: Row, y: Row) -> int | None:
    n = min(len(x.tokens), len(y.tokens))
    for t in range(n):
        if x.tokens[t] != y.tokens[t]:
            return t
    return None


def assert_rows_agree(
    a: Sequence[Any],
    b: Sequence[Any],
    *,
    model: Any = None,
    params: SamplingParams | None = None,
    atol: float = LOGPROB_ATOL,
    near_tie: float = NEAR_TIE,
    what: str = "",
) -> Agreement:
    """Assert the numeric promise (module docstring) between two runs' rows, row by row.

    ``a``, ``b``: the same requests in the same order (``Row``s or what ``as_row`` takes).
    ``model``: an unsharded copy of the model, to recompute a differing step's logits (needed
    for sampled rows; greedy rows fall back on their own logprobs). ``params``: the rows'
    sampling settings (temperature, top-k, top-p; a seeded row is a sampled one).
    """
    where = f"{what}: " if what else ""
    assert len(a) == len(b), f"{where}{len(a)} rows != {len(b)} rows"
    found = Agreement(rows=len(a))
    for i, (x, y) in enumerate(zip(map(as_row, a), map(as_row, b), strict=True)):
        at = f"{where}row {i}"
        assert x.prompt == y.prompt, f"{at}: prompts differ: {x.prompt} != {y.prompt}"
        assert x.seed == y.seed, f"{at}: seeds differ: {x.seed} != {y.seed}"
        t = _first_difference(x, y)
        same = min(len(x.tokens), len(y.tokens)) if t is None else t
        if x.logprobs is not None and y.logprobs is not None and same:
            diff = max(abs(p - q) for p, q in zip(x.logprobs[:same], y.logprobs[:same], strict=True))
            assert diff <= atol, f"{at}: logprobs {diff:.3g} apart before step {same} (tolerance {atol:g})"
            found.max_logprob_diff = max(found.max_logprob_diff, diff)
        if t is None:
            assert len(x.tokens) == len(y.tokens), (
                f"{at}: the same tokens, but one run stopped after {min(len(x.tokens), len(y.tokens))} "
                f"and the other after {max(len(x.tokens), len(y.tokens))}: no near-tie explains that"
            )
            both = x.finish is not None and y.finish is not None
            assert not both or x.finish == y.finish, f"{at}: finish {x.finish} != {y.finish}"
            continue
        ta, tb = x.tokens[t], y.tokens[t]
        if x.seed is not None:  # sampled: the draw's distance to the boundary between ta and tb
            assert model is not None and params is not None, (
                f"{at}: sampled tokens differ at step {t} ({ta} != {tb}); pass model= and params= to "
                "check that the draw sat on a near-tie"
            )
            full = params.resolved(getattr(model, "generation_config", None))  # the model's defaults too
            margin = draw_margin(_prefix_logits(model, x.prompt + x.tokens[:t]), full, x.seed, t, ta, tb)
            kind = "the draw's distance to the CDF boundary"
        elif model is not None:
            margin = greedy_margin(_prefix_logits(model, x.prompt + x.tokens[:t]), ta, tb)
            kind = "the two tokens' logit gap"
        else:
            assert x.logprobs is not None and y.logprobs is not None, (
                f"{at}: greedy tokens differ at step {t} ({ta} != {tb}); without logprobs pass model="
            )
            margin = abs(x.logprobs[t] - y.logprobs[t])
            kind = "the two tokens' logprob gap"
        assert margin < near_tie, (
            f"{at}: tokens differ at step {t} ({ta} != {tb}) and that is no near-tie: {kind} is "
            f"{margin:.3g} (near-tie bound {near_tie:g})"
        )
        found.diverged.append((i, t, margin))
    _record(what, found)
    return found


def _record(what: str, found: Agreement) -> None:
    """``SHARDGEN_TEST_NUMERICS_LOG=path``: one JSON line per call (the docs' measured figures)."""
    path = os.environ.get("SHARDGEN_TEST_NUMERICS_LOG")
    if path:
        line = {"what": what, "rows": found.rows, "max_logprob_diff": found.max_logprob_diff,
                "diverged": found.diverged}  # fmt: skip
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")


def assert_rows_are_their_own_bits(
    model: Any, ids: torch.Tensor, mask: torch.Tensor, label: Any = ""
) -> None:
    """Under ``shardgen.invariant_numerics()``: each row's logits in the left-padded batch ``ids``
    are the bits of the row alone, and its last token's logits decoded from the KV cache of the
    rest are the batch's. The promise of the switch, across shapes
    (tests/multirank/test_invariant_numerics.py, and on CUDA tests/multirank/test_gpu.py)."""
    import shardgen

    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad(), shardgen.invariant_numerics():
        full = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        for i in range(len(ids)):
            n = int(mask[i].sum())
            row = ids[i : i + 1, -n:]
            assert torch.equal(model(input_ids=row).logits[0], full[i, -n:]), (label, i)
            head = model(input_ids=row[:, :-1], use_cache=True)
            step = model(input_ids=row[:, -1:], cache=head.past_key_values).logits
            assert torch.equal(step[0, -1], full[i, -1]), (label, i)
