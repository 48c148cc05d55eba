"""One request inside the decoder: its prompt, settings and tokens so far (``SeqState``), why it
ended, and the EOS/pad ids it is decoded with, resolved as Hugging Face resolves them.

No ``torch.distributed``, no model: the batch (``batch.py``) appends what it chose.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from shardgen.config import SamplingParams

#: Why a sequence ended: an EOS id was generated, a stop string appeared in the decoded
#: text, ``max_new_tokens`` was reached, or (a partial rollout's held row) it outlived its
#: ``max_staleness`` and was cut where it stood.
FINISH_REASONS = ("eos", "stop", "length", "stale")

StopCheck = Callable[[list[int]], bool]
"""Given the generated ids so far, True when a stop string has just appeared (the tokenizer
lives with the caller: this module never decodes text)."""


@dataclass(frozen=True)
class Holding:
    """How a partial rollout's row may be held (``generation/partial.py``): it is parked (dropped
    from the batch, its tokens kept) when every rank asks to pause, or once it drew ``budget``
    tokens since it was last admitted, and resumes from its prompt plus its tokens so far. It was
    submitted under weight version ``born``; a resumption at a version more than ``max_staleness``
    past it finishes it as ``"stale"`` instead (None: never)."""

    born: int
    max_staleness: int | None = None
    budget: int | None = None


@dataclass(eq=False)
class SeqState:
    """One request inside the decoder: its prompt, its settings and what it produced so far."""

    prompt_ids: list[int]
    params: SamplingParams
    eos_ids: frozenset[int]
    pad_id: int
    generator: torch.Generator | None = None
    tag: Any = None  # the engine's handle for the request
    stop_check: StopCheck | None = None  # stop strings, matched on decoded text
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None  # one of FINISH_REASONS once finished
    #: The model's own forward inputs for the prompt beside its ids (a VLM's ``pixel_values`` and
    #: ``image_grid_thw``), fed to the prefill only; None: the ids alone.
    inputs: dict[str, Any] | None = None
    #: Where ``inputs``' images sit in the prompt and what they are (``images.ImageLayout``): the
    #: prefix cache's key for the row; None: no images, or a layout the cache does not take.
    images: Any = None
    #: The model's forced tokens (``generation_config.forced_bos_token_id`` / ``forced_eos_token_id``,
    #: BART's), and the decoder's input length before the first new token (the prompt's; an
    #: encoder-decoder's: its start token), which says where HF's processors force them.
    forced_bos: int | None = None
    forced_eos: int | None = None
    start_length: int = 0
    #: The weight version (pauses the engine went through) of each generated token, and the one the
    #: row draws under now (set when it is admitted).
    versions: list[int] = field(default_factory=list)
    version: int = 0
    #: A partial rollout's row (``Holding``); None: a row that decodes to its end.
    holding: Holding | None = None
    #: Parked: out of the batch (the batch sees it finished and pads it), its tokens kept.
    parked: bool = False
    #: How many of ``tokens`` were fed back as prompt when it resumed (``prompt_ids`` holds them
    #: then), and ``len(tokens)`` when it was last admitted (its budget counts from there).
    fed: int = 0
    admitted_at: int = 0
    cut_in: int = -1  # parked at its budget: in which quota call (-1: not, or for a pause)
    _parked_rng: Any = None  # the generator's state when parked: a padded row still draws
    #: The row's speculative-decoding state (``drafts.RowDraft``: its place in its prompt's
    #: n-gram index, its acceptance rate); None: it has not drafted.
    draft: Any = None

    def forced_token(self) -> int | None:
        """The token the next step must take, as HF's forced-token processors decide it: EOS at the
        last step ``max_new_tokens`` allows (it wins over BOS), BOS while the decoder's input is
        one token long (an encoder-decoder's first step); None: the drawn one."""
        if self.forced_eos is not None and len(self.tokens) == self.params.max_new_tokens - 1:
            return self.forced_eos
        if self.forced_bos is not None and self.start_length + len(self.tokens) == 1:
            return self.forced_bos
        return None

    @property
    def inputs_key(self) -> int | None:
        """What rows must share besides their prompt to share its prefill: their images' digests
        (equal images in other dicts share), else their inputs' identity."""
        if self.inputs is None:
            return None
        return self.images.key if self.images is not None else id(self.inputs)

    @property
    def cache_keys(self) -> tuple[Any, ...] | list[int] | None:
        """The prompt as the prefix cache keys it: the ids, an image row's image tokens salted by
        their image (``images.py``); None: a row the cache does not take (inputs of no known
        layout)."""
        if self.inputs is None:
            return self.prompt_ids
        return None if self.images is None else self.images.keys

    def inputs_within(self, a: int, b: int) -> dict[str, Any] | None:
        """``inputs`` for the images whose tokens lie in prompt columns ``[a, b)`` (a prefill's
        forward of those columns; its columns never cut an image); None: no image there. Inputs
        of no known layout go whole with the first columns (such a row prefills whole, uncached)."""
        if self.inputs is None:
            return None
        if self.images is None:
            return self.inputs if a <= 0 else None
        return self.images.inputs_of(self.inputs, self.images.whole_before(a), self.images.whole_before(b))

    @property
    def finished(self) -> bool:
        """Ended, or parked: either way the batch pads it and never appends to it."""
        return self.finish_reason is not None or self.parked

    @property
    def prompt(self) -> list[int]:
        """The prompt as submitted (``prompt_ids`` also holds the fed-back tokens of a resumed row)."""
        return self.prompt_ids[: len(self.prompt_ids) - self.fed]

    def park(self) -> None:
        """Out of the batch, its tokens kept. The batch keeps drawing for a padded row: the
        generator's state is kept, so its draws go on from there when it resumes."""
        assert not self.finished, "a finished row parked"
        self.parked = True
        if self.generator is not None:
            self._parked_rng = self.generator.get_state()

    def resume(self) -> None:
        """Ready to be admitted again: its prompt is now the prompt and every token so far (one
        prefill recomputes their KV, under the weights of then), its draws go on where they were."""
        assert self.parked, "resume() of a row not parked"
        self.parked = False
        if self._parked_rng is not None:
            assert self.generator is not None
            self.generator.set_state(self._parked_rng)
            self._parked_rng = None
        self.prompt_ids = self.prompt_ids + self.tokens[self.fed :]
        self.fed = len(self.tokens)

    def append(self, token: int, logprob: float | None) -> None:
        assert not self.finished, "token appended to a finished sequence"
        self.tokens.append(token)
        self.versions.append(self.version)
        if logprob is not None:
            self.logprobs.append(logprob)
        if token in self.eos_ids:
            self.finish_reason = "eos"
        elif self.stop_check is not None and self.stop_check(self.tokens):
            self.finish_reason = "stop"  # the token completing the stop string is kept
        elif len(self.tokens) >= self.params.max_new_tokens:
            self.finish_reason = "length"


def resolve_special_ids(
    params: SamplingParams, generation_config: Any, tokenizer: Any = None
) -> tuple[frozenset[int], int]:
    """EOS ids and pad id for a request: explicit values, else the model's, as HF resolves them."""
    eos = params.eos_token_id
    if eos is None:
        eos = getattr(generation_config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = getattr(tokenizer, "eos_token_id", None)
    eos_list = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
    pad = params.pad_token_id
    if pad is None:
        pad = getattr(generation_config, "pad_token_id", None)
    if pad is None and eos_list:
        pad = eos_list[0]  # HF: pad falls back to the first EOS id
    if pad is None and tokenizer is not None:
        pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = 0  # no EOS and no pad anywhere: rows never finish early, the pad is only padding
    return frozenset(eos_list), int(pad)
