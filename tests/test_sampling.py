"""Tier 1 (pure unit): which tokens temperature, top-k and top-p allow, against Hugging Face's warpers.

The oracle is built here the way HF ``generate()`` builds it (``_get_logits_processor``):
``TemperatureLogitsWarper`` if temperature != 1, ``TopKLogitsWarper`` if top_k != 0,
``TopPLogitsWarper`` if top_p < 1, in that order, ``min_tokens_to_keep=1``. shardgen's path is
``sampling.warpers_for`` (what ``select_tokens`` applies) and ``select_tokens`` itself for draws.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from shardgen import SamplingParams
from shardgen.generation.sampling import make_generator, select_tokens, warpers_for

NEG = -float("inf")
# Hand-built next-token logits [V=8]; token order deliberately not sorted by probability.
DISTRIBUTIONS = {
    "distinct": torch.tensor([0.15, 0.4, 0.05, 0.25, 0.005, 0.1, 0.03, 0.015]).log(),
    "ties": torch.tensor([1.0, 2.0, 0.0, 2.0, 1.0, -1.0, 1.0, 0.0]),
    "uniform": torch.zeros(8),  # every top-p cut at a multiple of 1/8 lands exactly on a boundary
    "dominant": torch.tensor([0.0, 0.0, 12.0, 0.0, 0.0, 0.0, 0.0, 0.0]),
    "masked": torch.tensor([NEG, 1.0, 3.0, NEG, 2.0, NEG, 0.5, NEG]),  # already filtered tokens
}
TEMPERATURES = [1.0, 0.7, 1.9]
TOP_KS = [0, 1, 3, 8, 100]  # 100 > vocab
TOP_PS = [1.0, 0.9, 0.75, 0.5, 0.25]  # 0.75, 0.5, 0.25: exact boundaries for "uniform"


def hf_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """HF generate()'s warpers applied to ``logits [V]``, then softmax -> probabilities [V] (float64)."""
    procs = LogitsProcessorList()
    if temperature != 1.0:
        procs.append(TemperatureLogitsWarper(temperature))
    if top_k != 0:
        procs.append(TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1))
    if top_p < 1.0:
        procs.append(TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))
    ids = torch.zeros((1, 1), dtype=torch.long)
    return torch.softmax(procs(ids, logits[None].clone())[0].double(), dim=-1)


def shardgen_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution select_tokens draws from: its warpers, then softmax in float64 (as sample_row)."""
    ids = torch.zeros((1, 1), dtype=torch.long)
    return torch.softmax(warpers_for(params)(ids, logits[None].clone())[0].double(), dim=-1)


def allowed(probs: torch.Tensor) -> set[int]:
    return set(torch.nonzero(probs > 0).flatten().tolist())


def sampled(temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> SamplingParams:
    p = SamplingParams(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p, seed=0)
    p.validate()
    return p


def assert_same_distribution(name: str, t: float, k: int, p: float) -> None:
    logits = DISTRIBUTIONS[name]
    theirs = hf_probs(logits, t, k, p)
    ours = shardgen_probs(logits, sampled(t, k, p))
    case = f"{name} temperature={t} top_k={k} top_p={p}"
    assert allowed(ours) == allowed(theirs), f"{case}: allowed {allowed(ours)} != HF {allowed(theirs)}"
    assert torch.allclose(ours, theirs, rtol=0, atol=1e-6), f"{case}: {ours.tolist()} != HF {theirs.tolist()}"


@pytest.mark.parametrize("name", sorted(DISTRIBUTIONS))
def test_allowed_tokens_and_probabilities_match_hf_warpers(name):
    for t, k, p in itertools.product(TEMPERATURES, TOP_KS, TOP_PS):
        assert_same_distribution(name, t, k, p)


# Edge cases with the answer written out, so the oracle above is checked too.
@pytest.mark.parametrize(
    "name, t, k, p, expected",
    [
        ("distinct", 1.0, 1, 1.0, {1}),  # top_k=1: the argmax alone
        ("distinct", 1.0, 100, 1.0, set(range(8))),  # top_k > vocab: everything
        ("distinct", 1.0, 0, 1.0, set(range(8))),  # top_p=1, no top_k: everything
        ("distinct", 1.0, 0, 0.39, {1}),  # 0.39 reached by the first token (0.4) alone
        ("distinct", 1.0, 0, 0.64, {1, 3}),  # 0.4 + 0.25 = 0.65 >= 0.64
        ("distinct", 1.0, 0, 0.66, {1, 3, 0}),  # one more token needed for 0.66
        ("distinct", 1.0, 3, 0.9, {1, 3, 0}),  # top-k cuts first, top-p keeps all three
        ("uniform", 1.0, 0, 0.5, None),  # exact boundary: 4 of the 8 tied tokens (which 4: HF's sort)
        ("ties", 1.0, 1, 1.0, {1, 3}),  # top_k=1 with a tie at the top keeps both (HF: scores < k-th)
        ("ties", 1.0, 3, 1.0, {0, 1, 3, 4, 6}),  # the tie at the 3rd place is kept whole
        ("dominant", 1.0, 0, 0.5, {2}),
        ("masked", 1.0, 100, 1.0, {1, 2, 4, 6}),  # masked tokens stay masked with top_k > vocab
        ("masked", 1.0, 0, 0.999, {1, 2, 4, 6}),
    ],
)
def test_edge_cases(name, t, k, p, expected):
    theirs = hf_probs(DISTRIBUTIONS[name], t, k, p)
    if expected is None:  # exact boundary: the kept mass is exactly top_p, so exactly p * V tokens
        assert len(allowed(theirs)) == round(p * 8), allowed(theirs)
    else:
        assert allowed(theirs) == expected, allowed(theirs)
    assert_same_distribution(name, t, k, p)


@pytest.mark.parametrize("name", ["uniform", "ties"])
def test_exact_top_p_boundaries_keep_what_hf_keeps(name):
    """Cuts where the cumulative mass equals top_p to the last bit: one token more or less is a bug."""
    probs = torch.softmax(DISTRIBUTIONS[name].double(), -1)
    cums = torch.sort(probs, descending=True).values.cumsum(0).tolist()
    for cum in cums[:-1]:
        for p in (cum, math.nextafter(cum, 0.0), math.nextafter(cum, 1.0)):
            if 0.0 < p < 1.0:
                assert_same_distribution(name, 1.0, 0, float(p))


def test_greedy_rows_take_the_argmax_whatever_the_sampling_knobs():
    logits = torch.stack([DISTRIBUTIONS["distinct"], DISTRIBUTIONS["masked"]])
    params = [SamplingParams(temperature=0.5, top_k=2, top_p=0.3), SamplingParams()]
    out = select_tokens(logits, params, [None, None], torch.zeros((2, 1), dtype=torch.long))
    assert out.tolist() == [1, 2]


@pytest.mark.parametrize(
    "name, t, k, p",
    [("distinct", 1.0, 0, 0.66), ("ties", 0.7, 3, 0.9), ("masked", 1.9, 0, 0.9), ("uniform", 1.0, 0, 0.5)],
)
def test_draws_follow_the_hf_distribution(name, t, k, p):
    """Fixed seeds, many draws through select_tokens: only allowed tokens, at HF's frequencies."""
    logits = DISTRIBUTIONS[name]
    expected = hf_probs(logits, t, k, p)
    rows, draws = 4, 600  # 4 rows with their own generators, drawn side by side in one batch
    params = [sampled(t, k, p)] * rows
    gens = [make_generator(1234 + r) for r in range(rows)]
    batch_logits = logits[None].repeat(rows, 1)
    ids = torch.zeros((rows, 1), dtype=torch.long)
    counts = torch.zeros(logits.numel(), dtype=torch.float64)
    for _ in range(draws):
        counts += torch.bincount(select_tokens(batch_logits, params, gens, ids), minlength=logits.numel())
    n = rows * draws
    drawn = set(torch.nonzero(counts).flatten().tolist())
    assert drawn <= allowed(expected), f"drew {drawn - allowed(expected)} outside HF's {allowed(expected)}"
    for tok in allowed(expected):
        q = float(expected[tok])
        sigma = math.sqrt(q * (1 - q) / n)
        freq = float(counts[tok]) / n
        assert abs(freq - q) <= 5 * sigma + 1e-9, f"token {tok}: drawn {freq:.4f}, HF p={q:.4f} ({n} draws)"


def test_unset_knobs_count_at_hf_defaults():
    """Fields left None (the model's generation_config decides) act as HF's defaults: t=1, k=0, p=1."""
    logits = DISTRIBUTIONS["distinct"]
    ours = shardgen_probs(logits, SamplingParams(do_sample=True, top_p=0.66))
    theirs = hf_probs(logits, 1.0, 0, 0.66)
    assert allowed(ours) == allowed(theirs) == {0, 1, 3}
    assert torch.allclose(ours, theirs, rtol=0, atol=1e-6)
