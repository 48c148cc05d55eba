"""Token selection: greedy, temperature, top-k, top-p, with a generator per request.

Each row of a batch is processed alone with its own parameters and its own
``torch.Generator``, so a request's sampled tokens depend only on its logits and
its seed, never on which rank served it or what else was in the batch. The warpers
are Hugging Face's own (same semantics as ``generate()``); the draw is one uniform
number per step mapped through the CDF, which is stable under the last-bit noise
that batching can add to logits.
"""

from __future__ import annotations

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from shardgen.config import SamplingParams


def make_generator(seed: int) -> torch.Generator:
    """A CPU generator: CPU draws are identical on every device type."""
    g = torch.Generator(device="cpu")
    g.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
    return g


def warpers_for(params: SamplingParams) -> LogitsProcessorList:
    """HF's warpers in HF's order (temperature, top-k, top-p) for a sampled request.

    Unset fields count at their library defaults (requests arrive resolved: ``build_request``).
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


def sample_row(scores: torch.Tensor, generator: torch.Generator) -> int:
    """Draw one token id from processed scores ``[V]`` with one uniform from ``generator``."""
    probs = torch.softmax(scores.double().cpu(), dim=-1)  # float64 CDF: no drift at the tail
    cdf = torch.cumsum(probs, dim=-1)
    u = torch.rand((), generator=generator, dtype=torch.float64) * cdf[-1]
    idx = int(torch.searchsorted(cdf, u, right=True).clamp_(max=probs.numel() - 1))
    while idx > 0 and probs[idx] == 0.0:  # never land on a masked token through rounding
        idx -= 1
    return idx


def select_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    input_ids: torch.Tensor,
) -> torch.Tensor:
    """Next token per row. logits: [B, V] float32; input_ids: [B, T] (for HF processors). -> [B] long."""
    out = torch.argmax(logits, dim=-1)  # greedy rows: exactly HF's argmax
    for i, p in enumerate(params):
        if not p.do_sample:  # None (unset) is greedy
            continue
        g = generators[i]
        assert g is not None, "sampled request without a generator"
        scores = warpers_for(p)(input_ids[i : i + 1], logits[i : i + 1])
        out[i] = sample_row(scores[0], g)
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
