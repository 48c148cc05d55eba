"""The plan of one prefill: which rows it computes (one per distinct prompt when the rows share
it), how each row takes its prompt's cache, the columns the rank's prefix cache already holds,
and the column chunks under a token budget.

Pure: the scheduler computes it once, before the batch exists, to carry the prefill's shape in
the tick (``scheduler.ForwardPlan``); the batch then runs exactly that plan.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PrefillPlan:
    """The forwards of one prefill: the rows it computes (the first row of each distinct prompt
    when sharing, else every row), ``fork`` (row i takes computed row ``fork[i]``; None without
    sharing) and the column ranges of its chunks. Pure: the scheduler asks it for a prefill's
    shape before the batch exists."""

    batch_rows: int
    rows: list[int]
    fork: list[int] | None
    chunks: list[tuple[int, int]]
    start: int = 0
    """Columns before it come from the prefix cache (the left-padded batch's columns ``[0, start)``;
    the chunks cover ``[start, width)``)."""
    reuse: tuple[tuple[Any, int], ...] = ()
    """With ``start``: per computed row, its prefix-cache entry (None: none) and how many of the
    row's first tokens the columns before ``start`` take from it."""

    @staticmethod
    def of(
        prompts: list[list[int]],
        share: bool,
        max_tokens: int | None,
        matches: list[tuple[Any, int]] | None = None,
        keys: list[Any] | None = None,
        spans: list[tuple[tuple[int, int], ...]] | None = None,
    ) -> PrefillPlan:
        """``share``: rows with the same prompt prefill it once. ``max_tokens``: most tokens (rows x
        columns, padding included) one forward computes; None: all. ``matches``: per row, the
        prefix-cache entry sharing its longest prefix and that prefix's length (``(None, 0)``:
        none): the columns every computed row has cached are not computed. ``keys``: per row, what
        rows must share besides the prompt to share its prefill (the identity of a request's own
        forward inputs, its images); None: nothing. ``spans``: per row, the prompt columns
        ``[start, end)`` of each of its images' tokens: the cached columns end outside every
        computed row's images (an image's features come in whole, with the forward of its
        tokens)."""
        first: dict[Any, int] = {}  # prompt (and key) -> its index among the distinct prompts
        rows: list[int] = []
        fork: list[int] = []
        for i, p in enumerate(prompts):
            key = (tuple(p), None if keys is None else keys[i])
            if key not in first:
                first[key] = len(rows)
                rows.append(i)
            fork.append(first[key])
        if not (share and len(rows) < len(prompts)):
            rows, fork = list(range(len(prompts))), None  # type: ignore[assignment]
        width = max(len(p) for p in prompts)
        # Left padding puts row i's first token at column width - len(p_i): the columns cached in
        # every computed row end at the smallest width - len(p_i) + cached_i (= width minus the
        # longest uncached suffix).
        start, reuse = 0, ()
        pads = [width - len(prompts[i]) for i in rows]
        row_spans = [spans[i] for i in rows] if spans is not None else []
        if matches is not None:
            start = max(0, min(width - len(prompts[i]) + matches[i][1] for i in rows))
            if spans is not None:
                start = _outside_images(start, pads, row_spans)
            if start:
                reuse = tuple((matches[i][0], max(0, start - (width - len(prompts[i])))) for i in rows)
        span = width - start
        per_row = span if max_tokens is None else max(1, max_tokens // len(rows))
        k = -(-span // per_row)  # chunks, of near-equal widths (balanced ticks)
        bounds = [start + span * j // k for j in range(k)] + [width]
        if spans is not None:  # no chunk cuts an image: its features come in whole, with its tokens
            bounds = sorted({start, *(_outside_images(b, pads, row_spans) for b in bounds)})
        chunks = list(itertools.pairwise(bounds))
        return PrefillPlan(len(prompts), rows, fork, chunks, start, reuse)

    def inputs(self, seqs: list[Any], chunk: int) -> list[dict[str, Any] | None]:
        """Per computed row (``seqs``: the batch's rows, ``SeqState``), the inputs of the images
        whose tokens forward ``chunk`` computes (``SeqState.inputs_within`` its columns)."""
        c0, c1 = self.chunks[chunk]
        width = max(len(s.prompt_ids) for s in seqs)
        out = []
        for i in self.rows:
            pad = width - len(seqs[i].prompt_ids)
            out.append(seqs[i].inputs_within(c0 - pad, c1 - pad))
        return out

    def shape(self, chunk: int) -> tuple[int, int]:
        """``(tokens, head_rows)`` of forward ``chunk``: every layer computes the computed rows'
        columns of the chunk; the LM head one position of each computed row, or (the last chunk
        of a shared prefill) of every row of the batch."""
        c0, c1 = self.chunks[chunk]
        last = chunk == len(self.chunks) - 1
        head = self.batch_rows if last and self.fork is not None else len(self.rows)
        return len(self.rows) * (c1 - c0), head


def _outside_images(start: int, pads: list[int], spans: list[tuple[tuple[int, int], ...]]) -> int:
    """``start`` lowered until it cuts no row's image: row u's prompt begins at column ``pads[u]``
    (left padding), its images at ``spans[u]`` of its prompt."""
    moved = True
    while moved and start:
        moved = False
        for pad, row in zip(pads, spans, strict=True):
            c = start - pad
            for s, e in row:
                if s < c < e:
                    start, moved = pad + s, True
                    break
    return start
