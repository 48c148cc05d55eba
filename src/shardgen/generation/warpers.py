"""Hugging Face's warpers (temperature, top-k, top-p) for many rows at once, and the draw from
warped scores through a float64 CDF in vocabulary order.

``warpers_for`` builds HF's own chain for one request: the reference semantics. ``warp_scores``
applies it to every row at once, each row with its own values, and gives the same scores (bit
for bit on the CPU, where ``fast_path`` sorts with numpy and cuts top-p by counting); no row's
result depends on another row. ``draw_tokens`` maps each row's uniform through the CDF of its
warped scores. ``sampling.py`` chooses, per row, between these and the CPU's top-p draws of
``nucleus.py``.
"""

from __future__ import annotations

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


def warp_scores(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """HF's warper chain (``warpers_for``) applied to every row at once with the row's own values.

    logits: [S, V] (sampled rows); params: one sampled ``SamplingParams`` per row. -> [S, V]
    scores, tokens filtered out at -inf: the same values, bit for bit, as running
    ``warpers_for(p)`` on each row alone (CPU); no row's result depends on another row.
    """
    return warp(logits, [knobs_of(p) for p in params], fast=fast_path(logits))


Knobs = tuple[float, int, float]  # temperature, top_k, top_p


def knobs_of(p: SamplingParams) -> Knobs:
    """A sampled request's temperature, top_k, top_p; unset ones at the library defaults."""
    if p.temperature is None or p.top_k is None or p.top_p is None:
        p = p.resolved()
    return float(p.temperature), int(p.top_k), float(p.top_p)  # type: ignore[arg-type]


def fast_path(logits: torch.Tensor) -> bool:
    return logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64)


def warp(logits: torch.Tensor, knobs: list[Knobs], fast: bool) -> torch.Tensor:
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
        return keep_above(scores, below_kth, fast)
    # Top-p (HF): in ascending order, remove the tokens whose cumulative probability is <= 1 - top_p
    # (compared in the scores' dtype), never the last (largest) one. A row without top-p gets a
    # threshold below every cumulative probability.
    thr = torch.tensor([1.0 - p if p < 1.0 else -1.0 for p in ps], dtype=scores.dtype, device=dev)[:, None]
    if top_k:
        ordered = keep_above(ordered, below_kth, fast)  # still sorted: a prefix went to -inf
    if not fast:
        masked = scores if kth is None else scores.masked_fill(scores < kth, NEG_INF)
        return masked.masked_fill(top_p_remove(masked, thr), NEG_INF)
    # HF's cumulative probabilities exactly (softmax and cumsum of the same sorted, top-k filtered
    # row), then only the count m of removed tokens: they are the m smallest. The cut is a
    # threshold, unless it ends inside a group of tied scores: which of those go is the order of
    # HF's sort, so such rows take HF's path.
    cum = torch.softmax(ordered, dim=-1).cumsum(dim=-1)
    m = torch.searchsorted(cum, thr, right=True).clamp_(max=V - 1)  # count of cum <= thr, [S, 1]
    last = ordered.gather(1, (m - 1).clamp_(min=0)).masked_fill_(m == 0, NEG_INF)  # largest removed
    split = (m < torch.searchsorted(ordered, last, right=True)) & (m > 0)  # part of its tie group stays
    cut = last if below_kth is None else torch.maximum(last, below_kth)
    out = keep_above(scores, cut, fast)  # s > last (and s >= kth)
    rows = split.flatten().nonzero().flatten().tolist()  # CPU only: no device sync here
    if rows:
        idx = torch.tensor(rows)
        masked = scores[idx] if kth is None else scores[idx].masked_fill(scores[idx] < kth[idx], NEG_INF)
        out[idx] = masked.masked_fill(top_p_remove(masked, thr[idx]), NEG_INF)
    return out


def keep_above(scores: torch.Tensor, cut: torch.Tensor, fast: bool) -> torch.Tensor:
    """``scores`` where > the row's ``cut`` [S, 1], else -inf. ``fast`` (CPU) with long rows: one
    ``threshold`` per row (same values; 2-8x faster there than ``where`` with a bool mask)."""
    if not (fast and scores.shape[-1] >= 2048):
        return torch.where(scores > cut, scores, NEG_INF)
    out = scores.clone()
    for row, c in zip(out, cut.flatten().tolist(), strict=True):  # CPU: the cuts are already here
        torch.nn.functional.threshold(row, c, NEG_INF, inplace=True)
    return out


def top_p_remove(scores: torch.Tensor, thr: torch.Tensor) -> torch.Tensor:
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
