"""The plan of one prefill: which rows it computes (one per distinct prompt when the rows share
it), how each row takes its prompt's cache, and the column chunks under a token budget.

Pure: the scheduler computes it once, before the batch exists, to carry the prefill's shape in
the tick (``scheduler.ForwardPlan``); the batch then runs exactly that plan.
"""

from __future__ import annotations

from dataclasses import dataclass


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

    @staticmethod
    def of(prompts: list[list[int]], share: bool, max_tokens: int | None) -> PrefillPlan:
        """``share``: rows with the same prompt prefill it once. ``max_tokens``: most tokens (rows x
        columns, padding included) one forward computes; None: all."""
        first: dict[tuple[int, ...], int] = {}  # prompt -> its index among the distinct prompts
        rows: list[int] = []
        fork: list[int] = []
        for i, p in enumerate(prompts):
            if tuple(p) not in first:
                first[tuple(p)] = len(rows)
                rows.append(i)
            fork.append(first[tuple(p)])
        if not (share and len(rows) < len(prompts)):
            rows, fork = list(range(len(prompts))), None  # type: ignore[assignment]
        width = max(len(p) for p in prompts)
        per_row = width if max_tokens is None else max(1, max_tokens // len(rows))
        k = -(-width // per_row)  # chunks, of near-equal widths (balanced ticks)
        chunks = [(width * j // k, width * (j + 1) // k) for j in range(k)]
        return PrefillPlan(len(prompts), rows, fork, chunks)

    def shape(self, chunk: int) -> tuple[int, int]:
        """``(tokens, head_rows)`` of forward ``chunk``: every layer computes the computed rows'
        columns of the chunk; the LM head one position of each computed row, or (the last chunk
        of a shared prefill) of every row of the batch."""
        c0, c1 = self.chunks[chunk]
        last = chunk == len(self.chunks) - 1
        head = self.batch_rows if last and self.fork is not None else len(self.rows)
        return len(self.rows) * (c1 - c0), head
