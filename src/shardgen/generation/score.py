"""Scoring (teacher forcing): what ``Engine.score`` takes and returns, checked in the caller's thread.

A score row is a prompt and a response (token ids); its result is, at each response position
``j``, the model's distribution over the next token given the prompt and ``response[:j]``:
``log_softmax(logits / temperature)`` at ``response[j]``, optionally its top-k, the entropy and
the raw logits. No ``torch.distributed``, no model: the driver runs the rows (``score_run.py``);
this module normalises the inputs, reduces one chunk's logits, and packs the rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from shardgen.backends.towers import feature_encoder
from shardgen.generation.requests import encode_prompt, input_problems


@dataclass(frozen=True)
class ScoreParams:
    """The settings of one ``score()`` call (every row of it)."""

    temperature: float = 1.0
    top_k: int = 0
    logits: bool = False
    entropy: bool = True


@dataclass
class ScoreBatch:
    """The scores of one ``score()`` call: R rows, G = the longest response, in the rows' order.

    Zero rows: each field asked for is a tensor of zero rows (``[0, 0]``, ``[0, 0, k]``,
    ``[0, 0, V]``) in its dtype; only the fields not asked for are None, as at any row count."""

    logprobs: torch.Tensor
    """[R, G] float32: log softmax(logits / temperature) at each given response token; 0 past a
    row's length."""
    mask: torch.Tensor
    """[R, G] long: 1 on each row's response positions."""
    entropy: torch.Tensor | None = None
    """[R, G] float32: the entropy of softmax(logits / temperature) at each position (0 past a
    row's length); None with ``entropy=False``."""
    top_ids: torch.Tensor | None = None
    """[R, G, k] long with ``top_k=k > 0``: the k most likely ids (0 past a row's length)."""
    top_logprobs: torch.Tensor | None = None
    """[R, G, k] float32 with ``top_k > 0``: their logprobs, as ``logprobs`` (0 past a row's length)."""
    logits: torch.Tensor | None = None
    """[R, G, V] in the model's dtype, on the CPU, with ``logits=True``: the raw logits (untempered)."""

    def __len__(self) -> int:
        return int(self.logprobs.shape[0])


@dataclass
class RowScore:
    """One row's result, as the driver resolves it: tensors of the row's own length g."""

    logprobs: torch.Tensor  # [g] float32
    entropy: torch.Tensor | None = None  # [g]
    top_ids: torch.Tensor | None = None  # [g, k]
    top_logprobs: torch.Tensor | None = None  # [g, k]
    logits: torch.Tensor | None = None  # [g, V], model dtype, CPU


@dataclass(eq=False)  # identity semantics: requests live in sets
class ScoreRequest:
    """One validated score row travelling from the user thread to the driver."""

    prompt_ids: list[int]
    response_ids: list[int]
    params: ScoreParams
    inputs: dict[str, Any] | None = None
    """The model's own forward inputs for the prompt beside its ids (a VLM's ``pixel_values`` and
    ``image_grid_thw``), as given; None: text only."""
    future: Future = field(default_factory=Future)


def check_params(temperature: float, top_k: int, logits: bool, entropy: bool, vocab: int) -> ScoreParams:
    """The call's settings, checked: ``ValueError`` with the numbers."""
    if not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    if not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0, got {top_k!r}")
    if top_k > vocab:
        raise ValueError(f"top_k={top_k} is more than the vocabulary's {vocab} ids")
    return ScoreParams(float(temperature), top_k, bool(logits), bool(entropy))


def rows_of(
    source: Any,
    responses: Any,
    prompts: Any,
    response_mask: torch.Tensor | None,
    tokenizer: Any,
) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, response ids) per row, from ``score()``'s arguments: a ``RolloutBatch`` (its own
    prompts, or ``prompts`` one per row: a teacher's), or prompts (text or ids) and responses
    (id lists, or a ``[R, G]`` tensor with ``response_mask``)."""
    from shardgen.generation.rollout import RolloutBatch

    if isinstance(source, RolloutBatch):
        if responses is not None:
            raise ValueError("score(batch) takes its responses from the batch: pass no responses")
        p_width, lengths = source.prompt_width, source.response_lengths.tolist()
        resp = [source.response_ids[i, : int(g)].tolist() for i, g in enumerate(lengths)]
        if prompts is None:
            plen = source.prompt_lengths.tolist()
            prompts = [source.input_ids[i, p_width - int(p) : p_width].tolist() for i, p in enumerate(plen)]
    else:
        if source is not None and prompts is not None:
            raise ValueError(
                "pass the prompts once: score(prompts, responses) or score(prompts=..., responses=...)"
            )
        prompts = source if source is not None else prompts
        if prompts is None or responses is None:
            raise ValueError("score() needs prompts and responses (or a RolloutBatch)")
        resp = _responses(responses, response_mask)
    prompts = list(prompts)
    if len(prompts) != len(resp):
        raise ValueError(f"got {len(prompts)} prompts for {len(resp)} responses (one per row)")
    return [_prompt_ids(p, tokenizer, i) for i, p in enumerate(prompts)], resp


def _responses(responses: Any, mask: torch.Tensor | None) -> list[list[int]]:
    if isinstance(responses, torch.Tensor):
        if responses.dim() != 2:
            raise ValueError(f"responses as a tensor must be [R, G], got shape {tuple(responses.shape)}")
        if mask is None:
            return [row.tolist() for row in responses]
        if tuple(mask.shape) != tuple(responses.shape):
            raise ValueError(
                f"response_mask {tuple(mask.shape)} and responses {tuple(responses.shape)} differ"
            )
        out = []
        for i in range(responses.shape[0]):
            g = int(mask[i].sum())
            if bool((mask[i, :g] == 0).any()):
                raise ValueError(f"response_mask row {i} is not ones then zeros (right padding)")
            out.append(responses[i, :g].tolist())
        return out
    if mask is not None:
        raise ValueError("response_mask goes with a responses tensor")
    if len(responses) > 0 and isinstance(responses[0], int):
        raise ValueError("responses is a list of rows (token-id lists), not one row")
    return [[int(t) for t in (r.tolist() if isinstance(r, torch.Tensor) else r)] for r in responses]


def _prompt_ids(prompt: Any, tokenizer: Any, i: int) -> list[int]:
    """Text as ``generate()`` encodes it (``requests.encode_prompt``), or ids."""
    try:
        return encode_prompt(prompt, tokenizer)
    except ValueError as e:
        raise ValueError(f"prompt {i}: {e}") from None


def check_rows(
    prompts: list[list[int]],
    responses: list[list[int]],
    vocab: int,
    context: int | None,
    encoder_decoder: bool = False,
) -> None:
    """Every row scorable: a prompt of at least one token, ids in ``[0, vocab)``, within the context
    (an encoder-decoder's: the prompt within the encoder's, the response within the decoder's,
    whose input is the start token and the response but its last token)."""
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        if not p:
            why = (
                "the encoder needs a token"
                if encoder_decoder
                else "the first response token needs a position before it"
            )
            raise ValueError(f"row {i}: the prompt is empty ({why})")
        for what, ids in (("prompt", p), ("response", r)):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"row {i}: {what} id {bad[0]} is outside the vocabulary [0, {vocab})")
        if encoder_decoder:
            if context is not None and len(p) > context:
                raise ValueError(
                    f"row {i}: a prompt of {len(p)} tokens exceeds the encoder's context of {context}"
                )
            if context is not None and len(r) > context:
                raise ValueError(
                    f"row {i}: {len(r)} response tokens exceed the decoder's context of {context}"
                )
        elif context is not None and len(p) + len(r) > context:
            raise ValueError(
                f"row {i}: {len(p)} prompt + {len(r)} response tokens exceed the context length {context}"
            )


def check_inputs(prompts: list[list[int]], inputs: Any, model_config: Any) -> list[dict[str, Any] | None]:
    """``score(..., inputs=)``: one dict (or None) per row, each fitting its prompt as
    ``generate()``'s do (``requests.input_problems``: image tokens against the grid, patches
    against the grid, tensors). ``ValueError`` with the numbers."""
    if inputs is None and not feature_encoder(model_config):
        return [None] * len(prompts)
    if inputs is None:  # every row needs its features: each says so
        inputs = [None] * len(prompts)
    if not isinstance(inputs, (list, tuple)) or len(inputs) != len(prompts):
        n = len(inputs) if isinstance(inputs, (list, tuple)) else type(inputs).__name__
        raise ValueError(
            f"inputs must be a list of one dict (or None) per row: got {n} for {len(prompts)} rows"
        )
    out: list[dict[str, Any] | None] = []
    for i, (p, x) in enumerate(zip(prompts, inputs, strict=True)):
        problems = input_problems(p, x, model_config)
        if problems:
            raise ValueError(f"row {i}: " + "; ".join(problems))
        out.append(x or None)
    return out


def reduce(logits: torch.Tensor, tokens: torch.Tensor, params: ScoreParams) -> dict[str, torch.Tensor]:
    """One chunk's ``[N, V]`` logits and the ``[N]`` tokens they predict -> what the rows keep, at
    once (the chunk's float32 copy goes with the call): ``logprobs`` [N], and per ``params``
    ``entropy`` [N], ``top_ids`` / ``top_logprobs`` [N, k], ``logits`` [N, V] (model dtype, CPU)."""
    out: dict[str, torch.Tensor] = {}
    if params.logits:
        out["logits"] = logits.to("cpu", copy=True)
    lf = logits.to(dtype=torch.float32)
    if params.temperature != 1.0:
        lf = lf / params.temperature
    logp = torch.log_softmax(lf, dim=-1)
    del lf
    out["logprobs"] = logp.gather(-1, tokens[:, None].to(logp.device)).squeeze(-1).cpu()
    if params.entropy:
        out["entropy"] = -(logp.exp() * logp).nan_to_num().sum(-1).cpu()  # 0 log 0 = 0
    if params.top_k:
        top = logp.topk(params.top_k, dim=-1)
        out["top_logprobs"], out["top_ids"] = top.values.cpu(), top.indices.cpu()
    return out


def pack(results: list[RowScore], params: ScoreParams, vocab: int, dtype: torch.dtype) -> ScoreBatch:
    """Rows -> a ``ScoreBatch`` right-padded with zeros to the longest response."""
    rows = len(results)
    g = max((int(r.logprobs.shape[0]) for r in results), default=0)
    lps = torch.zeros((rows, g), dtype=torch.float32)
    mask = torch.zeros((rows, g), dtype=torch.long)
    ent = torch.zeros((rows, g), dtype=torch.float32) if params.entropy else None
    k = params.top_k
    top_ids = torch.zeros((rows, g, k), dtype=torch.long) if k else None
    top_lps = torch.zeros((rows, g, k), dtype=torch.float32) if k else None
    full = torch.zeros((rows, g, vocab), dtype=dtype) if params.logits else None
    for i, r in enumerate(results):
        n = int(r.logprobs.shape[0])
        lps[i, :n], mask[i, :n] = r.logprobs, 1
        if ent is not None and r.entropy is not None:
            ent[i, :n] = r.entropy
        if (
            top_ids is not None
            and top_lps is not None
            and r.top_ids is not None
            and r.top_logprobs is not None
        ):
            top_ids[i, :n], top_lps[i, :n] = r.top_ids, r.top_logprobs
        if full is not None and r.logits is not None:
            full[i, :n] = r.logits
    return ScoreBatch(lps, mask, ent, top_ids, top_lps, full)


def requests_of(
    prompts: Sequence[list[int]],
    responses: Sequence[list[int]],
    params: ScoreParams,
    inputs: Sequence[dict[str, Any] | None] | None = None,
) -> list[ScoreRequest]:
    each = list(inputs) if inputs is not None else [None] * len(prompts)
    return [
        ScoreRequest(list(p), list(r), params, x) for p, r, x in zip(prompts, responses, each, strict=True)
    ]
