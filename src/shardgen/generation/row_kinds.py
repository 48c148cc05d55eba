"""What is specific to a kind of row, behind one interface: the scheduler (``scheduler.py``)
decides WHEN a prefill or a score run starts and how many rows it takes; the row kind decides
WHAT that forward is (its ``PrefillPlan`` or ``ScorePlan``, the towers its own inputs run, the
shape the tick carries) and builds the batch or run that executes it.

- ``DecoderRows``: a decoder-only model's rows, text or with images (a VLM's rows carry their
  images in ``SeqState.inputs``; a forward's towers are those its chunk's images run).
- ``EncoderDecoderRows`` (T5, BART, Whisper's scoring): the prompt is the encoder's input, a
  tower of every prefill; no prefix cache, no chunks (the encoder runs whole); the decoder
  starts from one token per row.

Pure planning (no forward, no ``torch.distributed``): ``prefill`` and ``score`` are asked for
the plan of a tick before the batch exists. A fourth kind of forward (speculative verification:
several positions per decode row) plans in ``scheduler.py`` beside the decode step, since every
row kind decodes alike.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from shardgen.generation.batch import Batch
from shardgen.generation.encdec import EncDecBatch, EncDecScoreRun, is_encoder_decoder
from shardgen.generation.plan import ForwardPlan, PrefillPlan, ScorePlan, Work
from shardgen.generation.score import ScoreRequest
from shardgen.generation.score_run import ScoreRun
from shardgen.generation.sequence import SeqState

#: The towers one forward's own inputs run (``Backend.tower_mask``).
TowerMask = Callable[[dict[str, Any]], int]


class DecoderRows:
    """A decoder-only model's rows (text, or a VLM's with images)."""

    prefix_cache = True  # a finished row's KV serves the next prompt that starts with it
    speculates = True  # its decode steps may verify drafts (``verify.py``)

    def prefill(
        self,
        kind: Work,
        seqs: Sequence[SeqState],
        matches: list[tuple[Any, int]] | None,
        share: bool,
        max_tokens: int | None,
        tower_mask: TowerMask,
    ) -> ForwardPlan:
        """The plan of a prefill (``kind``: ``PREFILL`` or ``REFILL``) of ``seqs``, the first
        ``len(seqs)`` pending requests; ``matches``: their prefix-cache hits (None: no cache).
        Image rows' chunks never cut an image; rows with inputs of no known layout prefill in
        one forward (where their images lie is not known). Pure."""
        prompts = [s.prompt_ids for s in seqs]
        images = any(s.inputs is not None for s in seqs)
        whole = any(s.inputs is not None and s.images is None for s in seqs)
        keys = [s.inputs_key for s in seqs] if images else None
        spans = [s.images.spans if s.images is not None else () for s in seqs] if images else None
        pre = PrefillPlan.of(prompts, share, None if whole else max_tokens, matches, keys, spans)
        towers = 0
        for x in pre.inputs(list(seqs), 0) if images else ():  # the images the first forward carries
            if x is not None:
                towers |= tower_mask(x)
        return ForwardPlan(kind, len(seqs), pre, *pre.shape(0), towers=towers)

    def score(
        self, rows: Sequence[ScoreRequest], share: bool, max_tokens: int | None, tower_mask: TowerMask
    ) -> ForwardPlan:
        """The plan of a new score run of ``rows``. A run holding rows with inputs of their own
        (images) goes in one forward, every row computed: the images go with their tokens (as a
        generation prefill's). Pure."""
        prompts, responses = [r.prompt_ids for r in rows], [r.response_ids for r in rows]
        towers = 0
        for r in rows:
            if r.inputs is not None:
                towers |= tower_mask(r.inputs)
        plain = all(r.inputs is None for r in rows)
        sp = ScorePlan.of(prompts, responses, share if plain else False, max_tokens if plain else None)
        return ForwardPlan(Work.SCORE, len(rows), None, *sp.shape(0), score=sp, towers=towers)

    def batch(self, model: Any, seqs: list[SeqState], device: torch.device, plan: PrefillPlan) -> Batch:
        return Batch(model, seqs, device, plan)

    def score_run(
        self, model: Any, reqs: list[ScoreRequest], device: torch.device, plan: ScorePlan
    ) -> ScoreRun:
        return ScoreRun(model, reqs, device, plan)


class EncoderDecoderRows(DecoderRows):
    """An encoder-decoder's rows (``encdec.py``): the prompt ids run the encoder, a tower, inside
    the prefill's one forward; the decoder takes one start token per row."""

    prefix_cache = False  # the decoder's columns hang on the encoder's input
    speculates = False  # its decoder steps beside the encoder's states: plain decode only

    def prefill(
        self,
        kind: Work,
        seqs: Sequence[SeqState],
        matches: list[tuple[Any, int]] | None,
        share: bool,
        max_tokens: int | None,
        tower_mask: TowerMask,
    ) -> ForwardPlan:
        assert matches is None, "an encoder-decoder's rows take no prefix cache"
        # One forward, no prefix cache: the encoder runs whole.
        plan = super().prefill(kind, seqs, None, share, None, tower_mask)
        assert plan.prefill is not None
        n = len(plan.prefill.rows)  # the decoder takes one start token per computed row
        towers = plan.towers | tower_mask({"input_ids": seqs[0].prompt_ids})
        return replace(plan, tokens=n, head_rows=n, towers=towers)

    def score(
        self, rows: Sequence[ScoreRequest], share: bool, max_tokens: int | None, tower_mask: TowerMask
    ) -> ForwardPlan:
        """ONE forward of every row, the encoder on the prompts inside it (a tower); a Whisper
        row's features run it too. Pure."""
        prompts, responses = [r.prompt_ids for r in rows], [r.response_ids for r in rows]
        towers = tower_mask({"input_ids": prompts[0]})
        for r in rows:
            if r.inputs is not None:
                towers |= tower_mask(r.inputs)
        sp = ScorePlan.encdec(prompts, responses)
        return ForwardPlan(Work.SCORE, len(rows), None, *sp.shape(0), score=sp, towers=towers)

    def batch(self, model: Any, seqs: list[SeqState], device: torch.device, plan: PrefillPlan) -> Batch:
        return EncDecBatch(model, seqs, device, plan)

    def score_run(
        self, model: Any, reqs: list[ScoreRequest], device: torch.device, plan: ScorePlan
    ) -> ScoreRun:
        return EncDecScoreRun(model, reqs, device, plan)


def row_kind(model: Any) -> DecoderRows:
    """The kind of the rows ``model`` runs."""
    return EncoderDecoderRows() if is_encoder_decoder(model) else DecoderRows()
