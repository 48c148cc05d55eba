"""Every plan of a forward, decided once and carried as a value: the scheduler makes them, the
driver completes a ``ForwardPlan`` with what the tick agreed, and the backend runs it.

- ``ForwardPlan``: ONE forward of a rank (what it runs, its shape, its towers) and, once the tick
  agreed, how it gets its weights (``Access``), every rank's shape and the towers every rank runs.
- ``PrefillPlan``: the rows a prefill computes (one per distinct prompt when the rows share it),
  how each row takes its prompt's cache, the columns the rank's prefix cache already holds, and
  the column chunks under a token budget.
- ``ScorePlan``: the forwards of a score run (``ScoreChunk`` each).

Pure values, no torch: the scheduler computes them before the batch or run exists, to carry their
shapes in the tick (``core/protocol.py``); the batch then runs exactly that plan. The backends
import this module (the mode of a forward) and never the scheduler (import-linter).
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, replace
from typing import Any


class Access(str, enum.Enum):
    """How one forward gets its weights: the driver decides it per tick from the agreed state
    (``core/policy.py: ForwardMode.access``), the same on every rank, and the backend reads it.

    ``REPLICA``: the weights are whole on this rank (the ``once`` replica, or the ``local``
    backend's model): no parameter collective, no shadow tower. ``PER_LAYER``: the backend's own
    gathers, unit by unit. ``STATIONARY``: the exchanges of ``backends/stationary`` (no big
    weight moves), sized from every rank's agreed shape."""

    REPLICA = "replica"
    PER_LAYER = "per-layer"
    STATIONARY = "stationary"

    def __str__(self) -> str:
        return self.value


#: ``(tokens, head_rows)`` of every rank's forward in one tick, in the tick's row order.
Shapes = tuple[tuple[int, int], ...]


class Work(str, enum.Enum):
    """The kind of a forward (``ForwardPlan.kind``); the scheduler keeps its last real one, which
    the driver reports as its ``Phase``."""

    IDLE = "idle"
    PREFILL = "prefill"
    REFILL = "refill"  # a prefill joining a running batch
    CHUNK = "chunk"  # the next chunk of the prefill under way (the phase stays the prefill's)
    DECODE = "decode"
    VERIFY = "verify"  # a decode step feeding drafts (``verify.py``; the phase stays decode)
    SCORE = "score"  # a forward of a score run (teacher forcing: a prefill with the head on responses)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class ForwardPlan:
    """ONE forward of this rank, decided once: what it runs, what it takes, its shape, and (once
    the tick agreed) how it gets its weights.

    ``kind``: ``IDLE`` (no forward of this rank's own: a shadow where the tick forwards),
    ``PREFILL`` / ``REFILL`` (the first ``take`` pending requests start a prefill, by
    ``prefill``), ``CHUNK`` (the next forward of the prefill under way), ``DECODE``, ``SCORE``
    (with ``score``: the first ``take`` waiting score rows start a run by that plan; without:
    the next forward of the run under way), ``VERIFY`` (a decode step feeding each row's last
    token and ``drafts[i]``, every row at the width of the longest draft plus one).
    ``tokens``, ``head_rows``: what every layer's input and the LM head's input hold (rows x
    columns, padding included; one position per head row, or every row at the last chunk of a
    shared prefill, or every position of a verify forward): the tick carries them. ``towers``:
    the model's towers (a bit each, ``backends/towers.py``) this forward's own inputs run,
    which the tick carries.

    Set by ``agreed``, from the agreed state, and all the backend reads (``Backend.forward``):
    ``access`` (None until then: a plan the tick has not agreed runs no forward), ``shapes``
    (every rank's shape this tick, which size the stationary exchanges) and ``run_towers`` (the
    towers every rank's forward runs this tick)."""

    kind: Work
    take: int = 0
    prefill: PrefillPlan | None = None
    tokens: int = 0
    head_rows: int = 0
    score: ScorePlan | None = None
    towers: int = 0
    drafts: tuple[tuple[int, ...], ...] | None = None
    access: Access | None = None
    shapes: Shapes | None = None
    run_towers: int = 0

    @property
    def shape(self) -> tuple[int, int]:
        return self.tokens, self.head_rows

    def agreed(
        self, access: Access, shapes: list[tuple[int, int]] | Shapes | None = None, towers: int = 0
    ) -> ForwardPlan:
        """This plan with the tick's ``access``, every rank's agreed ``shapes`` and the ``towers``
        every rank runs."""
        shapes = None if shapes is None else tuple(shapes)
        return replace(self, access=access, shapes=shapes, run_towers=towers)


IDLE_PLAN = ForwardPlan(Work.IDLE)


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
    drafts: tuple[tuple[int, ...], ...] = ()
    """Per computed row, the draft its last forward feeds after the prompt (every row of a shared
    prompt takes its computed row's: at the prefill a row's draft depends on its prompt alone),
    verified as a verify forward's (``verify.py``); empty: none. Set by ``with_drafts``."""

    @property
    def draft_width(self) -> int:
        """K, the longest draft the last forward feeds (0: a plain prefill)."""
        return max((len(d) for d in self.drafts), default=0)

    def with_drafts(self, drafts: tuple[tuple[int, ...], ...]) -> PrefillPlan:
        """This plan with its last forward feeding ``drafts`` (one per computed row) after the
        prompt. Pure."""
        assert len(drafts) == len(self.rows), f"{len(drafts)} drafts for {len(self.rows)} computed rows"
        return replace(self, drafts=drafts if any(drafts) else ())

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
        of a shared prefill) of every row of the batch. The last forward's drafts add ``K``
        columns to every computed row, and ``K`` positions to each head row."""
        c0, c1 = self.chunks[chunk]
        last = chunk == len(self.chunks) - 1
        head = self.batch_rows if last and self.fork is not None else len(self.rows)
        k = self.draft_width if last else 0
        return len(self.rows) * (c1 - c0 + k), head * (k + 1)


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


@dataclass(frozen=True)
class ScoreChunk:
    """One forward: columns ``[c0, c1)`` of every row (``every``) or of the distinct prompts'
    rows; the head on its last ``keep`` columns."""

    every: bool
    c0: int
    c1: int
    keep: int


@dataclass(frozen=True)
class ScorePlan:
    """The forwards of one score run. Pure: the scheduler carries its shapes in the tick before
    the run exists; the run then executes exactly this plan."""

    batch_rows: int
    distinct: list[int] | None  # rows computed in the prompt columns when sharing; None: all
    fork: list[int] | None  # row i takes the prompt of computed row fork[i]
    prompt_width: int
    response_width: int
    chunks: list[ScoreChunk]

    @staticmethod
    def of(
        prompts: list[list[int]], responses: list[list[int]], share: bool, max_tokens: int | None
    ) -> ScorePlan:
        """``share``: rows with one prompt compute it once. ``max_tokens``: most tokens (rows x
        columns, padding included) one forward computes; None: all."""
        first: dict[tuple[int, ...], int] = {}
        distinct: list[int] = []
        fork: list[int] = []
        for i, p in enumerate(prompts):
            if tuple(p) not in first:
                first[tuple(p)] = len(distinct)
                distinct.append(i)
            fork.append(first[tuple(p)])
        rows = len(prompts)
        p_w = max(len(p) for p in prompts)
        g_w = max(len(r) for r in responses)

        def split(c0: int, c1: int, n: int) -> list[tuple[int, int]]:
            width = c1 - c0
            per_row = width if max_tokens is None else max(1, max_tokens // n)
            k = -(-width // per_row)  # near-equal widths (balanced ticks)
            return [(c0 + width * j // k, c0 + width * (j + 1) // k) for j in range(k)]

        chunks: list[ScoreChunk] = []
        if share and len(distinct) < rows and g_w > 0:
            chunks += [ScoreChunk(False, a, b, 1) for a, b in split(0, p_w, len(distinct))]
            chunks += [ScoreChunk(True, a, b, b - a) for a, b in split(p_w, p_w + g_w, rows)]
            return ScorePlan(rows, distinct, fork, p_w, g_w, chunks)
        for a, b in split(0, p_w + g_w, rows):
            chunks.append(ScoreChunk(True, a, b, b - max(a, p_w - 1) if b > p_w - 1 else 1))
        return ScorePlan(rows, None, None, p_w, g_w, chunks)

    @staticmethod
    def encdec(prompts: list[list[int]], responses: list[list[int]]) -> ScorePlan:
        """An encoder-decoder's score run: ONE forward of every row, the encoder on the prompts (or
        a Whisper row's features) and the decoder on each row's prefix and response, right-padded,
        the head on every decoder column. The shape the tick carries: rows x (P + G) tokens, rows
        x G head rows (P the longest prompt, G the longest response, at least 1). Pure."""
        p_w = max(len(p) for p in prompts)
        g_w = max(1, max(len(r) for r in responses))
        return ScorePlan(len(prompts), None, None, p_w, g_w, [ScoreChunk(True, 0, p_w + g_w, g_w)])

    def shape(self, i: int) -> tuple[int, int]:
        """``(tokens, head_rows)`` of forward ``i``: the rows' columns, the head's rows x kept columns."""
        ch = self.chunks[i]
        rows = self.batch_rows if ch.every or self.distinct is None else len(self.distinct)
        return rows * (ch.c1 - ch.c0), rows * ch.keep
