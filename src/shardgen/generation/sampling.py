"""Token selection: greedy, temperature, top-k, top-p, with a generator per request.

All sampled rows of a batch are processed at once, on the logits' device, each with its own
parameters; no reduction mixes rows. The warpers are Hugging Face's semantics (``warpers_for``
builds HF's own chain; ``warp_scores`` gives the same scores, bit for bit on the CPU). The draw
is one uniform number per row per step, from that row's own CPU ``torch.Generator``, mapped
through a float64 CDF: a request's tokens depend only on its logits and its seed, never on
which rank served it or what else was in the batch, and the draw is stable under the last-bit
noise that batching can add to logits. On the CPU, top-p rows draw from HF's kept set in
sorted order (``nucleus_draw``: the one sort that finds the cut also orders the CDF, so no
warped scores or second softmax); at large vocabularies rows without top-k first try
``binned_draw``, which finds the same token from a histogram of the row's probability mass and
sorts only two bins, and hands a row whose cut or draw lies too near a boundary to
``nucleus_draw``; other rows, and every row on other devices, draw through the CDF in
vocabulary order (``draw_tokens``). Which way a row goes depends on its own knobs and
device only. On the CPU a row's result is bitwise the same alone or in any batch
(tests/unit/test_sampling.py). On CUDA, ``cumsum`` picks its thread layout from the number of rows
(and a single row takes another kernel), so cumulative sums may differ in the last bit between
batch shapes; that moves a token only when the row's uniform or top-p threshold lies within
that rounding of a boundary, as last-bit noise in the logits would.
"""

from __future__ import annotations

import torch

from shardgen.config import SamplingParams
from shardgen.generation.nucleus import binned_draw, nucleus_draw
from shardgen.generation.warpers import (
    Knobs,
    draw_tokens,
    fast_path,
    knobs_of,
    warp,
    warp_scores,
    warpers_for,
)

# warpers_for, warp_scores and draw_tokens: public here too (their home is warpers.py)
__all__ = [
    "chosen_logprobs",
    "draw_tokens",
    "draw_uniforms",
    "logprob_temperature",
    "make_generator",
    "sample_row",
    "select_tokens",
    "warp_scores",
    "warpers_for",
]


def make_generator(seed: int) -> torch.Generator:
    """A CPU generator: CPU draws are identical on every device type."""
    g = torch.Generator(device="cpu")
    g.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
    return g


def draw_uniforms(generators: list[torch.Generator], device: torch.device | str = "cpu") -> torch.Tensor:
    """One float64 uniform in [0, 1) per row, each from the row's own generator. -> [S] on ``device``.

    One tiny CPU draw per generator (a function of the request's seed and step only), then a
    single host-to-device copy of S numbers.
    """
    u = torch.empty(len(generators), dtype=torch.float64)
    for cell, g in zip(u.unbind(), generators, strict=True):
        cell.uniform_(generator=g)  # the value torch.rand((), generator=g, dtype=torch.float64) draws
    return u.to(device)


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
    knobs = [knobs_of(params[i]) for i in rows]
    tokens = _fast_rows(sub, knobs, u)
    if tokens is None:
        tokens = _chunked(sub, knobs, u)
    return tokens if index is None else torch.argmax(logits, dim=-1).index_copy_(0, index, tokens)


def _chunked(logits: torch.Tensor, knobs: list[Knobs], u: torch.Tensor) -> torch.Tensor:
    """Tokens [S] for sampled rows through ``_select_chunk``: on the CPU in chunks of about
    ``CPU_CHUNK_ELEMENTS`` logits (each row's result is the same in any chunk)."""
    S, V = logits.shape
    fast = fast_path(logits)
    step = max(1, CPU_CHUNK_ELEMENTS // V) if logits.device.type == "cpu" else S
    parts = [
        _select_chunk(logits[a : a + step], knobs[a : a + step], u[a : a + step], fast)
        for a in range(0, S, step)
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


# From this vocabulary on, CPU top-p rows take ``nucleus_draw``; below it its extra calls cost more
# than the warped scores and second softmax they save (at 72: 0.21 against 0.18 ms for 64 rows).
NUCLEUS_MIN_VOCAB = 1024


def _select_chunk(logits: torch.Tensor, knobs: list[Knobs], u: torch.Tensor, fast: bool) -> torch.Tensor:
    """Tokens [S] for sampled rows: on the CPU (``fast``), from ``NUCLEUS_MIN_VOCAB`` on, the rows
    with top-p take ``nucleus_draw``; the others (and every row elsewhere) HF's warped scores and
    ``draw_tokens``. Which way a row goes depends on its own knobs, the vocabulary and the device,
    never on its neighbours."""
    on = fast and logits.shape[1] >= NUCLEUS_MIN_VOCAB  # the same for every row of a batch
    nucleus = [i for i, (_, _, p) in enumerate(knobs) if p < 1.0] if on else []
    if len(nucleus) == len(knobs):
        return nucleus_draw(logits, knobs, u)
    if not nucleus:
        return draw_tokens(warp(logits, knobs, fast), u)
    out = torch.empty(len(knobs), dtype=torch.long)
    idx = torch.tensor(nucleus)
    out[idx] = nucleus_draw(logits[idx], [knobs[i] for i in nucleus], u[idx])
    rest = [i for i, (_, _, p) in enumerate(knobs) if p >= 1.0]
    idx = torch.tensor(rest)
    out[idx] = draw_tokens(warp(logits[idx], [knobs[i] for i in rest], fast), u[idx])
    return out


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


# CPU top-p rows without top-k, from FAST_MIN_VOCAB on, first try ``binned_draw`` (``nucleus.py``):
# the same token without sorting the row. Below FAST_MIN_VOCAB one sort of the row costs less
# than its passes.
FAST_MIN_VOCAB = 8192
# Rows go through it in chunks of about this many logits, in scratch buffers of that size kept
# per thread (``nucleus.py``).
FAST_CHUNK_ELEMENTS = 1 << 21


def _fast_rows(logits: torch.Tensor, knobs: list[Knobs], u: torch.Tensor) -> torch.Tensor | None:
    """Tokens [S] with the CPU's top-p rows (no top-k) first through ``binned_draw``, in chunks of
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
        drawn, ok = binned_draw(part, [knobs[i] for i in idx.tolist()], u[idx])
        tokens[idx[ok]] = drawn[ok]
        done[idx[ok]] = True
    if not bool(done.all()):
        left = (~done).nonzero().flatten()
        tokens[left] = _chunked(logits.index_select(0, left), [knobs[i] for i in left.tolist()], u[left])
    return tokens
