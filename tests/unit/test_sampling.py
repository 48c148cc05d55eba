"""Tier 1 (pure unit): which tokens temperature, top-k and top-p allow, against Hugging Face's warpers.

The oracle is built here the way HF ``generate()`` builds it (``_get_logits_processor``):
``TemperatureLogitsWarper`` if temperature != 1, ``TopKLogitsWarper`` if top_k != 0,
``TopPLogitsWarper`` if top_p < 1, in that order, ``min_tokens_to_keep=1``. shardgen's reference
chain is ``sampling.warpers_for``; ``select_tokens`` applies the batched ``warp_scores``, checked
bit for bit against HF's chain in the second half, and its draws against a row-by-row sampler;
the last part checks the CPU top-p path (HF's kept set from one sort, the draw in sorted order).
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from shardgen import SamplingParams
from shardgen.generation import nucleus, sampling, warpers
from shardgen.generation.sampling import chosen_logprobs, make_generator, select_tokens, warpers_for

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


# ---------------------------------------------------------------------------------------------
# The batched sampler (warp_scores, draw_tokens, select_tokens) against HF's warpers run row by
# row and against the row-by-row sampler shardgen had (the oracle below, kept verbatim).
# ---------------------------------------------------------------------------------------------

PATHS = ["cpu-fast", "device"]  # numpy-sorted CPU path; the torch.sort path any device takes


def hf_chain(temperature: float, top_k: int, top_p: float) -> LogitsProcessorList:
    """HF generate()'s warpers for one request (the same rules as ``hf_probs``)."""
    procs = LogitsProcessorList()
    if temperature != 1.0:
        procs.append(TemperatureLogitsWarper(temperature))
    if top_k != 0:
        procs.append(TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1))
    if top_p < 1.0:
        procs.append(TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))
    return procs


def reference_draw(scores: torch.Tensor, u: torch.Tensor) -> int:
    """The row-by-row draw shardgen had: float64 CDF on the CPU, u * total, walk back over zeros."""
    probs = torch.softmax(scores.double().cpu(), dim=-1)
    cdf = torch.cumsum(probs, dim=-1)
    x = u * cdf[-1]
    idx = int(torch.searchsorted(cdf, x, right=True).clamp_(max=probs.numel() - 1))
    while idx > 0 and probs[idx] == 0.0:
        idx -= 1
    return idx


def reference_nucleus_draw(logits: torch.Tensor, t: float, k: int, p: float, u: torch.Tensor) -> int:
    """The top-p draw row by row, from HF's kept set: ascending sort of the top-k filtered row,
    its float64 CDF, the first position above ``removed + u * kept`` among HF's kept tokens, and
    the r-th token of that value for the r-th position of its tie group; ``reference_draw`` on
    HF's scores where HF's cut keeps part of a tie group."""
    kept_scores = hf_chain(t, k, p)(None, logits[None].clone())[0]
    scores = hf_chain(t, k, 1.0)(None, logits[None].clone())[0]  # temperature and top-k only
    V = scores.numel()
    m = V - int(torch.isfinite(kept_scores).sum())  # HF removed the m smallest
    ordered = torch.sort(scores).values
    if m > 0 and not torch.equal(torch.isfinite(kept_scores), scores > ordered[m - 1]):
        return reference_draw(kept_scores, u)  # a split tie group
    cdf = torch.softmax(ordered, -1).double().cumsum(-1)
    removed = float(cdf[m - 1]) if m > 0 else 0.0
    x = removed + float(u) * (float(cdf[-1]) - removed)
    pos = min(int(torch.searchsorted(cdf, torch.tensor([x], dtype=torch.float64), right=True)), V - 1)
    value = ordered[pos]
    rank = pos - int(torch.nonzero(ordered == value)[0])
    return int(torch.nonzero(scores == value).flatten()[rank])


def reference_select_tokens(
    logits: torch.Tensor, params: list[SamplingParams], generators: list
) -> torch.Tensor:
    """The oracle: the row-by-row sampler (HF's warpers on each row alone, one ``torch.rand``
    float64 from the row's generator, then ``reference_nucleus_draw`` for top-p rows from
    ``NUCLEUS_MIN_VOCAB`` on and ``reference_draw`` for the others)."""
    out = torch.argmax(logits, dim=-1)
    for i, p in enumerate(params):
        if not p.do_sample:
            continue
        r = p.resolved()
        t, k, tp = float(r.temperature), int(r.top_k), float(r.top_p)
        u = torch.rand((), generator=generators[i], dtype=torch.float64)
        if tp < 1.0 and logits.shape[1] >= sampling.NUCLEUS_MIN_VOCAB:
            out[i] = reference_nucleus_draw(logits[i], t, k, tp, u)
        else:
            out[i] = reference_draw(hf_chain(t, k, tp)(None, logits[i : i + 1])[0], u)
    return out


def batched_warp(logits: torch.Tensor, knobs: list[tuple[float, int, float]], path: str) -> torch.Tensor:
    return warpers.warp(logits, knobs, fast=path == "cpu-fast")


def mixed_params(n: int, seed: int) -> list[SamplingParams]:
    """n requests: greedy ones mixed in, different temperatures, top-k (some > vocab), top-p."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        if rng.random() < 0.2:
            out.append(SamplingParams())
            continue
        out.append(
            SamplingParams(
                do_sample=True,
                temperature=rng.choice([1.0, 0.7, 1.9, 0.3, None]),
                top_k=rng.choice([0, 0, 1, 3, 20, 100_000, None]),
                top_p=rng.choice([1.0, 0.95, 0.9, 0.5, 0.25, None]),
                seed=rng.randrange(2**40),
            ).resolved()
        )
    return out


def generators_for(params: list[SamplingParams]) -> list:
    return [make_generator(p.seed) if p.do_sample else None for p in params]


def make_logits(rows: int, vocab: int, kind: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * 3
    if kind == "bf16":  # what a bf16 model gives: ties everywhere, so top-p cuts split tie groups
        return x.to(torch.bfloat16).float()
    if kind == "ints":
        return torch.randint(0, 4, (rows, vocab), generator=g).float()
    return x


GRID = list(itertools.product(TEMPERATURES, TOP_KS, TOP_PS))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", sorted(DISTRIBUTIONS))
def test_batched_warp_is_hf_warpers_bit_for_bit(name, path):
    """Every (temperature, top_k, top_p) of the grid as one row of a single batch: each row's
    scores are exactly HF's chain on that row alone (ties, exact boundaries, top_k > vocab)."""
    logits = DISTRIBUTIONS[name]
    got = batched_warp(logits[None].repeat(len(GRID), 1), GRID, path)
    for row, (t, k, p) in enumerate(GRID):
        expected = hf_chain(t, k, p)(None, logits[None].clone())[0]
        assert torch.equal(got[row], expected), f"{name} t={t} k={k} p={p}: {got[row]} != HF {expected}"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", ["uniform", "ties"])
def test_batched_warp_keeps_what_hf_keeps_at_exact_top_p_boundaries(name, path):
    probs = torch.softmax(DISTRIBUTIONS[name].double(), -1)
    cums = torch.sort(probs, descending=True).values.cumsum(0).tolist()
    knobs = [
        (1.0, 0, float(p))
        for cum in cums[:-1]
        for p in (cum, math.nextafter(cum, 0.0), math.nextafter(cum, 1.0))
        if 0.0 < p < 1.0
    ] + [(1.0, 0, 1e-9)]  # everything but the top token is below 1 - 1e-9: min_tokens_to_keep
    logits = DISTRIBUTIONS[name][None].repeat(len(knobs), 1)
    got = batched_warp(logits, knobs, path)
    for row, (t, k, p) in enumerate(knobs):
        expected = hf_chain(t, k, p)(None, logits[row : row + 1].clone())[0]
        assert torch.equal(got[row], expected), f"{name} top_p={p!r}: {got[row]} != HF {expected}"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", ["normal", "bf16", "ints"])
@pytest.mark.parametrize("vocab", [1000, 32000])
def test_batched_warp_is_hf_warpers_on_real_vocabularies(vocab, kind, path):
    knobs = [(0.7, 0, 0.95), (1.0, 0, 0.9), (1.9, 50, 0.5), (0.3, 0, 0.25), (1.0, 5, 1.0), (1.3, 200, 0.99)]
    logits = make_logits(len(knobs), vocab, kind, seed=vocab)
    got = batched_warp(logits, knobs, path)
    for row, (t, k, p) in enumerate(knobs):
        expected = hf_chain(t, k, p)(None, logits[row : row + 1].clone())[0]
        assert torch.equal(got[row], expected), f"{kind} V={vocab} t={t} k={k} p={p}"


@pytest.mark.parametrize("nucleus_from", [None, 2])  # None: the module's NUCLEUS_MIN_VOCAB
@pytest.mark.parametrize("kind", ["normal", "bf16", "ints"])
@pytest.mark.parametrize("vocab", [8, 72, 4099])
def test_same_tokens_as_the_row_by_row_sampler(vocab, kind, nucleus_from, monkeypatch):
    """64 requests with mixed parameters (greedy ones among them), several steps: the batched
    sampler gives exactly the tokens of the row-by-row oracle for the same seeds."""
    if nucleus_from is not None:
        monkeypatch.setattr(sampling, "NUCLEUS_MIN_VOCAB", nucleus_from)
    params = mixed_params(64, seed=vocab)
    ours, theirs = generators_for(params), generators_for(params)
    for step in range(4):
        logits = make_logits(64, vocab, kind, seed=100 * vocab + step)
        expected = reference_select_tokens(logits, params, theirs)
        got = select_tokens(logits, params, ours, None)
        assert torch.equal(got, expected), f"step {step}: rows {torch.nonzero(got != expected).flatten()}"


@pytest.mark.parametrize("vocab", [72, 4099])
def test_a_request_draws_the_same_tokens_alone_in_a_batch_and_anywhere(vocab, monkeypatch):
    """One request (seed, parameters, logits per step) alone; as row 17 of 64 mixed requests; as
    row 0 of 23 others with other neighbours ("another rank"); in CPU chunks of one row and of
    the whole batch: the same tokens, and its warped scores are the same bits in every batch."""
    me = SamplingParams(do_sample=True, temperature=0.8, top_k=40, top_p=0.9, seed=1234).resolved()
    batch_a = mixed_params(64, seed=1)
    batch_a[17] = me
    batch_b = [me] + mixed_params(22, seed=2)
    runs = {"alone": ([me], 0), "row 17 of 64": (batch_a, 17), "row 0 of 23": (batch_b, 0)}
    gens = {name: generators_for(params) for name, (params, _) in runs.items()}
    chunks = {"one chunk": 1 << 30, "rows one by one": 1}
    gens_chunked = {c: generators_for(batch_a) for c in chunks}
    for step in range(6):
        mine = make_logits(1, vocab, "normal", seed=step)[0]
        tokens = {}
        for name, (params, row) in runs.items():
            logits = make_logits(len(params), vocab, "normal", seed=1000 + 7 * step + len(params))
            logits[row] = mine
            tokens[name] = int(select_tokens(logits, params, gens[name], None)[row])
            for path in PATHS:
                knobs = [warpers.knobs_of(p) for p in params if p.do_sample]
                sampled = logits[[i for i, p in enumerate(params) if p.do_sample]]
                at = sum(bool(p.do_sample) for p in params[:row])
                warped = batched_warp(sampled, knobs, path)[at]
                alone = batched_warp(mine[None], [warpers.knobs_of(me)], path)[0]
                assert torch.equal(warped, alone), f"{name}, {path}: warped scores depend on the batch"
        assert len(set(tokens.values())) == 1, f"step {step}: {tokens}"
        logits = make_logits(64, vocab, "bf16", seed=step)
        per_chunking = {}
        for c, size in chunks.items():
            monkeypatch.setattr(sampling, "CPU_CHUNK_ELEMENTS", size)
            per_chunking[c] = select_tokens(logits, batch_a, gens_chunked[c], None)
        assert torch.equal(*per_chunking.values()), f"step {step}: tokens depend on the CPU chunking"


def test_batch_independence_holds_with_threads():
    """The same rows alone and in a batch of 64 with 2 intra-op threads (rows are split across threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        params = mixed_params(64, seed=5)
        logits = make_logits(64, 4099, "normal", seed=5)
        together = select_tokens(logits, params, generators_for(params), None)
        alone = [
            int(select_tokens(logits[i : i + 1], [p], generators_for([p]), None))
            for i, p in enumerate(params)
        ]
        assert together.tolist() == alone
    finally:
        torch.set_num_threads(threads)


def test_greedy_top_k_1_and_temperature_extremes_in_one_batch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 500, generator=g) * 2  # distinct scores: the argmax is unique
    params = [
        SamplingParams(temperature=0.3, top_k=5, top_p=0.5),  # greedy: the knobs are ignored
        SamplingParams(do_sample=True, top_k=1, temperature=1.7, seed=1),  # top_k=1: the argmax
        SamplingParams(do_sample=True, temperature=1e-4, seed=2),  # T -> 0: the argmax
        SamplingParams(do_sample=True, temperature=1e4, top_k=1, seed=3),  # T -> inf, top_k=1: argmax
        SamplingParams(do_sample=True, temperature=1e4, seed=4),  # T -> inf: nearly uniform
        SamplingParams(do_sample=False),
    ]
    argmax = logits.argmax(-1)
    gens = generators_for(params)
    spread = set()
    for _ in range(40):
        out = select_tokens(logits, params, gens, None)
        assert out[[0, 1, 2, 3, 5]].tolist() == argmax[[0, 1, 2, 3, 5]].tolist()
        spread.add(int(out[4]))
    assert len(spread) > 30, f"T = 1e4 drew only {len(spread)} distinct tokens of 500 in 40 draws"


def test_each_sampled_row_takes_exactly_one_draw_from_its_generator():
    params = mixed_params(16, seed=9)
    gens = generators_for(params)
    twins = generators_for(params)
    select_tokens(make_logits(16, 72, "normal", seed=0), params, gens, None)
    for p, g, twin in zip(params, gens, twins, strict=True):
        if p.do_sample:
            torch.rand((), generator=twin, dtype=torch.float64)
            assert torch.equal(g.get_state(), twin.get_state())


@pytest.mark.parametrize("path", PATHS)
def test_the_draw_never_lands_on_a_removed_token(path):
    """u * total can round up to the total (u just below 1): the last token of positive
    probability then, never a filtered one, as the row-by-row sampler did."""
    scores = torch.tensor(
        [
            [0.0, 1.0, 2.0, NEG, NEG],  # trailing filtered tokens
            [NEG, 1.0, NEG, 0.5, NEG],
            [NEG, NEG, 3.0, NEG, NEG],  # one token left
            [-800.0, 0.0, NEG, 1.0, -900.0],  # float64 probability 0 though not filtered
        ]
    )
    top = math.nextafter(1.0, 0.0)
    for u in (0.0, 0.5, top):
        us = torch.full((len(scores),), u, dtype=torch.float64)
        got = sampling.draw_tokens(scores, us)
        expected = [reference_draw(row, torch.tensor(u, dtype=torch.float64)) for row in scores]
        assert got.tolist() == expected, f"u={u!r}"
        assert all(torch.softmax(scores.double(), -1)[i, t] > 0 for i, t in enumerate(got.tolist()))


def test_the_cdf_is_float64_a_token_of_probability_1e_13_stays_reachable():
    """In float32 the last token's slice of the CDF (1e-13 wide) rounds away; a u inside it must
    still draw it, as the row-by-row float64 CDF did."""
    scores = torch.tensor([[0.0, -30.0]])  # p = (1 - 9.4e-14, 9.4e-14)
    for u in (0.5, 1.0 - 5e-14, 1.0 - 1e-15):
        got = int(sampling.draw_tokens(scores, torch.tensor([u], dtype=torch.float64))[0])
        assert (
            got == reference_draw(scores[0], torch.tensor(u, dtype=torch.float64)) == (0 if u == 0.5 else 1)
        )


def test_logits_never_leave_their_device():
    """The whole batched path on the meta device: any copy to the host or sync on a value
    (.cpu(), .tolist(), .item(), bool(), numpy) raises there. The draws come from the CPU
    generators (one each), then travel as one [S] tensor."""
    logits = torch.empty(8, 151_936, device="meta")
    params = [
        SamplingParams(do_sample=True, temperature=0.7, top_p=0.95, seed=1),
        SamplingParams(),
        SamplingParams(do_sample=True, top_k=50, seed=2),
        SamplingParams(do_sample=True, temperature=0.6, top_k=20, top_p=0.8, seed=3),
        SamplingParams(do_sample=True, temperature=1.3, seed=4),
        SamplingParams(do_sample=True, top_k=1, seed=5),
        SamplingParams(do_sample=True, top_p=0.5, seed=6, logprobs=True),
        SamplingParams(),
    ]
    gens = generators_for([p.resolved() for p in params])
    tokens = select_tokens(logits, params, gens, None)
    assert tokens.device.type == "meta" and tokens.shape == (8,) and tokens.dtype == torch.long
    lps = chosen_logprobs(logits, tokens, params)
    assert lps.device.type == "meta" and lps.shape == (8,)
    all_sampled = [p for p in params if p.do_sample]
    tokens = select_tokens(logits[:6], all_sampled, generators_for([p.resolved() for p in all_sampled]), None)
    assert tokens.device.type == "meta"


def test_chosen_logprobs_are_batched_per_row_temperature_or_raw():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 50, generator=g)
    tokens = torch.tensor([3, 7, 0, 49])
    params = [
        SamplingParams(do_sample=True, temperature=0.5, seed=1),
        SamplingParams(do_sample=True, temperature=0.5, raw_logprobs=True, seed=1),
        SamplingParams(),
        SamplingParams(do_sample=True, temperature=2.0, seed=1),
    ]
    got = chosen_logprobs(logits, tokens, params)
    for i, t in enumerate([0.5, 1.0, 1.0, 2.0]):
        alone = (
            torch.log_softmax(logits[i] / t, dim=-1)[tokens[i]]
            if t != 1.0
            else torch.log_softmax(logits[i], -1)[tokens[i]]
        )
        assert torch.equal(got[i], alone), i


@pytest.mark.gpu
def test_on_cuda_a_request_draws_the_same_tokens_alone_and_in_a_batch():
    """The device path on CUDA: logits stay there, and a row alone and as row 17 of 64 mixed rows
    gives the same tokens (cumsum's CUDA blocking depends on the row count: see sampling.py)."""
    me = SamplingParams(do_sample=True, temperature=0.8, top_k=40, top_p=0.9, seed=1234).resolved()
    batch = mixed_params(64, seed=1)
    batch[17] = me
    alone_gens, batch_gens = generators_for([me]), generators_for(batch)
    for step in range(20):
        logits = make_logits(64, 32000, "normal", seed=step).cuda()
        together = select_tokens(logits, batch, batch_gens, None)
        alone = select_tokens(logits[17:18].clone(), [me], alone_gens, None)
        assert together.device.type == "cuda" and int(together[17]) == int(alone[0]), f"step {step}"


# ---------------------------------------------------------------------------------------------
# The CPU top-p path (``nucleus_cut`` / ``nucleus_draw``): HF's kept set found from one sort,
# the draw in sorted order. Random rows with ties and exact top-p boundaries, against HF's warpers.
# ---------------------------------------------------------------------------------------------


@st.composite
def nucleus_case(draw):
    """(logits [V], temperature, top_k, top_p): ties (small integers, bf16 rounding) or distinct
    scores; top_p random or exactly at (or one float step beside) one of HF's cumulative sums."""
    V = draw(st.integers(2, 300))
    seed = draw(st.integers(0, 2**31 - 1))
    kind = draw(st.sampled_from(["normal", "flat", "bf16", "ints", "masked"]))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(V, generator=g) * (0.2 if kind == "flat" else 3.0)
    if kind == "bf16":
        x = x.to(torch.bfloat16).float()
    elif kind == "ints":
        x = torch.randint(0, draw(st.integers(1, 5)), (V,), generator=g).float()
    elif kind == "masked":
        x = x.masked_fill(torch.rand(V, generator=g) < 0.5, NEG).clone()
        x[int(torch.randint(0, V, (1,), generator=g))] = 1.0  # at least one finite score
    t = draw(st.sampled_from([1.0, 0.7, 1.9]))
    k = draw(st.sampled_from([0, 0, 1, 3, 17, V, V + 5]))
    scores = hf_chain(t, k, 1.0)(None, x[None].clone())[0]
    cums = torch.softmax(torch.sort(scores).values, -1).cumsum(-1)  # HF's float32 cum, ascending
    if draw(st.booleans()):
        p = draw(st.floats(1e-6, 1.0, exclude_max=True))
    else:  # HF compares cum <= float32(1 - top_p): put 1 - top_p on a cum, or one float32 step off
        c = float(cums[draw(st.integers(0, V - 1))])
        c = draw(st.sampled_from([c, math.nextafter(c, 0.0), math.nextafter(c, 2.0)]))
        c32 = torch.tensor(c, dtype=torch.float32)
        c32 = draw(st.sampled_from([c32, torch.nextafter(c32, torch.tensor(2.0))]))
        p = 1.0 - float(c32)
        if not 0.0 < p < 1.0:
            p = 0.5
    return x, t, k, p


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nucleus_case())
def test_nucleus_cut_keeps_exactly_what_hf_keeps(case):
    """HF's kept set is every top-k kept score above the cut's ``ordered[m - 1]`` (all at m = 0),
    or the cut says ``split`` and then HF's set is no threshold set; every draw (u from 0 to just
    below 1) lands in HF's kept set."""
    x, t, k, p = case
    V = x.numel()
    hf_kept = torch.isfinite(hf_chain(t, k, p)(None, x[None].clone())[0])
    cut = nucleus.nucleus_cut(x[None], [(t, k, p)])
    m, split = int(cut.removed), bool(cut.split)
    assert V - m == int(hf_kept.sum()), f"removed {m}, HF removed {V - int(hf_kept.sum())}"
    filtered = hf_chain(t, k, 1.0)(None, x[None].clone())[0]  # temperature and top-k
    threshold_set = filtered > cut.ordered[0, m - 1] if m > 0 else torch.ones(V, dtype=torch.bool)
    if split:
        assert not torch.equal(threshold_set, hf_kept), "split, but HF's kept set is a threshold set"
    else:
        assert torch.equal(threshold_set, hf_kept), f"kept {threshold_set.nonzero().flatten().tolist()}"
    us = torch.tensor([0.0, 0.25, 0.5, 0.75, math.nextafter(1.0, 0.0)], dtype=torch.float64)
    tokens = nucleus.nucleus_draw(x[None].repeat(len(us), 1), [(t, k, p)] * len(us), us)
    assert all(bool(hf_kept[tok]) for tok in tokens.tolist()), f"drew {tokens.tolist()} outside HF's set"


@pytest.mark.parametrize("vocab", [72, 4099])
def test_a_row_without_top_p_draws_the_same_beside_top_p_rows(vocab, monkeypatch):
    """The CPU path a row takes is chosen by its own knobs: rows without top-p (temperature and
    top-k only) draw the same tokens alone as in a chunk of top-p rows, and top-p rows the same
    alone as beside them."""
    plain = SamplingParams(do_sample=True, temperature=0.9, top_k=30, seed=7).resolved()
    nucleus = SamplingParams(do_sample=True, temperature=0.7, top_p=0.95, seed=8).resolved()
    monkeypatch.setattr(sampling, "NUCLEUS_MIN_VOCAB", 2)  # both paths at both vocabularies
    batch = [nucleus, plain, nucleus, plain]
    together, alone = generators_for(batch), generators_for(batch)
    for step in range(8):
        logits = make_logits(4, vocab, "normal", seed=step)
        got = select_tokens(logits, batch, together, None).tolist()
        one_by_one = [
            int(select_tokens(logits[i : i + 1], [p], [alone[i]], None)) for i, p in enumerate(batch)
        ]
        assert got == one_by_one, f"step {step}"


def test_top_p_draws_follow_hf_frequencies_on_tied_rows(monkeypatch):
    """Tied scores inside the nucleus: each tied token drawn at HF's probability (the draw maps
    a position in the tie group to a token), over a row of 40 tokens in 5 tied levels."""
    logits = torch.tensor([float(i % 5) for i in range(40)])
    expected = hf_probs(logits, 1.0, 0, 0.95)  # removes the two lowest levels whole
    assert not bool(nucleus.nucleus_cut(logits[None], [(1.0, 0, 0.95)]).split)
    monkeypatch.setattr(sampling, "NUCLEUS_MIN_VOCAB", 2)  # the top-p path at this small vocabulary
    rows, draws = 8, 500
    params = [sampled(1.0, 0, 0.95)] * rows
    gens = [make_generator(99 + r) for r in range(rows)]
    counts = torch.zeros(40, dtype=torch.float64)
    for _ in range(draws):
        counts += torch.bincount(
            select_tokens(logits[None].repeat(rows, 1), params, gens, None), minlength=40
        )
    n = rows * draws
    assert set(counts.nonzero().flatten().tolist()) <= allowed(expected)
    for tok in allowed(expected):
        q = float(expected[tok])
        assert abs(float(counts[tok]) / n - q) <= 5 * math.sqrt(q * (1 - q) / n), f"token {tok}"


@pytest.mark.parametrize("vocab", [72, 4099, 32000, 152064])
def test_float32_cumsum_is_the_float64_running_sum_rounded(vocab):
    """What ``nucleus_cut`` relies on to have HF's cumulative probabilities without a float32
    cumsum: torch's CPU float32 ``cumsum`` accumulates in float64 and rounds each sum."""
    g = torch.Generator().manual_seed(vocab)
    for scale in (0.3, 3.0, 30.0):
        q = torch.softmax(torch.sort(torch.randn(4, vocab, generator=g) * scale).values, -1)
        assert torch.equal(q.cumsum(-1), q.cumsum(-1, dtype=torch.float64).float()), f"scale {scale}"


# ---------------------------------------------------------------------------------------------
# The binned top-p path (``binned_draw``): ``nucleus_draw``'s token without sorting the row, or
# the row handed back to it. Every row it settles must be ``nucleus_draw``'s token.
# ---------------------------------------------------------------------------------------------


def binned_rows(kind: str, rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Rows of logits: normal x 3 (a nucleus of hundreds), flat (a random model's near-uniform
    rows), zipf (peaked, LLM-like), bf16 and small-integer ties, and rows with -inf entries."""
    g = torch.Generator().manual_seed(seed)
    if kind == "zipf":
        base = -1.1 * torch.arange(1, vocab + 1, dtype=torch.float32).log()
        return torch.stack(
            [base[torch.randperm(vocab, generator=g)] for _ in range(rows)]
        ) + 0.1 * torch.randn(rows, vocab, generator=g)
    x = torch.randn(rows, vocab, generator=g) * (0.3 if kind == "flat" else 3.0)
    if kind == "bf16":
        return x.to(torch.bfloat16).float()
    if kind == "ints":
        return torch.randint(0, 50, (rows, vocab), generator=g).float()
    if kind == "masked":
        return x.masked_fill(torch.rand(rows, vocab, generator=g) < 0.3, NEG)
    return x


@pytest.mark.parametrize("kind", ["normal", "flat", "zipf", "bf16", "ints", "masked"])
@pytest.mark.parametrize("vocab", [8192, 32000, 50257])
def test_binned_draw_settles_rows_with_the_nucleus_token(kind, vocab):
    """Over temperatures and top-p values, every row ``binned_draw`` settles draws
    ``nucleus_draw``'s token for the same uniform; on the real-use rows (top-p 0.9-0.99, no ties)
    it settles most of them, so the sort is the exception."""
    settled = total = 0
    for i, (t, p) in enumerate([(0.7, 0.95), (1.0, 0.9), (1.3, 0.5), (0.5, 0.99), (1.9, 0.999)]):
        x = binned_rows(kind, 24, vocab, seed=vocab + i)
        knobs = [(t, 0, p)] * len(x)
        u = torch.rand(len(x), generator=torch.Generator().manual_seed(i), dtype=torch.float64)
        u[:2] = torch.tensor([0.0, math.nextafter(1.0, 0.0)])  # both ends of the draw
        tokens, ok = nucleus.binned_draw(x, knobs, u)
        want = nucleus.nucleus_draw(x, knobs, u)
        assert torch.equal(tokens[ok], want[ok]), (
            f"T {t} top_p {p}: rows {(ok & (tokens != want)).nonzero().flatten().tolist()}"
        )
        if p in (0.9, 0.95, 0.99):
            settled, total = settled + int(ok.sum()), total + len(x)
    if kind in ("normal", "flat", "zipf"):
        assert settled >= 0.6 * total, f"settled {settled} of {total} rows"
    if kind == "masked":  # -inf scores: no finite range of bins, so every row goes to the sort
        assert settled == 0


def test_binned_draw_settles_a_cut_beside_a_token_when_both_cuts_draw_alike(monkeypatch):
    """A row whose top-p cut lies within the margin of a token's running sum may be cut on either
    side of that token: ``binned_draw`` settles it when the draw gives the same token for both
    cuts, and that token is ``nucleus_draw``'s. (A margin 10x wider puts many rows there.)"""
    monkeypatch.setattr(nucleus, "CUT_MARGIN", 10 * nucleus.CUT_MARGIN)
    x = binned_rows("flat", 64, 32000, seed=5)
    knobs = [(0.7, 0, 0.95)] * len(x)
    u = torch.rand(len(x), generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    tokens, ok = nucleus.binned_draw(x, knobs, u)
    assert torch.equal(tokens[ok], nucleus.nucleus_draw(x, knobs, u)[ok])
    c = nucleus.nucleus_cut(x, knobs)  # HF's running sum at the last removed and the first kept token
    around = c.cdf.gather(1, torch.cat([(c.removed - 1).clamp(min=0), c.removed], dim=1))
    near = nucleus.CUT_MARGIN * x.shape[1] * c.thr.double()
    beside = ((around - c.thr.double()).abs() <= near / 2).any(1)  # ours within the margin too
    n_beside, n_settled = int(beside.sum()), int((beside & ok).sum())
    assert n_beside >= 12 and n_settled >= 5, (n_beside, n_settled)


@pytest.mark.parametrize("chunk", [None, 3 * 32000])
def test_binned_path_gives_the_same_tokens_as_the_sorted_path(chunk, monkeypatch):
    """``select_tokens`` at vocabulary 32,000 with mixed rows (top-p alone, top-k with top-p,
    temperature only, greedy, tied bf16 rows): the same tokens as with the binned path off, and
    each row's token the same alone as in the batch, in any chunking."""
    if chunk is not None:
        monkeypatch.setattr(sampling, "FAST_CHUNK_ELEMENTS", chunk)
    kinds = [
        SamplingParams(do_sample=True, temperature=0.7, top_p=0.95, seed=1),
        SamplingParams(do_sample=True, temperature=1.0, top_k=40, top_p=0.9, seed=2),
        SamplingParams(do_sample=True, temperature=0.8, seed=3),
        SamplingParams(do_sample=False),
        SamplingParams(do_sample=True, temperature=1.2, top_p=0.99, seed=4),
    ]
    batch = [kinds[i % len(kinds)].resolved() for i in range(10)]
    for step in range(4):
        logits = binned_rows("normal" if step % 2 else "flat", 10, 32000, seed=step)
        logits[4] = logits[4].to(torch.bfloat16).float()
        on = select_tokens(logits, batch, generators_for(batch), None)
        alone = [
            int(select_tokens(logits[i : i + 1], [p], generators_for([p]), None)) for i, p in enumerate(batch)
        ]
        with monkeypatch.context() as m:
            m.setattr(sampling, "FAST_MIN_VOCAB", 10**9)  # the sorted path only
            off = select_tokens(logits, batch, generators_for(batch), None)
        assert on.tolist() == off.tolist() == alone, f"step {step}"


@pytest.mark.parametrize("vocab", [8192, 32000, 152064])
def test_cut_margin_covers_the_sorted_softmax_on_this_cpu(vocab):
    """What ``binned_draw``'s cut margin assumes, on the CPU the suite runs on: HF's running sum
    (softmax of the sorted row) and the unsorted softmax's, summed in sorted order, differ by less
    than half of CUT_MARGIN x V, relative, wherever the sum is above 1e-3."""
    g = torch.Generator().manual_seed(vocab)
    for scale in (0.3, 3.0, 10.0):
        x = torch.randn(8, vocab, generator=g) * scale
        ordered, order = torch.sort(x, -1)
        hf = torch.softmax(ordered, -1).cumsum(-1, dtype=torch.float64)
        ours = torch.softmax(x, -1).gather(1, order).double().cumsum(-1)
        rel = ((hf - ours).abs() / hf)[hf > 1e-3]
        assert float(rel.max()) < 0.5 * nucleus.CUT_MARGIN * vocab, f"scale {scale}: {float(rel.max()):.3g}"
