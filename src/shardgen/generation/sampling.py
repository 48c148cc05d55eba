"""Token selection: greedy, temperature, top-k, top-p, with a generator per request.

All sampled rows of a batch are processed at once, on the logits' device, each with its own
parameters; no reduction mixes rows. The warpers are Hugging Face's semantics (``warpers_for``
builds HF's own chain; ``warp_scores`` gives the same scores, bit for bit on the CPU). The draw
is one uniform number per row per step, from that row's own CPU ``torch.Generator``, mapped
through a float64 CDF: a request's tokens depend only on its logits and its seed, never on
which rank served it or what else was in the batch, and the draw is stable under the last-bit
noise that batching can add to logits. On the CPU, top-p rows draw from HF's kept set in
sorted order (``_nucleus_draw``: the one sort that finds the cut also orders the CDF, so no
warped scores or second softmax); at large vocabularies rows without top-k first try
``_binned_draw``, which finds the same token from a histogram of the row's probability mass and
sorts only two bins, and hands a row whose cut or draw lies too near a boundary to
``_nucleus_draw``; other rows, and every row on other devices, draw through the CDF in
vocabulary order (``draw_tokens``). Which way a row goes depends on its own knobs and
device only. On the CPU a row's result is bitwise the same alone or in any batch
(tests/test_sampling.py). On CUDA, ``cumsum`` picks its thread layout from the number of rows
(and a single row takes another kernel), so cumulative sums may differ in the last bit between
batch shapes; that moves a token only when the row's uniform or top-p threshold lies within
that rounding of a boundary, as last-bit noise in the logits would.
"""

from __future__ import annotations

import functools
import threading
from typing import NamedTuple

import numpy as np
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from shardgen.config import SamplingParams

NEG_INF = float("-inf")


def make_generator(seed: int) -> torch.Generator:
    """A CPU generator: CPU draws are identical on every device type."""
    g = torch.Generator(device="cpu")
    g.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
    return g


def warpers_for(params: SamplingParams) -> LogitsProcessorList:
    """HF's warpers in HF's order (temperature, top-k, top-p) for a sampled request.

    The reference semantics: ``warp_scores`` applies the same chain to many rows at once and
    gives the same scores. Unset fields count at their library defaults (requests arrive
    resolved: ``build_request``).
    """
    params = params.resolved()
    procs = LogitsProcessorList()
    if not params.do_sample:
        return procs
    if params.temperature != 1.0:
        procs.append(TemperatureLogitsWarper(float(params.temperature)))
    if params.top_k > 0:
        procs.append(TopKLogitsWarper(top_k=int(params.top_k), min_tokens_to_keep=1))
    if params.top_p < 1.0:
        procs.append(TopPLogitsWarper(top_p=float(params.top_p), min_tokens_to_keep=1))
    return procs


def draw_uniforms(generators: list[torch.Generator], device: torch.device | str = "cpu") -> torch.Tensor:
    """One float64 uniform in [0, 1) per row, each from the row's own generator. -> [S] on ``device``.

    One tiny CPU draw per generator (a function of the request's seed and step only), then a
    single host-to-device copy of S numbers.
    """
    u = torch.empty(len(generators), dtype=torch.float64)
    for cell, g in zip(u.unbind(), generators, strict=True):
        cell.uniform_(generator=g)  # the value torch.rand((), generator=g, dtype=torch.float64) draws
    return u.to(device)


def warp_scores(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """HF's warper chain (``warpers_for``) applied to every row at once with the row's own values.

    logits: [S, V] (sampled rows); params: one sampled ``SamplingParams`` per row. -> [S, V]
    scores, tokens filtered out at -inf: the same values, bit for bit, as running
    ``warpers_for(p)`` on each row alone (CPU); no row's result depends on another row.
    """
    return _warp(logits, [_knobs(p) for p in params], fast=_fast(logits))


Knobs = tuple[float, int, float]  # temperature, top_k, top_p


def _knobs(p: SamplingParams) -> Knobs:
    """A sampled request's temperature, top_k, top_p; unset ones at the library defaults."""
    if p.temperature is None or p.top_k is None or p.top_p is None:
        p = p.resolved()
    return float(p.temperature), int(p.top_k), float(p.top_p)  # type: ignore[arg-type]


def _fast(logits: torch.Tensor) -> bool:
    return logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64)


def _warp(logits: torch.Tensor, knobs: list[Knobs], fast: bool) -> torch.Tensor:
    """``warp_scores``. ``fast`` (CPU): sorted values from numpy and top-p by counting, HF's own
    sort only for rows whose top-p cut splits a group of tied scores; else HF's algorithm on the
    device (``torch.sort``, softmax, cumsum, scatter) for all rows at once."""
    S, V = logits.shape
    dev = logits.device
    temps = [t for t, _, _ in knobs]
    ks = [k if 0 < k < V else V for _, k, _ in knobs]  # k = V: no top-k (HF: k >= V keeps everything)
    ps = [p for _, _, p in knobs]
    scores = logits
    if any(t != 1.0 for t in temps):  # x / 1.0 == x, so rows at T = 1 may share the division
        scores = logits / torch.tensor(temps, dtype=logits.dtype, device=dev)[:, None]
    top_k, top_p = any(k < V for k in ks), any(p < 1.0 for p in ps)
    if not (top_k or top_p):
        return scores
    if fast:  # values only: the sorted row is unique, so any sort gives HF's; numpy's is ~20x faster
        ordered = torch.from_numpy(np.sort(scores.detach().numpy(), axis=-1))
    else:
        ordered = torch.sort(scores, dim=-1).values
    # Top-k (HF): remove the scores below the k-th largest, ordered[V - k]; ties with it stay. A row
    # without top-k gets its smallest score (k = V): nothing is below it.
    kth = ordered.gather(1, torch.tensor(ks, device=dev)[:, None].neg_().add_(V)) if top_k else None
    below_kth = None if kth is None else torch.nextafter(kth, kth.new_tensor(NEG_INF))  # s >= kth: s > this
    if not top_p:
        return _keep_above(scores, below_kth, fast)
    # Top-p (HF): in ascending order, remove the tokens whose cumulative probability is <= 1 - top_p
    # (compared in the scores' dtype), never the last (largest) one. A row without top-p gets a
    # threshold below every cumulative probability.
    thr = torch.tensor([1.0 - p if p < 1.0 else -1.0 for p in ps], dtype=scores.dtype, device=dev)[:, None]
    if top_k:
        ordered = _keep_above(ordered, below_kth, fast)  # still sorted: a prefix went to -inf
    if not fast:
        masked = scores if kth is None else scores.masked_fill(scores < kth, NEG_INF)
        return masked.masked_fill(_top_p_remove(masked, thr), NEG_INF)
    # HF's cumulative probabilities exactly (softmax and cumsum of the same sorted, top-k filtered
    # row), then only the count m of removed tokens: they are the m smallest. The cut is a
    # threshold, unless it ends inside a group of tied scores: which of those go is the order of
    # HF's sort, so such rows take HF's path.
    cum = torch.softmax(ordered, dim=-1).cumsum(dim=-1)
    m = torch.searchsorted(cum, thr, right=True).clamp_(max=V - 1)  # count of cum <= thr, [S, 1]
    last = ordered.gather(1, (m - 1).clamp_(min=0)).masked_fill_(m == 0, NEG_INF)  # largest removed
    split = (m < torch.searchsorted(ordered, last, right=True)) & (m > 0)  # part of its tie group stays
    cut = last if below_kth is None else torch.maximum(last, below_kth)
    out = _keep_above(scores, cut, fast)  # s > last (and s >= kth)
    rows = split.flatten().nonzero().flatten().tolist()  # CPU only: no device sync here
    if rows:
        idx = torch.tensor(rows)
        masked = scores[idx] if kth is None else scores[idx].masked_fill(scores[idx] < kth[idx], NEG_INF)
        out[idx] = masked.masked_fill(_top_p_remove(masked, thr[idx]), NEG_INF)
    return out


def _keep_above(scores: torch.Tensor, cut: torch.Tensor, fast: bool) -> torch.Tensor:
    """``scores`` where > the row's ``cut`` [S, 1], else -inf. ``fast`` (CPU) with long rows: one
    ``threshold`` per row (same values; 2-8x faster there than ``where`` with a bool mask)."""
    if not (fast and scores.shape[-1] >= 2048):
        return torch.where(scores > cut, scores, NEG_INF)
    out = scores.clone()
    for row, c in zip(out, cut.flatten().tolist(), strict=True):  # CPU: the cuts are already here
        torch.nn.functional.threshold(row, c, NEG_INF, inplace=True)
    return out


def _top_p_remove(scores: torch.Tensor, thr: torch.Tensor) -> torch.Tensor:
    """HF's ``TopPLogitsWarper`` mask for many rows in one call: thr [S, 1] = 1 - top_p per row."""
    ordered, order = torch.sort(scores, descending=False)
    remove = torch.softmax(ordered, dim=-1).cumsum(dim=-1) <= thr
    remove[:, -1] = False  # min_tokens_to_keep=1
    return remove.scatter(1, order, remove)


def draw_tokens(scores: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Draw one token per row from processed scores [S, V] with the row's uniform u [S]. -> [S] long.

    Per row: a float64 softmax and CDF in vocabulary order, then the first token whose CDF exceeds
    ``u * total``. That token has positive probability: the CDF rises there, and ``u * total <
    total`` for every u in [0, 1) and a total near 1 (rounding to nearest never reaches the total),
    so the walk back over zero-probability tokens the row-by-row sampler had never ran.
    """
    probs = torch.softmax(scores.double(), dim=-1)  # float64 CDF: no drift at the tail
    cdf = torch.cumsum(probs, dim=-1)
    x = u.to(device=cdf.device, dtype=torch.float64)[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, x, right=True).clamp_(max=scores.shape[-1] - 1).squeeze(-1)


def sample_row(scores: torch.Tensor, generator: torch.Generator) -> int:
    """Draw one token id from processed scores ``[V]`` with one uniform from ``generator``."""
    return int(draw_tokens(scores[None], draw_uniforms([generator], scores.device))[0])


# On the CPU, rows go through warp and draw in chunks of about this many logits: the intermediate
# tensors stay in cache (each row's result is the same in any chunk).
CPU_CHUNK_ELEMENTS = 1 << 18


def select_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    input_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Next token per row. logits: [B, V] float32 -> [B] long, on the logits' device.

    Greedy rows take the argmax; the sampled rows are warped and drawn together (``warp_scores``,
    ``draw_tokens``), each with one uniform from its own generator, drawn in row order. The logits
    never leave their device. ``input_ids`` is accepted for the HF processor signature and unused.
    """
    rows = [i for i, p in enumerate(params) if p.do_sample]  # None (unset) is greedy
    if not rows:
        return torch.argmax(logits, dim=-1)  # greedy rows: exactly HF's argmax
    gens = [generators[i] for i in rows]
    assert all(g is not None for g in gens), "sampled request without a generator"
    u = draw_uniforms(gens, logits.device)  # type: ignore[arg-type]
    index = None if len(rows) == logits.shape[0] else torch.tensor(rows, device=logits.device)
    sub = logits if index is None else logits.index_select(0, index)
    knobs = [_knobs(params[i]) for i in rows]
    tokens = _fast_rows(sub, knobs, u)
    if tokens is None:
        tokens = _chunked(sub, knobs, u)
    return tokens if index is None else torch.argmax(logits, dim=-1).index_copy_(0, index, tokens)


def _chunked(logits: torch.Tensor, knobs: list[Knobs], u: torch.Tensor) -> torch.Tensor:
    """Tokens [S] for sampled rows through ``_select_chunk``: on the CPU in chunks of about
    ``CPU_CHUNK_ELEMENTS`` logits (each row's result is the same in any chunk)."""
    S, V = logits.shape
    fast = _fast(logits)
    step = max(1, CPU_CHUNK_ELEMENTS // V) if logits.device.type == "cpu" else S
    parts = [
        _select_chunk(logits[a : a + step], knobs[a : a + step], u[a : a + step], fast)
        for a in range(0, S, step)
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


# From this vocabulary on, CPU top-p rows take ``_nucleus_draw``; below it its extra calls cost more
# than the warped scores and second softmax they save (at 72: 0.21 against 0.18 ms for 64 rows).
NUCLEUS_MIN_VOCAB = 1024


def _select_chunk(logits: torch.Tensor, knobs: list[Knobs], u: torch.Tensor, fast: bool) -> torch.Tensor:
    """Tokens [S] for sampled rows: on the CPU (``fast``), from ``NUCLEUS_MIN_VOCAB`` on, the rows
    with top-p take ``_nucleus_draw``; the others (and every row elsewhere) HF's warped scores and
    ``draw_tokens``. Which way a row goes depends on its own knobs, the vocabulary and the device,
    never on its neighbours."""
    on = fast and logits.shape[1] >= NUCLEUS_MIN_VOCAB  # the same for every row of a batch
    nucleus = [i for i, (_, _, p) in enumerate(knobs) if p < 1.0] if on else []
    if len(nucleus) == len(knobs):
        return _nucleus_draw(logits, knobs, u)
    if not nucleus:
        return draw_tokens(_warp(logits, knobs, fast), u)
    out = torch.empty(len(knobs), dtype=torch.long)
    idx = torch.tensor(nucleus)
    out[idx] = _nucleus_draw(logits[idx], [knobs[i] for i in nucleus], u[idx])
    rest = [i for i, (_, _, p) in enumerate(knobs) if p >= 1.0]
    idx = torch.tensor(rest)
    out[idx] = draw_tokens(_warp(logits[idx], [knobs[i] for i in rest], fast), u[idx])
    return out


class Cut(NamedTuple):
    """HF's top-p cut of sorted rows (``_nucleus_cut``); all [S, V] or [S, 1], on the CPU."""

    scores: torch.Tensor  # [S, V] the rows after the temperature, vocabulary order
    ordered: torch.Tensor  # [S, V] ascending; top-k's removed scores at -inf
    cdf: torch.Tensor  # [S, V] float64 running sum of softmax(ordered): HF's cum before rounding
    removed: torch.Tensor  # [S, 1] m: HF removes the m smallest; keeps the rest (at least one)
    split: torch.Tensor  # [S, 1] bool: the cut ends inside a group of tied scores
    kth: torch.Tensor | None  # [S, 1] top-k's k-th largest score (None: no row has top-k)
    thr: torch.Tensor  # [S, 1] 1 - top_p in the scores' dtype


def _nucleus_cut(logits: torch.Tensor, knobs: list[Knobs]) -> Cut:
    """HF's kept set for top-p rows from one sort of each row's values (CPU, float32/64).

    The cumulative probabilities are HF's exactly, as in ``_warp`` (softmax of the sorted, top-k
    filtered row), kept as the float64 running sum that torch's float32 ``cumsum`` rounds.
    HF keeps every score above ``ordered[m - 1]``, unless ``split``: then which of the tied
    scores stay is the order of HF's sort.
    """
    S, V = logits.shape
    temps = [t for t, _, _ in knobs]
    ks = [k if 0 < k < V else V for _, k, _ in knobs]
    scores = logits
    if any(t != 1.0 for t in temps):  # the same division as _warp (HF's, bit for bit)
        scores = logits / torch.tensor(temps, dtype=logits.dtype)[:, None]
    ordered = torch.from_numpy(np.sort(scores.detach().numpy(), axis=-1))  # [S, V] ascending
    kth = None
    if any(k < V for k in ks):  # HF: remove the scores below the k-th largest (ties with it stay)
        kth = ordered.gather(1, torch.tensor(ks)[:, None].neg_().add_(V))
        ordered = _keep_above(ordered, torch.nextafter(kth, kth.new_tensor(NEG_INF)), True)
    cdf = torch.softmax(ordered, dim=-1).cumsum(dim=-1, dtype=torch.float64)  # [S, V] float64
    thr = torch.tensor([1.0 - p for _, _, p in knobs], dtype=scores.dtype)[:, None]
    m = torch.searchsorted(cdf, _rounds_to_at_most(thr), right=True).clamp_(max=V - 1)  # [S, 1]
    last = ordered.gather(1, (m - 1).clamp(min=0)).masked_fill_(m == 0, NEG_INF)  # largest removed
    split = (m < torch.searchsorted(ordered, last, right=True)) & (m > 0)
    return Cut(scores, ordered, cdf, m, split, kth, thr)


def _nucleus_draw(logits: torch.Tensor, knobs: list[Knobs], u: torch.Tensor) -> torch.Tensor:
    """Top-p rows on the CPU: one token per row from HF's kept set (``_nucleus_cut``). -> [S].

    The draw walks the kept sorted suffix: the first position whose float64 CDF exceeds
    ``removed + u * (kept mass)`` (so it has positive probability), then the token of that value
    in vocabulary order; for the r-th position of a tie group, the r-th token of that value (tied
    tokens have the same mass). No warped [S, V] scores, no second softmax, no CDF in vocabulary
    order. A ``split`` row takes HF's mask and ``draw_tokens``.
    """
    c = _nucleus_cut(logits, knobs)
    V = logits.shape[1]
    m = c.removed
    removed = c.cdf.gather(1, (m - 1).clamp(min=0)).masked_fill_(m == 0, 0.0)
    x = removed + u.to(torch.float64)[:, None] * (c.cdf[:, -1:] - removed)
    pos = torch.searchsorted(c.cdf, x, right=True).clamp_(max=V - 1)  # >= m: cdf[m - 1] <= x
    value = c.ordered.gather(1, pos)  # [S, 1]
    rank = (pos - torch.searchsorted(c.ordered, value)).flatten()  # place in its tie group
    equal = c.scores.detach().numpy() == value.numpy()  # [S, V] (numpy's compare: ~10x torch's)
    tokens = torch.from_numpy(np.argmax(equal, axis=-1))  # the first token of that value
    for row in rank.nonzero().flatten().tolist():  # tied values: the rank-th one of them
        tokens[row] = int(np.flatnonzero(equal[row])[int(rank[row])])
    for row in c.split.flatten().nonzero().flatten().tolist():
        masked = c.scores[row : row + 1]
        if c.kth is not None:
            masked = masked.masked_fill(masked < c.kth[row], NEG_INF)
        masked = masked.masked_fill(_top_p_remove(masked, c.thr[row : row + 1]), NEG_INF)
        tokens[row] = draw_tokens(masked, u[row : row + 1])[0]
    return tokens


def _rounds_to_at_most(thr: torch.Tensor) -> torch.Tensor:
    """The largest float64 x per row [S, 1] with ``x.to(thr.dtype) <= thr``: HF's test
    ``cum <= thr`` on a float32 cum that is a float64 running sum rounded to nearest, made on the
    float64 sum itself (no [S, V] conversion). Above the midpoint to the next float32 it rounds up;
    at the midpoint, to the even one."""
    if thr.dtype == torch.float64:
        return thr
    up = torch.nextafter(thr, thr.new_tensor(float("inf")))
    mid = (thr.double() + up.double()) / 2  # exact: two adjacent float32 in float64
    odd = (thr.view(torch.int32) & 1).bool()  # the midpoint rounds to ``up``: stay below it
    return torch.where(odd, torch.nextafter(mid, mid.new_tensor(NEG_INF)), mid)


def logprob_temperature(params: SamplingParams) -> float:
    """The temperature a request's logprobs are taken at: its own (``softmax(logits / T)``, what
    RL trainers recompute on the training side), or 1 with ``raw_logprobs`` or a non-positive T."""
    t = float(params.temperature) if params.temperature is not None else 1.0
    return 1.0 if params.raw_logprobs or t <= 0.0 else t


def chosen_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams] | None = None
) -> torch.Tensor:
    """log p(token) under ``softmax(logits / T)`` per row, never truncated by top-k / top-p.

    logits: [B, V] float32; tokens: [B]; ``params`` gives each row's T (see
    ``logprob_temperature``; None: T = 1). -> [B] float32.
    """
    scaled = logits.float()
    if params is not None:
        temps = [logprob_temperature(p) for p in params]
        if any(t != 1.0 for t in temps):
            scaled = scaled / torch.tensor(temps, dtype=scaled.dtype, device=scaled.device)[:, None]
    return torch.log_softmax(scaled, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)


# CPU top-p rows without top-k, from FAST_MIN_VOCAB on, first try ``_binned_draw``: the token
# ``_nucleus_draw`` gives, found without sorting the row (a sort of 32,000 values costs 15-300x an
# elementwise pass over them, by CPU). Each row's probability mass goes into BINS bins of its score
# range (one scatter), which name the two places that matter: the bin where HF's cumulative
# probability crosses 1 - top_p, and the bin where the draw lands. Only those bins' tokens are
# sorted. Below FAST_MIN_VOCAB one sort of the row costs less than these passes.
FAST_MIN_VOCAB = 8192
BINS = 4096
# The bins' probabilities come from a softmax of the unsorted row; HF's cut compares the running
# sum of the softmax of the sorted row, whose normaliser sums in another order: the two running
# sums differ by a factor that grows with the vocabulary (measured over 512 rows per size: up to
# 8.2e-11 x V, relative; 2.2e-6 at 32,000, 1.0e-5 at 152,064). A row whose cut lies within
# CUT_MARGIN x V x (1 - top_p) of a token's cumulative probability takes ``_nucleus_draw``. The
# draw compares sums of the same probabilities on both sides (x and the CDF scale alike with the
# normaliser), so only their last-bit rounding is left: DRAW_MARGIN, relative to the row's mass.
CUT_MARGIN = 3e-10  # per token of the vocabulary, relative to 1 - top_p
DRAW_MARGIN = 1e-7
# Rows go through in chunks of about this many logits, in scratch buffers of that size kept per
# thread (20 bytes an element: 40 MiB for a thread that samples at 2^21): a fresh [S, V] tensor
# costs more in page faults than the pass that fills it.
FAST_CHUNK_ELEMENTS = 1 << 21
_scratch = threading.local()


def _buffers(n: int) -> tuple[torch.Tensor, ...]:
    """This thread's scratch of at least ``n`` elements: float32, float64, int64 (flat; 20 bytes
    an element, at most FAST_CHUNK_ELEMENTS of them)."""
    have = getattr(_scratch, "bufs", None)
    if have is None or have[0].numel() < n:
        _scratch.bufs = None  # the old ones go before the new ones come
        have = (torch.empty(n), torch.empty(n, dtype=torch.float64), torch.empty(n, dtype=torch.long))
        _scratch.bufs = have
    return have


def _fast_rows(logits: torch.Tensor, knobs: list[Knobs], u: torch.Tensor) -> torch.Tensor | None:
    """Tokens [S] with the CPU's top-p rows (no top-k) first through ``_binned_draw``, in chunks of
    ``FAST_CHUNK_ELEMENTS``; the rows it cannot settle, and the others, through ``_chunked``. None
    where no row can take it (another device or dtype, a small vocabulary, no such row). A row's
    token is ``_chunked``'s either way."""
    S, V = logits.shape
    if not (logits.device.type == "cpu" and logits.dtype == torch.float32 and V >= FAST_MIN_VOCAB):
        return None
    rows = [i for i, (_, k, p) in enumerate(knobs) if p < 1.0 and not 0 < k < V]
    if not rows:
        return None
    tokens = torch.empty(S, dtype=torch.long)
    done = torch.zeros(S, dtype=torch.bool)
    step = max(1, FAST_CHUNK_ELEMENTS // V)
    for a in range(0, len(rows), step):
        idx = torch.tensor(rows[a : a + step])
        part = logits if len(idx) == S else logits.index_select(0, idx)
        drawn, ok = _binned_draw(part, [knobs[i] for i in idx.tolist()], u[idx])
        tokens[idx[ok]] = drawn[ok]
        done[idx[ok]] = True
    if not bool(done.all()):
        left = (~done).nonzero().flatten()
        tokens[left] = _chunked(logits.index_select(0, left), [knobs[i] for i in left.tolist()], u[left])
    return tokens


@functools.lru_cache(maxsize=256)
def _float32_threshold(top_p: float) -> float:
    """``_rounds_to_at_most`` of HF's float32 1 - top_p (a few tensor ops: once per value)."""
    return float(_rounds_to_at_most(torch.tensor([1.0 - top_p], dtype=torch.float32))[0])


def _binned_draw(
    logits: torch.Tensor, knobs: list[Knobs], u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-p rows (no top-k) on the CPU, float32: ``_nucleus_draw``'s token without a sort of the
    row. -> (tokens [S], ok [S] bool); a row not ``ok`` must take ``_nucleus_draw``.

    Scores are HF's (the same division by the temperature), probabilities one float32 softmax of
    the row. A token's bin is ``floor((s - min) * (BINS - 1) / (max - min))``: monotone in its
    score, so a bin holds a range of the sorted row and its mass is the sorted running sum's step
    over that range (one float64 scatter; the bins' running sum names the cut's bin and the
    draw's). Not ok: a row with no spread or non-finite scores, a draw within the margin above of
    a token's cumulative probability, a cut within it of two tokens' or of one whose two cuts draw
    different tokens, a cut inside tied scores (HF's sort decides).
    """
    S, V = logits.shape
    n = S * V
    f32, f64, i64 = _buffers(n)
    b_s, b_d, b_i = f32[:n].view(S, V), f64[:n].view(S, V), i64[:n].view(S, V)
    b_p = i64.view(torch.float32)[:n].view(S, V)  # the float32 probabilities, until the bins come
    temps = [t for t, _, _ in knobs]
    scaled = any(t != 1.0 for t in temps)
    scores = logits.detach()
    if scaled:  # HF's division, as in _nucleus_cut (x / 1.0 == x)
        scores = torch.div(scores, torch.tensor(temps, dtype=logits.dtype)[:, None], out=b_s)
    probs = torch.ops.aten._softmax.out(scores, -1, False, out=b_p)
    pd = b_d.copy_(probs)
    bot = scores.amin(-1, keepdim=True)  # amin and amax: a quarter of aminmax's time on the CPU
    span = scores.amax(-1, keepdim=True) - bot
    good = (span > 0) & torch.isfinite(span)
    scale = torch.where(good, (BINS - 1) / span, torch.zeros_like(span))
    # Bin 0 holds the smallest scores. (s - min) * scale <= BINS - 1 up to rounding: BINS + 1 bins.
    f = torch.sub(scores, bot, out=b_s).mul_(scale)  # in place of the scores
    if not bool(good.all()):  # -inf or nan in a row: some bin for each, the row not ok anyway
        f.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    idx = b_i.copy_(f)  # over the float32 probabilities: pd holds them
    hist = torch.zeros(S, BINS + 1, dtype=torch.float64).scatter_add_(1, idx, pd)
    cum_t = hist.cumsum_(1)  # [S, BINS + 1] the ascending running sum at the end of each bin
    cum_b = cum_t.numpy()
    ar_s = np.arange(S)

    def bin_of(y: np.ndarray) -> np.ndarray:
        """Per row, the bin where the ascending running sum passes y [S, k]: the first one whose
        running sum exceeds y (the last bin if none does)."""
        return torch.searchsorted(cum_t, torch.from_numpy(y), right=True).clamp_(max=BINS).numpy()

    def below(r: np.ndarray, b: np.ndarray) -> np.ndarray:
        """The mass of the bins below bin b of row r."""
        return np.where(b > 0, cum_b[r, b - 1], 0.0)

    total_n = cum_b[:, -1]
    thr_n = np.array([_float32_threshold(p) for _, _, p in knobs])
    near = CUT_MARGIN * V * thr_n + 1e-12  # HF's running sum lies within this of ours near thr
    cb = bin_of(thr_n[:, None])[:, 0]  # the cut bin
    # The removed mass lies in [below the cut bin, thr + near], so the draw's x in a range of one or
    # two bins.
    below_cut = below(ar_s, cb)
    uu = u.numpy().astype(np.float64)
    most = thr_n + near
    x_lohi = np.stack([below_cut + uu * (total_n - below_cut), most + uu * (total_n - most)], axis=1)
    draw_lo, draw_hi = bin_of(x_lohi).T
    ar_b = np.arange(BINS + 1)
    want = (ar_b >= draw_lo[:, None]) & (ar_b <= draw_hi[:, None])
    want[ar_s, cb] = True
    hit = np.flatnonzero(torch.from_numpy(want).gather(1, idx).numpy())  # row-major: ascending columns
    r, c = np.divmod(hit, V)
    vals = logits.detach().reshape(-1).numpy()[hit]
    if scaled:  # the same division as the row's (float32, correctly rounded)
        vals = vals / np.array(temps, dtype=np.float32)[r]
    order = np.lexsort((vals, r))  # by row, then score ascending; tied scores in vocabulary order
    hit, r, c, vals = hit[order], r[order], c[order], vals[order]
    bins = idx.numpy().reshape(-1)[hit]
    p = pd.numpy().reshape(-1)[hit]
    # Running sum within each (row, bin) run, on top of the mass below the bin.
    cs = np.cumsum(p)
    new = np.ones(len(r), dtype=bool)
    new[1:] = (r[1:] != r[:-1]) | (bins[1:] != bins[:-1])
    starts = np.flatnonzero(new)
    base = np.repeat(cs[starts] - p[starts], np.diff(np.append(starts, len(r))))
    cum = below(r, bins) + (cs - base)
    ok = good.flatten().numpy().copy()

    def run(in_bin: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per row: where its run of candidates in the chosen bin starts (-1: none), and its length."""
        at = np.flatnonzero(in_bin)
        start = np.full(S, -1)
        rows_at, first = np.unique(r[at], return_index=True)
        start[rows_at] = at[first]
        return start, np.bincount(r[at], minlength=S)

    def take(a: np.ndarray, i: np.ndarray, fill: float) -> np.ndarray:
        return np.where(
            (i >= 0) & (i < len(a)), a[np.clip(i, 0, max(len(a) - 1, 0))] if len(a) else fill, fill
        )

    # The cut: HF removes the tokens whose running sum is <= thr (the m smallest). Ours counts m0;
    # a token within ``near`` of thr may go either way, so HF's m is m0 or its neighbour ``alt``
    # (one token more or fewer), if every token outside [lo, hi) is clear of thr. The draw must then
    # give the same token for both.
    in_cut = bins == cb[r]
    start, count = run(in_cut)
    m0 = np.bincount(r[in_cut & (cum <= thr_n[r])], minlength=S)
    ok &= start >= 0

    def removed_by(m: np.ndarray) -> np.ndarray:
        """The mass of the m smallest tokens of the cut bin and all below it."""
        return np.where(m > 0, take(cum, start + m - 1, 0.0), below_cut)

    def tie_at(m: np.ndarray) -> np.ndarray:
        """The m-th and (m+1)-th smallest of the cut bin have the same score: HF's sort decides."""
        return (m > 0) & (take(vals, start + m - 1, np.nan) == take(vals, start + m, np.nan))

    removed = removed_by(m0)
    alt = m0 + (take(cum, start + m0, np.inf) - thr_n <= near) - (thr_n - removed <= near)
    lo, hi = np.minimum(m0, alt), np.maximum(m0, alt)
    ok &= (lo >= 0) & (hi < count)  # the first token HF may keep is in this bin
    ok &= (thr_n - removed_by(lo) > near) & (take(cum, start + hi, np.inf) - thr_n > near)
    ok &= ~tie_at(m0) & ~tie_at(alt)

    def draw(removed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The first token in ascending order whose running sum exceeds x (as _nucleus_draw), and
        whether it is clear of the draw margin."""
        x = removed + uu * (total_n - removed)
        db = bin_of(x[:, None])[:, 0]
        fine = (db >= draw_lo) & (db <= draw_hi)
        in_draw = bins == db[r]
        start, count = run(in_draw)
        j = np.bincount(r[in_draw & (cum <= x[r])], minlength=S)
        fine &= (start >= 0) & (j < count)
        pos = start + j
        prev = np.where(j > 0, take(cum, pos - 1, 0.0), below(ar_s, db))
        margin = DRAW_MARGIN * total_n
        fine &= (take(cum, pos, np.inf) - x > margin) & (x - prev > margin)
        return take(c, pos, 0), fine

    token, fine = draw(removed)
    ok &= fine
    if bool((ok & (alt != m0)).any()):
        other, fine = draw(removed_by(alt))
        ok &= fine & (other == token)
    tokens = torch.from_numpy(np.where(ok, token, 0).astype(np.int64))
    return tokens, torch.from_numpy(ok)
