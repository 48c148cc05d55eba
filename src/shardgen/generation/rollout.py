"""RL rollouts: ``n`` samples per prompt, returned as padded tensors ready for a trainer.

    batch = engine.rollout(prompts, n=4, max_new_tokens=64, temperature=0.7, seed=step)
    # batch.input_ids [R, P + G], batch.response_mask [R, G], batch.logprobs [R, G], R = 4 * len(prompts)

Not collective: ``rollout`` only submits requests to the engine and waits for them, like
``generate()``; any rank may call it any number of times with any number of prompts (zero
included: an empty batch comes back at once). Rows are grouped by prompt: rows
``i * n .. i * n + n - 1`` are the samples of prompt ``i``.

Seeds: sample ``j`` of prompt ``p`` whose seed is ``s`` decodes with ``sample_seed(s, j, p)``, so
the same prompt and seed give the same rows on any rank, in any batch (a prompt given as text
and the same prompt given as token ids are different keys). A scalar ``seed`` is the seed of
every prompt of the call (a step number, say); a list gives one per prompt; None draws one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shardgen.config import SamplingParams
from shardgen.generation.decode import resolve_special_ids
from shardgen.generation.requests import Completion

#: Rollouts sample by default (``n`` greedy samples would all be equal), with logprobs.
ROLLOUT_DEFAULTS = SamplingParams(do_sample=True, logprobs=True)


@dataclass
class RolloutBatch:
    """The samples of one ``rollout()`` call, ``n`` consecutive rows per prompt.

    With P the longest prompt and G the longest response of the batch:
    """

    input_ids: torch.Tensor
    """[R, P + G] long: the prompt left-padded to P, then the response right-padded to G (pad id)."""
    attention_mask: torch.Tensor
    """[R, P + G] long: 1 on prompt tokens and on response tokens where ``response_mask`` is 1."""
    response_mask: torch.Tensor
    """[R, G] long: 1 on generated tokens up to and including the first stop (EOS id, the token
    completing a stop string), 0 after it."""
    logprobs: torch.Tensor
    """[R, G] float32: log p of each response token under ``softmax(logits / temperature)``
    (``raw_logprobs=True``: untempered); 0 where ``response_mask`` is 0."""
    prompt_lengths: torch.Tensor
    """[R] long: real (unpadded) prompt length of each row."""
    finish_reasons: list[str]
    """Per row: ``eos``, ``stop`` or ``length``."""
    seeds: list[int | None]
    """Per row: the sampling seed of that sample (None for greedy rows)."""
    n: int = 1
    """Samples per prompt."""
    texts: list[str] | None = None
    """Per row: the generated text, when the engine has a tokenizer."""

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def prompt_width(self) -> int:
        """P: the column where responses start."""
        return int(self.input_ids.shape[1] - self.response_mask.shape[1])

    @property
    def response_ids(self) -> torch.Tensor:
        """[R, G] the response columns of ``input_ids``."""
        return self.input_ids[:, self.prompt_width :]

    @property
    def response_lengths(self) -> torch.Tensor:
        """[R] tokens generated per row (the stop included)."""
        return self.response_mask.sum(-1)

    def to(self, device: torch.device | str) -> RolloutBatch:
        """The same batch with its tensors on ``device``."""
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return dataclasses.replace(self, **moved)


def sample_seed(seed: int, index: int, prompt: str | Sequence[int]) -> int:
    """The seed of sample ``index`` of ``prompt`` in a request whose seed is ``seed`` (63 bits).

    The prompt is part of it, so one scalar seed for a whole call still gives every prompt its
    own draws (rows of different prompts would otherwise err at the same steps together).
    """
    key = prompt if isinstance(prompt, str) else ",".join(str(int(t)) for t in prompt)
    digest = hashlib.blake2b(f"{int(seed)}:{int(index)}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def rollout(
    engine: Any,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    params: SamplingParams | None = None,
    *,
    n: int = 1,
    **overrides: Any,
) -> RolloutBatch:
    """Generate ``n`` samples for each prompt and pack them as a ``RolloutBatch``. Not collective.

    ``params`` defaults to ``ROLLOUT_DEFAULTS`` (sampling, temperature 1); ``overrides`` are
    ``SamplingParams`` fields (``seed`` may be a list, one per prompt). Logprobs are always
    computed (the ``logprobs`` flag is forced on).
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an integer >= 1, got {n!r}")
    if isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], int)):
        raise ValueError("rollout() takes a list of prompts (strings or token-id lists), not one prompt")
    seeds = overrides.pop("seed", None if params is None else params.seed)
    base = (params if params is not None else ROLLOUT_DEFAULTS).replace(logprobs=True, **overrides)
    base = base.resolved(getattr(engine.model, "generation_config", None))  # as every request will be
    base.validate()
    prompts = list(prompts)
    if isinstance(seeds, (list, tuple)):
        if len(seeds) != len(prompts):
            raise ValueError(f"got {len(seeds)} seeds for {len(prompts)} prompts")
    else:
        seeds = [seeds] * len(prompts)
    if base.do_sample:
        rng = random.SystemRandom()
        seeds = [rng.randrange(2**63) if s is None else int(s) for s in seeds]
        row_seeds: list[int | None] = [
            sample_seed(s, j, p) for s, p in zip(seeds, prompts, strict=True) for j in range(n)
        ]
    else:
        row_seeds = [None] * (len(prompts) * n)
    rows = [p for p in prompts for _ in range(n)]
    options = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.name != "seed"}
    done: list[Completion] = engine.generate(rows, seed=row_seeds, **options) if rows else []
    _, pad = resolve_special_ids(base, getattr(engine.model, "generation_config", None), engine.tokenizer)
    return pack(done, pad_id=pad, n=n, seeds=row_seeds, device=engine.device)


def pack(
    done: list[Completion],
    *,
    pad_id: int,
    n: int,
    seeds: list[int | None],
    device: torch.device | str = "cpu",
) -> RolloutBatch:
    """Completions -> padded tensors (prompt left-padded, response right-padded)."""
    rows = len(done)
    p_width = max((len(c.prompt_token_ids) for c in done), default=0)
    g_width = max((len(c.token_ids) for c in done), default=0)
    ids = torch.full((rows, p_width + g_width), pad_id, dtype=torch.long)
    attn = torch.zeros((rows, p_width + g_width), dtype=torch.long)
    resp = torch.zeros((rows, g_width), dtype=torch.long)
    lps = torch.zeros((rows, g_width), dtype=torch.float32)
    plen = torch.zeros((rows,), dtype=torch.long)
    for i, c in enumerate(done):
        p, g = len(c.prompt_token_ids), len(c.token_ids)
        ids[i, p_width - p : p_width] = torch.tensor(c.prompt_token_ids, dtype=torch.long)
        attn[i, p_width - p : p_width] = 1
        plen[i] = p
        if g:
            ids[i, p_width : p_width + g] = torch.tensor(c.token_ids, dtype=torch.long)
            attn[i, p_width : p_width + g] = 1
            resp[i, :g] = 1
            assert c.logprobs is not None and len(c.logprobs) == g, "rollout rows carry logprobs"
            lps[i, :g] = torch.tensor(c.logprobs, dtype=torch.float32)
    texts = [c.text for c in done] if done and all(c.text is not None for c in done) else None
    batch = RolloutBatch(
        input_ids=ids,
        attention_mask=attn,
        response_mask=resp,
        logprobs=lps,
        prompt_lengths=plen,
        finish_reasons=[c.finish_reason for c in done],
        seeds=list(seeds),
        n=n,
        texts=texts,
    )
    return batch.to(device)
