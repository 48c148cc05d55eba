"""Top-p draws on the CPU that need no warped scores: the token HF's kept set gives for the
row's uniform, from one sort of the row (``nucleus_draw``) or, at large vocabularies, from a
histogram of its probability mass that sorts only two bins (``binned_draw``, which hands a row
whose cut or draw lies too near a boundary back to ``nucleus_draw``).

Both give the token ``draw_tokens`` (``warpers.py``) would draw from HF's warped scores for the
same uniform, and a row's token depends on that row alone. ``sampling.py`` decides which rows
come here.
"""

from __future__ import annotations

import functools
import threading
from typing import NamedTuple

import numpy as np
import torch

from shardgen.generation.warpers import NEG_INF, Knobs, draw_tokens, keep_above, top_p_remove


class Cut(NamedTuple):
    """HF's top-p cut of sorted rows (``nucleus_cut``); all [S, V] or [S, 1], on the CPU."""

    scores: torch.Tensor  # [S, V] the rows after the temperature, vocabulary order
    ordered: torch.Tensor  # [S, V] ascending; top-k's removed scores at -inf
    cdf: torch.Tensor  # [S, V] float64 running sum of softmax(ordered): HF's cum before rounding
    removed: torch.Tensor  # [S, 1] m: HF removes the m smallest; keeps the rest (at least one)
    split: torch.Tensor  # [S, 1] bool: the cut ends inside a group of tied scores
    kth: torch.Tensor | None  # [S, 1] top-k's k-th largest score (None: no row has top-k)
    thr: torch.Tensor  # [S, 1] 1 - top_p in the scores' dtype


def nucleus_cut(logits: torch.Tensor, knobs: list[Knobs]) -> Cut:
    """HF's kept set for top-p rows from one sort of each row's values (CPU, float32/64).

    The cumulative probabilities are HF's exactly, as in ``warp`` (softmax of the sorted, top-k
    filtered row), kept as the float64 running sum that torch's float32 ``cumsum`` rounds.
    HF keeps every score above ``ordered[m - 1]``, unless ``split``: then which of the tied
    scores stay is the order of HF's sort.
    """
    S, V = logits.shape
    temps = [t for t, _, _ in knobs]
    ks = [k if 0 < k < V else V for _, k, _ in knobs]
    scores = logits
    if any(t != 1.0 for t in temps):  # the same division as warp (HF's, bit for bit)
        scores = logits / torch.tensor(temps, dtype=logits.dtype)[:, None]
    ordered = torch.from_numpy(np.sort(scores.detach().numpy(), axis=-1))  # [S, V] ascending
    kth = None
    if any(k < V for k in ks):  # HF: remove the scores below the k-th largest (ties with it stay)
        kth = ordered.gather(1, torch.tensor(ks)[:, None].neg_().add_(V))
        ordered = keep_above(ordered, torch.nextafter(kth, kth.new_tensor(NEG_INF)), True)
    cdf = torch.softmax(ordered, dim=-1).cumsum(dim=-1, dtype=torch.float64)  # [S, V] float64
    thr = torch.tensor([1.0 - p for _, _, p in knobs], dtype=scores.dtype)[:, None]
    m = torch.searchsorted(cdf, _rounds_to_at_most(thr), right=True).clamp_(max=V - 1)  # [S, 1]
    last = ordered.gather(1, (m - 1).clamp(min=0)).masked_fill_(m == 0, NEG_INF)  # largest removed
    split = (m < torch.searchsorted(ordered, last, right=True)) & (m > 0)
    return Cut(scores, ordered, cdf, m, split, kth, thr)


def nucleus_draw(logits: torch.Tensor, knobs: list[Knobs], u: torch.Tensor) -> torch.Tensor:
    """Top-p rows on the CPU: one token per row from HF's kept set (``nucleus_cut``). -> [S].

    The draw walks the kept sorted suffix: the first position whose float64 CDF exceeds
    ``removed + u * (kept mass)`` (so it has positive probability), then the token of that value
    in vocabulary order; for the r-th position of a tie group, the r-th token of that value (tied
    tokens have the same mass). No warped [S, V] scores, no second softmax, no CDF in vocabulary
    order. A ``split`` row takes HF's mask and ``draw_tokens``.
    """
    c = nucleus_cut(logits, knobs)
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
        masked = masked.masked_fill(top_p_remove(masked, c.thr[row : row + 1]), NEG_INF)
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


# CPU top-p rows without top-k, from ``sampling.FAST_MIN_VOCAB`` on, first try ``binned_draw``: the
# token ``nucleus_draw`` gives, found without sorting the row (a sort of 32,000 values costs 15-300x
# an elementwise pass over them, by CPU). Each row's probability mass goes into BINS bins of its
# score range (one scatter), which name the two places that matter: the bin where HF's cumulative
# probability crosses 1 - top_p, and the bin where the draw lands. Only those bins' tokens are
# sorted.
BINS = 4096
# The bins' probabilities come from a softmax of the unsorted row; HF's cut compares the running
# sum of the softmax of the sorted row, whose normaliser sums in another order: the two running
# sums differ by a factor that grows with the vocabulary (measured over 512 rows per size: up to
# 8.2e-11 x V, relative; 2.2e-6 at 32,000, 1.0e-5 at 152,064). A row whose cut lies within
# CUT_MARGIN x V x (1 - top_p) of a token's cumulative probability takes ``nucleus_draw``. The
# draw compares sums of the same probabilities on both sides (x and the CDF scale alike with the
# normaliser), so only their last-bit rounding is left: DRAW_MARGIN, relative to the row's mass.
CUT_MARGIN = 3e-10  # per token of the vocabulary, relative to 1 - top_p
DRAW_MARGIN = 1e-7
# Scratch buffers kept per thread, as large as the chunks ``sampling`` hands over (20 bytes an
# element: 40 MiB for a thread that samples at 2^21): a fresh [S, V] tensor costs more in page
# faults than the pass that fills it.
_scratch = threading.local()


def _buffers(n: int) -> tuple[torch.Tensor, ...]:
    """This thread's scratch of at least ``n`` elements: float32, float64, int64 (flat; 20 bytes
    an element, at most ``sampling.FAST_CHUNK_ELEMENTS`` of them)."""
    have = getattr(_scratch, "bufs", None)
    if have is None or have[0].numel() < n:
        _scratch.bufs = None  # the old ones go before the new ones come
        have = (torch.empty(n), torch.empty(n, dtype=torch.float64), torch.empty(n, dtype=torch.long))
        _scratch.bufs = have
    return have


@functools.lru_cache(maxsize=256)
def _float32_threshold(top_p: float) -> float:
    """``_rounds_to_at_most`` of HF's float32 1 - top_p (a few tensor ops: once per value)."""
    return float(_rounds_to_at_most(torch.tensor([1.0 - top_p], dtype=torch.float32))[0])


def binned_draw(
    logits: torch.Tensor, knobs: list[Knobs], u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-p rows (no top-k) on the CPU, float32: ``nucleus_draw``'s token without a sort of the
    row. -> (tokens [S], ok [S] bool); a row not ``ok`` must take ``nucleus_draw``.

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
    if scaled:  # HF's division, as in nucleus_cut (x / 1.0 == x)
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
        """The first token in ascending order whose running sum exceeds x (as nucleus_draw), and
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
