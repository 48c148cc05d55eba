"""Requests and results: turning a user's prompt and options into a decoder ``SeqState``.

Validation happens here, in the caller's thread, so a bad request raises
``ValueError`` for that call only and never reaches the driver; so does filling
the fields the user left unset from the model's ``generation_config``.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Sequence as Seq
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

import torch

from shardgen.backends.towers import feature_encoder
from shardgen.config import SamplingParams, context_length
from shardgen.generation.images import image_layout
from shardgen.generation.sampling import make_generator
from shardgen.generation.sequence import SeqState, StopCheck, resolve_special_ids


@dataclass
class Completion:
    """What one request produced."""

    token_ids: list[int]
    """Generated ids, the first EOS included, no padding."""
    finish_reason: str
    """``eos`` (an EOS id was generated), ``stop`` (a stop string appeared; the token completing it
    is the last one) or ``length`` (``max_new_tokens`` reached); ``held``: not finished, cut at
    its ``tokens_per_call`` budget (``engine.resume()`` continues it: ``per_call.py``)."""
    prompt_token_ids: list[int]
    text: str | None = None
    """The generated text (special tokens skipped), when the engine has a tokenizer that decodes;
    else None."""
    logprobs: list[float] | None = None
    """log p of each generated token under ``softmax(logits / temperature)`` (``raw_logprobs``:
    untempered), when asked for."""
    seed: int | None = None
    """The sampling seed used (sampled requests)."""
    rank: int = 0
    """The rank whose driver decoded it."""
    versions: list[int] | None = None
    """The weight version (the engine's pauses before it: ``Engine.version``) each generated token
    was drawn under."""
    handle: Any = field(default=None, compare=False, repr=False)
    """A held row's (``finish_reason == "held"``): what ``engine.resume()`` continues; else None."""


@dataclass(eq=False)  # identity semantics: requests live in sets
class Request:
    """A validated request travelling from the user thread to the driver."""

    seq: SeqState
    future: Future = field(default_factory=Future)


def build_request(
    prompt_ids: Seq[int] | torch.Tensor,
    params: SamplingParams,
    *,
    model_config: Any,
    generation_config: Any,
    tokenizer: Any = None,
    inputs: dict[str, Any] | None = None,
) -> Request:
    """Validate one request and make its ``SeqState``. Raises ``ValueError`` with the numbers,
    naming every setting at fault (``request_problems``) in one message.

    The one validation point: unset fields take the model's ``generation_config``, then the
    library defaults (``SamplingParams.resolved``), and the result is checked.
    """
    params = params.resolved(generation_config)
    ids = [int(t) for t in (prompt_ids.tolist() if isinstance(prompt_ids, torch.Tensor) else prompt_ids)]
    problems = request_problems(ids, params, model_config=model_config, tokenizer=tokenizer)
    problems += input_problems(ids, inputs, model_config)
    if problems:
        raise ValueError("; ".join(problems))
    eos, pad = resolve_special_ids(params, generation_config, tokenizer)
    seed = params.seed
    gen = None
    if params.do_sample:
        if seed is None:
            seed = random.SystemRandom().randrange(2**63)
            params = params.replace(seed=seed)
        gen = make_generator(seed)
    stop_check = stop_string_check(tokenizer, list(params.stop)) if params.stop else None
    bos_f, eos_f = (getattr(generation_config, f"forced_{k}_token_id", None) for k in ("bos", "eos"))
    seq = SeqState(
        prompt_ids=ids, params=params, eos_ids=eos, pad_id=pad, generator=gen, stop_check=stop_check,
        inputs=inputs or None,  # as given: rows given one dict share their prefill
        images=image_layout(ids, inputs, model_config),
        forced_bos=bos_f if isinstance(bos_f, int) else None,
        forced_eos=eos_f if isinstance(eos_f, int) else None,
        start_length=1 if getattr(model_config, "is_encoder_decoder", False) else len(ids),
    )  # fmt: skip
    req = Request(seq=seq)
    seq.tag = req
    return req


def joined_inputs(
    inputs: list[dict[str, Any]], ids: Any, config: Any, token_types: bool, device: Any
) -> dict[str, Any]:
    """One forward's own inputs from its image rows' ``inputs`` (row order): each key's tensors
    concatenated along dim 0 (images in row order), and, for a model whose forward takes them
    (``token_types``), the token types marking ``ids``' image tokens (``config.image_token_id``)."""
    own: dict[str, Any] = {}
    if not inputs:
        return own
    for key in inputs[0]:
        parts = [torch.as_tensor(x[key]) for x in inputs if x.get(key) is not None]
        if parts:
            own[key] = torch.cat(_padded(parts), dim=0).to(device)
    token = getattr(config, "image_token_id", None)
    if token is not None and token_types:
        own["mm_token_type_ids"] = (ids == token).int()
    return own


def _padded(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """``parts`` zero-padded at the end of every dim but the first to the largest, as a processor
    batches images of different patch counts (LLaVA-NeXT's ``[images, patches, C, H, W]``: the
    model reads each image's own patches, ``image_sizes`` says how many); unchanged when they fit."""
    if len({tuple(p.shape[1:]) for p in parts}) <= 1 or len({p.dim() for p in parts}) != 1:
        return parts
    top = [max(int(p.shape[d]) for p in parts) for d in range(1, parts[0].dim())]
    out = []
    for p in parts:
        pad: list[int] = []
        for d in reversed(range(1, p.dim())):
            pad += [0, top[d - 1] - int(p.shape[d])]
        out.append(torch.nn.functional.pad(p, pad))
    return out


def input_problems(ids: list[int], inputs: Any, model_config: Any) -> list[str]:
    """What is wrong with one request's own forward ``inputs`` (``{"pixel_values": ...,
    "image_grid_thw": ...}``): not a dict of tensors, or images whose merged patches do not
    match the prompt's image tokens (the model would fail inside the engine's forward)."""
    if feature_encoder(model_config):
        return feature_problems(inputs, model_config)
    if inputs is None:
        return []
    if getattr(model_config, "is_encoder_decoder", False):
        return ["inputs= is not taken by an encoder-decoder: its prompt ids are the encoder's input"]
    if not isinstance(inputs, dict):
        return [f"inputs must be a dict of the model's forward inputs or None, got {type(inputs).__name__}"]
    bad = [k for k, v in inputs.items() if v is not None and not isinstance(v, torch.Tensor)]
    if bad:
        return [f"inputs {bad} must be tensors"]
    grid = inputs.get("image_grid_thw")
    token = getattr(model_config, "image_token_id", None)
    if grid is not None and inputs.get("pixel_values") is None:
        return ["inputs give image_grid_thw without pixel_values"]
    if grid is None or token is None:
        return []
    merge = int(getattr(getattr(model_config, "vision_config", None), "spatial_merge_size", 1))
    want = int(grid.prod(-1).sum()) // merge**2
    have = ids.count(int(token))
    patches = int(grid.prod(-1).sum())
    out = []
    if have != want:
        out.append(f"the prompt has {have} image tokens, its image_grid_thw {grid.tolist()} makes {want}")
    if inputs["pixel_values"].shape[0] != patches:
        out.append(f"pixel_values has {inputs['pixel_values'].shape[0]} patches, image_grid_thw {patches}")
    return out


def feature_problems(inputs: Any, model_config: Any) -> list[str]:
    """What is wrong with one Whisper row's ``inputs``: it must be ``{"input_features": x}``, ``x``
    a ``[num_mel_bins, frames]`` (or ``[1, ...]``) float tensor of the one length the encoder
    takes (``frames = 2 * max_source_positions``)."""
    mels, frames = int(model_config.num_mel_bins), 2 * int(model_config.max_source_positions)
    want = f"inputs={{'input_features': a [{mels}, {frames}] tensor}}"
    if not isinstance(inputs, dict) or set(inputs) != {"input_features"}:
        got = sorted(inputs) if isinstance(inputs, dict) else type(inputs).__name__
        return [f"a {model_config.model_type} row needs {want} (its encoder's input), got {got}"]
    x = inputs["input_features"]
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        return [f"input_features must be a float tensor, got {type(x).__name__}"]
    shape = tuple(x.shape[1:]) if x.dim() == 3 and x.shape[0] == 1 else tuple(x.shape)
    if shape != (mels, frames):
        return [f"input_features of shape {tuple(x.shape)}: the encoder takes [{mels}, {frames}]"]
    return []


def request_problems(
    ids: list[int], params: SamplingParams, *, model_config: Any, tokenizer: Any
) -> list[str]:
    """Every reason one request cannot run, one message per setting, with the numbers; ``params``
    resolved. The order is fixed (the sampling settings first), so a request with one fault gets
    the same message whatever else is checked."""
    out = params.problems()
    if feature_encoder(model_config):
        out.append(
            f"generate() is not built for {model_config.model_type} (score() is): its prompt is the "
            "decoder's prefix, its encoder's input the request's features"
        )
    if not ids:
        out.append("empty prompt: a request needs at least one prompt token")
    vocab = getattr(model_config, "vocab_size", None)
    if isinstance(vocab, int):
        bad = [t for t in ids if t < 0 or t >= vocab]
        if bad:
            said = ", ".join(map(str, bad[:8])) + (f" (and {len(bad) - 8} more)" if len(bad) > 8 else "")
            out.append(f"prompt token id {said} is outside the model's vocabulary [0, {vocab})")
    out += params.token_id_problems(vocab)  # an EOS id the model never produces never ends it
    n_ctx, new = context_length(model_config), params.max_new_tokens
    if getattr(model_config, "is_encoder_decoder", False) and n_ctx is not None and isinstance(new, int):
        # the prompt is the encoder's; the decoder holds its start token and the new tokens
        if len(ids) > n_ctx:
            out.append(f"prompt of {len(ids)} tokens exceeds the encoder's context of {n_ctx} tokens")
        if 1 + new > n_ctx:
            out.append(f"max_new_tokens {new} + the start token exceeds the decoder's context of {n_ctx}")
    elif n_ctx is not None and isinstance(new, int) and not isinstance(new, bool) and len(ids) + new > n_ctx:
        out.append(
            f"prompt of {len(ids)} tokens + max_new_tokens {new} exceeds the model's context of "
            f"{n_ctx} tokens"
        )
    if params.stop and not callable(getattr(tokenizer, "decode", None)):  # the check decodes (driver)
        out.append("stop strings need a tokenizer with decode(): Engine(model, tokenizer=...)")
    return out


def stop_string_check(tokenizer: Any, stops: list[str]) -> StopCheck:
    """A check that is True once the decoded text of the generated ids contains a stop string.

    Called after every appended token, so the first token whose text completes a stop string
    ends the request. Only the tail is decoded: a stop string of L bytes spans at most L tokens
    (every token decodes to at least one byte), plus one for a character split across tokens.
    """
    window = max(len(s.encode()) for s in stops) + 1

    def check(tokens: list[int]) -> bool:
        text = tokenizer.decode(tokens[-window:], skip_special_tokens=True)
        return any(s in text for s in stops)

    return check


def build_requests(
    prompts: list[list[int]],
    params: SamplingParams | None,
    overrides: dict[str, Any],
    *,
    model_config: Any,
    generation_config: Any,
    tokenizer: Any = None,
    inputs: list[dict[str, Any] | None] | None = None,
) -> list[Request]:
    """One request per prompt from ``params`` (None: defaults) with ``overrides`` on top.

    ``overrides["seed"]`` may be a list, one seed per prompt. ``inputs``: per prompt, the model's
    own forward inputs beside its ids (a VLM's images) or None. Raises ``ValueError``; for a
    list of several prompts, its message names the prompt at fault (``prompt 3 of 8: ...``).
    """
    if inputs is not None and (not isinstance(inputs, (list, tuple)) or len(inputs) != len(prompts)):
        n = len(inputs) if isinstance(inputs, (list, tuple)) else type(inputs).__name__
        raise ValueError(
            f"inputs must be a list of one dict (or None) per prompt: got {n} for {len(prompts)} prompts"
        )
    each = list(inputs) if inputs is not None else [None] * len(prompts)
    if params is not None and not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
    overrides = dict(overrides)
    seeds = overrides.pop("seed", params.seed if params is not None else None)
    if isinstance(seeds, (list, tuple)):
        if len(seeds) != len(prompts):
            raise ValueError(f"got {len(seeds)} seeds for {len(prompts)} prompts")
    else:
        seeds = [seeds] * len(prompts)
    # Resolved once for every request (each resolves it again: then a no-op).
    base = (params if params is not None else SamplingParams()).replace(**overrides)
    base = base.resolved(generation_config)
    out = []
    for i, (p, s, x) in enumerate(zip(prompts, seeds, each, strict=True)):
        try:
            req = build_request(
                p,
                base.replace(seed=s),
                model_config=model_config,
                generation_config=generation_config,
                tokenizer=tokenizer,
                inputs=x,
            )
        except ValueError as e:
            if len(prompts) == 1:
                raise
            # which of the list's prompts (a prompt too long for the context, say) is at fault
            raise ValueError(f"prompt {i} of {len(prompts)}: {e}") from None
        out.append(req)
    return out


def encode_prompt(prompt: Any, tokenizer: Any) -> list[int]:
    """A prompt (text, ids or a tensor of ids) as a list of ids. Raises ``ValueError``."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("text prompts need a tokenizer: Engine(model, tokenizer=...)")
        if not prompt:
            raise ValueError("empty prompt: a request needs at least one prompt token")
        return list(tokenizer(prompt)["input_ids"])
    if isinstance(prompt, torch.Tensor):
        return [int(t) for t in prompt.reshape(-1).tolist()]
    return [int(t) for t in prompt]


def id_batch(input_ids: Any, attention_mask: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``generate_ids``' input as tensors: a ``[B, T]`` tensor as given, or a list of ``B``
    token-id lists of one length (and its mask likewise). Raises ``ValueError`` saying what is
    expected."""
    if isinstance(input_ids, torch.Tensor):
        ids = input_ids
    else:
        ids = _id_rows(input_ids, "input_ids")
    if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
        attention_mask = _id_rows(attention_mask, "attention_mask")
    return ids, attention_mask


def _id_rows(rows: Any, name: str) -> torch.Tensor:
    expected = f"{name} must be a [batch, length] tensor or a list of token-id lists of one length"
    if isinstance(rows, list | tuple) and not rows:
        return torch.zeros((0, 0), dtype=torch.long)  # zero rows: a rank with no prompts
    if not isinstance(rows, list | tuple) or not all(isinstance(r, list | tuple) for r in rows):
        raise ValueError(f"{expected}, got {_shape_word(rows)}")
    bad = [t for r in rows for t in r if isinstance(t, bool) or not isinstance(t, int)]
    if bad:
        raise ValueError(f"{expected}; got a {type(bad[0]).__name__} ({bad[0]!r}) among the ids")
    lengths = sorted({len(r) for r in rows})
    if len(lengths) > 1:
        raise ValueError(
            f"{expected}; got rows of lengths {lengths[0]} to {lengths[-1]} (left-pad them and pass "
            "attention_mask, or give generate() the lists)"
        )
    return torch.tensor([list(r) for r in rows], dtype=torch.long)


def _shape_word(value: Any) -> str:
    if isinstance(value, list | tuple):
        return f"a list of {type(value[0]).__name__}"  # never empty: zero rows are taken
    return type(value).__name__


def unpadded_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[torch.Tensor]:
    """Each row's real ids from an HF-style left-padded ``[B, T]`` batch. Raises ``ValueError``."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape {tuple(input_ids.shape)}"
        )
    return [ids[m.bool()] for ids, m in zip(input_ids.cpu(), attention_mask.cpu(), strict=True)]


def padded_output(input_ids: torch.Tensor, reqs: list[Request], done: list[Completion]) -> torch.Tensor:
    """HF ``generate()``'s output: the input columns, then each generation padded with its pad id."""
    width = max((len(c.token_ids) for c in done), default=0)  # zero rows: [0, T]
    out = torch.empty((input_ids.shape[0], input_ids.shape[1] + width), dtype=torch.long)
    out[:, : input_ids.shape[1]] = input_ids.cpu()
    for i, (r, c) in enumerate(zip(reqs, done, strict=True)):
        out[i, input_ids.shape[1] :] = r.seq.pad_id
        out[i, input_ids.shape[1] : input_ids.shape[1] + len(c.token_ids)] = torch.tensor(c.token_ids)
    return out.to(input_ids.device)


def completion_of(seq: SeqState, tokenizer: Any, rank: int) -> Completion:
    """``seq``'s ``Completion``; its text None when the tokenizer is None or cannot decode (an
    object holding only the special ids, as DeepSpeed's rollout tests pass): the driver calls
    this, and must not fail on what the user thread never decodes."""
    decode = getattr(tokenizer, "decode", None)
    text = decode(seq.tokens, skip_special_tokens=True) if callable(decode) else None
    return Completion(
        token_ids=list(seq.tokens),
        finish_reason=seq.finish_reason or "length",
        prompt_token_ids=list(seq.prompt),
        text=text,
        logprobs=list(seq.logprobs) if seq.params.logprobs else None,
        seed=seq.params.seed if seq.params.do_sample else None,
        rank=rank,
        versions=list(seq.versions),
    )


def resolve_future(fut: Future, result: Any = None, error: BaseException | None = None) -> None:
    """Set a future once; a race with another thread's resolution is not an error."""
    with contextlib.suppress(InvalidStateError):
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
