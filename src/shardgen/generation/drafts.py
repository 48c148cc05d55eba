"""Drafts for speculative decoding from what the engine has already seen: no draft model.

A row's draft is the continuation of an earlier occurrence of its last n tokens (n from
``MAX_NGRAM`` down to ``MIN_NGRAM``: prompt lookup), searched in one n-gram index per prompt
that holds the prompt itself, the rows of this engine decoding it now (the row itself and its
group: the other samples of its prompt) and earlier rollouts of it (earlier calls, epochs,
training steps), then, where that offers less, in one index of every prompt's live rows and
latest rollouts (the text prompts share, as SuffixDecoding's global tree). Finished rollouts
are shared with the other ranks (``outgoing``/``incoming``; they ride in the tick's all-gather,
``core/protocol.py``): a trainer's sampler deals a prompt to another rank each epoch, and its
earlier rollouts then lie on the rank that drew them. A conversation's next turn is a new
prompt holding the conversation so far, which the index holds as its prompt. A stale or wrong
draft only lowers the acceptance: the verify forward keeps exactly the tokens the plain engine
draws (``verify.py``). Whether a verify forward pays, and how wide, the ``Pacer`` decides.

The indexes live on a rank's ``DraftStore`` for the engine's life, bounded by a token budget
(``EngineConfig.speculate_history_tokens``), the least recently used prompt out first. Each row
carries its ``RowDraft`` (``SeqState.draft``): its place in its prompt's index and its
acceptance rate. Pure Python, no torch, no collectives (the driver carries what is shared): the
driver thread only.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: The longest and shortest suffix looked up (longer ones first: fewer, better matches).
MAX_NGRAM = 4
MIN_NGRAM = 2
#: Occurrences kept per n-gram, the latest.
OCCURRENCES = 4
#: Finished rollouts kept per prompt (the latest): an older policy's text drafts worse.
ROLLOUTS_PER_PROMPT = 16
#: Where a draft comes from. Each source's acceptance is kept apart (per row, per prompt and over
#: every prompt): an earlier rollout of the row's own prompt drafts far better than the prompt's
#: text, and another prompt's rows differently again, so one rate for all would price a row's
#: next draft from drafts unlike it (a new epoch's rows, drafting from the last epoch's
#: rollouts, started at the rate of the n-grams their prompt drafted before, and were kept narrow).
LIVE = 0  # the row's prompt and its live rows (the row itself, its group)
HISTORY = 1  # a finished rollout of the row's prompt (an earlier call or epoch, any rank, a sibling done)
ACROSS = 2  # other prompts' rows (the index across prompts)
SOURCES = 3
#: A source's acceptance before any of its drafts was fed (the row's, its prompt's and every
#: prompt's): an earlier answer to the same prompt is expected to be taken mostly (the policy
#: changes little between epochs: SPEC-RL measures 50-70% of a rollout shared with the last
#: epoch's), so the first verify forward of a new epoch's rows feeds drafts from it wide, and the
#: tokens taken then price the next; other text at even odds. A wrong guess costs one forward:
#: the rate follows the first verify forward's outcome (``DECAY``).
PRIOR = 0.5
PRIORS = (PRIOR, 0.8, PRIOR)  # LIVE, HISTORY, ACROSS
#: Weight of the newest value in a prompt's (and every prompt's) moving acceptance rate per source.
AVERAGING = 0.3
#: Weight of the newest finished row in how often rows run to their limit (over every prompt).
AVERAGING_ROWS = 1 / 64
#: How much of a row's acceptance counts each verify forward keep (the rest is the latest's).
DECAY = 0.7
#: A verify forward's cost per extra column, relative to a decode step's, until measured: low,
#: so that each width is tried (its measured cost then decides).
UNMEASURED_COLUMN_COST = 0.05
#: Forwards timed per width, the latest. A width's cost is the least of them: load on the machine
#: only ever slows a forward, so the least is the best estimate of what the width costs.
SAMPLES = 16
#: A width timed fewer times than this (among its fresh samples) is priced at no more than the
#: widths timed that often suggest: one forward slowed by load cannot keep it from being tried
#: again, and it is soon timed often enough to be priced on its own (each try of a width that
#: does not pay costs what it costs: two, not more).
TRUSTED = 2
#: Samples older than this many forwards age out, so that a width priced out under load is tried
#: again once it is no longer known (one forward per this many, at most, per width). Not the
#: decode step's: it is the price every width is measured against, and where verify forwards
#: pay it is seldom run (its row counts are then those of a call's last rows).
STALE = 64
#: Decode steps timed, the latest (their row counts draw the decode line).
DECODE_SAMPLES = 4 * SAMPLES
#: The ints a rank shares per tick ride in the tick's all-gather, after its row (``outgoing``):
#: at most ``SHARE_SLOT`` a rank and ``SHARE_WORDS`` over all ranks, at least ``PIECE_MIN``; a
#: rollout longer than that goes in pieces over several ticks. It bounds what every tick carries
#: and what each rank indexes per tick, whatever the world size.
SHARE_WORDS = 16_384
SHARE_SLOT = 512
PIECE_MIN = 64
#: Words before a piece's tokens: its prompt's digest, the rollout's length, the piece's offset
#: in it and its own length.
PIECE_HEAD = 4


def share_limit(world: int) -> int:
    """The ints a rank shares per tick at ``world`` ranks (the tick's payload)."""
    return max(PIECE_MIN, min(SHARE_SLOT, SHARE_WORDS // max(1, world)))


def prompt_digest(prompt: tuple[int, ...] | list[int]) -> int:
    """A prompt's 63-bit name, the same on every rank (a shared rollout names its prompt by it):
    a collision only makes a draft wrong, which lowers the acceptance and changes no row."""
    data = array("q", prompt).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") & 0x7FFF_FFFF_FFFF_FFFF


class Pacer:
    """Whether a verify forward pays, and how wide: from each row's acceptance rate, the draft
    tokens it is expected to keep (a geometric run), against what the wider forward costs over a
    decode step of as many rows, both measured on this rank. A decode step's seconds are a line
    in its rows (a fixed part: per-layer gathers, ticks; a part per row: compute), fitted to the
    least seconds seen at each row count (load only ever slows a forward); a verify forward's
    cost is the least of its latest forwards' seconds over that line at their rows, never above a
    wider width's nor below a decode step (a wider forward does all a narrower one does); until some
    width is timed often enough, the least cost per column of the verify forwards timed at any
    width, else that of a decode step of rows * width rows. Per-layer gathers make
    a wider forward nearly free; with the weights at hand (``once``, local) it costs its
    compute, and only good drafts pay."""

    def __init__(self) -> None:
        # width -> its latest forwards: (forward number, rows, seconds)
        self.samples: dict[int, deque[tuple[int, int, float]]] = {}
        self.forwards = 0
        self._known: tuple[int, bool, dict[int, list[tuple[int, float]]]] = (-1, False, {})
        self._priced: tuple[tuple[int, int | None], dict[int, float]] = ((-1, None), {})
        self._line: Callable[[int], float] | None = None
        self._fitted = False  # the decode line has a fixed part (two row counts or more seen)

    def timed(self, width: int, rows: int, seconds: float) -> None:
        """A decode (width 1) or verify forward of ``rows`` rows took ``seconds``."""
        self.forwards += 1
        kept = self.samples.setdefault(width, deque(maxlen=DECODE_SAMPLES if width <= 1 else SAMPLES))
        kept.append((self.forwards, max(1, rows), seconds))

    def _fresh(self, width: int) -> list[tuple[int, float]]:
        """``width``'s (rows, seconds) of the forwards timed within the last ``STALE`` (a decode
        step's: all it keeps)."""
        if width <= 1:
            return [(r, s) for _, r, s in self.samples.get(1, ())]
        return [(r, s) for n, r, s in self.samples.get(width, ()) if self.forwards - n < STALE]

    def _decode_line(self) -> Callable[[int], float] | None:
        """A decode step's seconds at ``rows`` rows: a line through the least seconds seen at each
        row count (least squares) where it has a fixed part and no negative slope. Where none
        fits (one count seen, or seconds all per row), the least seconds joined from count to
        count, never falling, through the origin below the counts seen and flat above them:
        past what was seen it errs low, which prices a verify forward dear, never cheap (a step
        of one row is mostly its fixed part: scaled up as seconds per row, it priced a wide
        forward of many rows far below its cost; a step of many rows kept flat for fewer would
        price their wide forwards cheap). None: no decode step timed yet."""
        self._fitted = False
        least: dict[int, float] = {}
        for r, sec in self._fresh(1):
            least[r] = min(sec, least.get(r, sec))
        if not least:
            return None
        xs = sorted(least)
        ys = [least[x] for x in xs]
        if len(xs) > 1:
            mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
            var = sum((x - mx) ** 2 for x in xs)
            slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var
            if slope >= 0.0 and my - slope * mx > 0.0:
                self._fitted = True
                return lambda rows: my + slope * (rows - mx)
        for i in range(1, len(ys)):  # more rows never cost less
            ys[i] = max(ys[i], ys[i - 1])

        def joined(rows: int) -> float:
            if rows <= xs[0]:
                return ys[0] * rows / xs[0]
            for i in range(1, len(xs)):
                if rows <= xs[i]:
                    return ys[i - 1] + (ys[i] - ys[i - 1]) * (rows - xs[i - 1]) / (xs[i] - xs[i - 1])
            return ys[-1]

        return joined

    def cost(self, width: int, rows: int | None = None) -> float:
        """A forward ``width`` wide of ``rows`` rows (None: any) over a decode step of as many rows
        (1.0 for a decode step). A verify forward's own costs (its wider inputs, the acceptance)
        weigh more beside a small decode step, so a width is priced from its forwards of about
        as many rows (half to twice), else from those nearest in rows."""
        if width <= 1:
            return 1.0
        if self._known[0] != self.forwards:  # (priced once per forward timed, not per width asked)
            line = self._decode_line()
            costs: dict[int, list[tuple[int, float]]] = {}
            if line is not None:
                for w in self.samples:
                    fresh = self._fresh(w) if w > 1 else []
                    if fresh:
                        costs[w] = [(r, sec / line(r)) for r, sec in fresh]
            self._known = (self.forwards, line is not None, costs)
            self._line = line
        _, measured, costs = self._known
        if not measured:
            return 1.0 + UNMEASURED_COLUMN_COST * (width - 1)

        def priced(w: int) -> float:
            seen = costs[w]
            if rows is None:
                return min(c for _, c in seen)
            near = [c for r, c in seen if _about(rows, r)]
            if near:
                return min(near)
            return min(seen, key=lambda rc: abs(rc[0] - rows))[1]

        if self._priced[0] != (self.forwards, rows):  # (once per forward and row count, not per width)
            trusted = {w: priced(w) for w, seen in costs.items() if len(seen) >= TRUSTED}
            # A wider forward does all that a narrower one does and more: no width is priced above
            # a wider one (a narrow width whose forwards all ran under load was otherwise priced
            # at 2-4 decode steps while wider ones cost 1.3, and not tried again until its samples
            # aged out), nor below a decode step (a decode line read high).
            least = float("inf")
            for w in sorted(trusted, reverse=True):
                least = trusted[w] = max(1.0, min(least, trusted[w]))
            self._priced = ((self.forwards, rows), trusted)
        known = self._priced[1]
        if width in known:
            return known[width]
        if known:  # its cost per extra column, at the nearest width timed often enough
            near_w = min(known, key=lambda w: abs(w - width))
            guess = 1.0 + (known[near_w] - 1.0) * (width - 1) / (near_w - 1)
        elif (column := self._pooled_column(costs, rows)) is not None:
            guess = 1.0 + column * (width - 1)
        elif self._fitted and rows is not None and self._line is not None:
            # No width timed often enough yet: a decode step of rows * width rows, as its compute
            # would be (the line's fixed part paid once).
            guess = self._line(rows * width) / self._line(rows)
        else:
            guess = 1.0 + UNMEASURED_COLUMN_COST * (width - 1)
        if width in costs:
            guess = min(guess, priced(width))
        wider = [c for w, c in known.items() if w > width]
        return max(1.0, min([guess, *wider]))

    @staticmethod
    def _pooled_column(costs: dict[int, list[tuple[int, float]]], rows: int | None) -> float | None:
        """Before any width is timed ``TRUSTED`` times: a column's cost from every verify forward
        timed, whatever its width (the least per extra column, of forwards of about ``rows`` rows
        where there are some), once ``TRUSTED`` of them are; None before. Each width's first try
        is otherwise priced at ``UNMEASURED_COLUMN_COST`` a column, and a call that widens its
        forwards one column at a time pays that guess at every width (a fresh engine's first
        call: most of its verify forwards). The least per column errs low for wide forwards
        priced from narrow ones (a verify forward's own fixed costs spread over fewer columns),
        so a wider width is still tried once its drafts may pay, then priced on its own."""
        seen = [(r, max(0.0, c - 1.0) / (w - 1)) for w, rc in costs.items() for r, c in rc]
        if len(seen) < TRUSTED:
            return None
        near = [c for r, c in seen if rows is not None and _about(rows, r)]
        return min(near or [c for _, c in seen])

    def fold_cost(self, width: int, computed: int, rows: int) -> float:
        """A prefill's last forward that feeds ``width - 1`` draft columns after the prompt of each
        of its ``computed`` rows (the distinct prompts of ``rows`` rows): what those columns add,
        in decode steps of ``rows`` rows. Its layers compute ``computed`` rows' columns, as a
        verify forward of ``computed`` rows does beyond their decode step (``cost``), which is
        this rank's decode line at ``computed`` rows over its line at ``rows`` (on this CPU about
        ``computed / rows`` of a decode step of ``rows``; with per-layer gathers, nearly one).
        The LM head's positions of the rows that share a computed row's prompt are not priced:
        a small vocabulary's head is little beside the layers."""
        extra = self.cost(width, computed) - 1.0
        line = self._line  # the decode line cost() priced against (kept current for widths > 1)
        scale = line(computed) / line(rows) if line is not None and line(rows) > 0 else computed / rows
        return 1.0 + extra * min(1.0, scale)

    def width(
        self,
        drafts: list[list[int]],
        rates: list[float],
        live: int,
        weights: list[float] | None = None,
        price: Callable[[int], float] | None = None,
    ) -> int:
        """The draft length K (0: a decode step) whose expected tokens gained, over the live
        rows, most exceed what the forward costs beyond a decode step's (in a row's tokens).
        ``weights``: what a token gained by each row is worth (``last_row_weights``); None: every
        row's alike (throughput). ``price``: a forward ``w`` wide in decode steps (``fold_cost``);
        None: a verify forward's (``cost``)."""
        if price is None:
            price = lambda w: self.cost(w, len(drafts))  # noqa: E731
        best, best_k, gain = 0.0, 0, 0.0
        rows = [(len(d), r, 1.0 if weights is None else weights[i] * live)
                for i, (d, r) in enumerate(zip(drafts, rates, strict=True)) if d]  # fmt: skip
        if not rows:
            return 0
        odds = [1.0] * len(rows)  # per row: the chance its draft is kept up to column k
        for k in range(1, max(n for n, _, _ in rows) + 1):
            # Column k adds the rows whose draft reaches it (one pass per column, not per width).
            for i, (n, r, w) in enumerate(rows):
                if n >= k:
                    odds[i] *= r
                    gain += odds[i] * w
            net = gain - (price(k + 1) - 1.0) * live
            if net > best:
                best, best_k = net, k
        return best_k


def _about(rows: int, seen: int) -> bool:
    """A forward timed at ``seen`` rows prices one of ``rows`` rows: half to twice as many."""
    return rows <= 2 * seen and seen <= 2 * rows


def tokens_left(seq: Any) -> int:
    """Tokens ``seq`` may still draw in this call: to its ``max_new_tokens``, and a partial
    rollout's row to its budget (it parks there, after the forward that reached it). A draft
    reaches no further, and a verify forward commits no more (``verify.py``)."""
    left = seq.params.max_new_tokens - len(seq.tokens)
    holding = seq.holding
    if holding is not None and holding.budget is not None:
        left = min(left, holding.budget - (len(seq.tokens) - seq.admitted_at))
    return left


def last_row_weights(
    left: list[int], rates: list[float], limited: list[float], drafted: list[bool] | None = None
) -> list[float]:
    """What a token gained by each row is worth to a call of fixed rows (no request waits for a
    slot), which ends with its last row: the chance that the row is the last, summing to 1 over
    the rows with ``left`` > 0 (tokens they may still draw; 0: finished). A row that runs to its
    limit (chance ``limited``, from earlier rows: ``DraftStore``) and has the most forwards left
    (``left`` times ``1 - rate``: a row whose drafts are taken needs fewer) is the last; where no
    row runs to its limit, their ends at EOS are alike to guess, and each row weighs the same.
    So rows that all run to their limit (a model that never says EOS) weigh their slowest row
    alone: a verify forward that widens every row pays only if that row's draft is taken too;
    rows that end at EOS weigh alike, as throughput does. ``drafted``: which rows have a draft
    now; of rows with as many forwards left, one without goes first (this forward gains it
    nothing)."""
    live = [i for i, n in enumerate(left) if n > 0]
    weights = [0.0] * len(left)
    carry = 1.0  # the chance that no row before this one (in forwards left) runs to its limit
    has = drafted or [True] * len(left)
    for i in sorted(live, key=lambda i: (-left[i] * (1.0 - rates[i]), has[i])):
        weights[i] = carry * limited[i]
        carry *= 1.0 - limited[i]
    for i in live:
        weights[i] += carry / len(live)
    return weights


class NgramIndex:
    """Sequences of token ids and, for every n-gram (n in ``MIN_NGRAM..MAX_NGRAM``) with at least
    one token after it, its latest ``OCCURRENCES`` occurrences ``(sequence, end)``: a live
    sibling's latest one has one token after it, an earlier rollout's the whole answer.
    Sequences grow (a live row) and are indexed up to their last token but one (what follows
    must exist)."""

    def __init__(self) -> None:
        self.seqs: list[list[int]] = []
        self.whole: list[bool] = []  # per sequence: finished (indexed to its end)
        self._indexed: list[int] = []  # per sequence: n-grams ending before this are in the table
        self.table: dict[tuple[int, ...], list[tuple[int, int]]] = {}

    def add(self, seq: list[int], whole: bool = False) -> int:
        """Index ``seq`` (kept by reference: a live row's tokens grow in place; ``whole``: a
        finished one, indexed to its end); its id."""
        self.seqs.append(seq)
        self.whole.append(False)
        self._indexed.append(0)
        self.catch_up(len(self.seqs) - 1, whole)
        return len(self.seqs) - 1

    def catch_up(self, sid: int, whole: bool = False, twin: tuple[NgramIndex, int] | None = None) -> None:
        """Index sequence ``sid``'s n-grams ending before its last token (``whole``: all of them).
        ``twin``: another index holding the same sequence, and its id there: indexed along with
        the same keys (made once) where it has reached the same place, else on its own."""
        seq = self.seqs[sid]
        stop = len(seq) if whole else len(seq) - 1
        start = self._indexed[sid]
        self.whole[sid] = self.whole[sid] or whole
        tables = [(self.table, sid)]
        if twin is not None:
            other, oid = twin
            if other._indexed[oid] == start:
                tables.append((other.table, oid))
                other._indexed[oid] = max(start, stop + 1)
                other.whole[oid] = other.whole[oid] or whole
            else:
                other.catch_up(oid, whole)
        for end in range(max(start, MIN_NGRAM), stop + 1):
            for n in range(MIN_NGRAM, min(MAX_NGRAM, end) + 1):
                key = tuple(seq[end - n : end])
                for table, i in tables:
                    hits = table.get(key)
                    if hits is None:  # (no empty list made for every n-gram seen before)
                        table[key] = [(i, end)]
                        continue
                    hits.append((i, end))
                    if len(hits) > OCCURRENCES:
                        del hits[0]
        self._indexed[sid] = max(start, stop + 1)

    def lookup(self, context: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens after an occurrence of ``context``'s longest indexed suffix: of its
        kept occurrences, the one with the most tokens after it (the latest among equals)."""
        return self.find(context, k)[0]

    def find(self, context: list[int], k: int) -> tuple[list[int], bool, bool]:
        """``lookup``'s tokens, whether the sequence they come from is finished (``whole``), and
        whether they reach its end (a finished rollout's last tokens: where it ended)."""
        for n in range(min(MAX_NGRAM, len(context)), MIN_NGRAM - 1, -1):
            best: list[int] = []
            whole = ends = False
            for sid, end in reversed(self.table.get(tuple(context[-n:]), ())):
                seq = self.seqs[sid]
                out = seq[end : end + k]
                if len(out) > len(best):
                    best, whole = out, self.whole[sid]
                    ends = whole and end + len(out) == len(seq)
            if best:
                return best, whole, ends
        return [], False, False


@dataclass(eq=False)
class PromptIndex:
    """One prompt's n-gram index: the prompt, its live rows and its latest finished rollouts."""

    prompt: tuple[int, ...]
    digest: int = -1  # prompt_digest(prompt), the name other ranks know it by
    index: NgramIndex = field(default_factory=NgramIndex)
    finished: list[list[int]] = field(default_factory=list)
    live: int = 0  # rows decoding it now (never evicted while > 0)
    # its rows' draft acceptance per source (moving averages); None: none of that source fed yet
    rates: list[float | None] = field(default_factory=lambda: [None] * SOURCES)
    limited: float | None = None  # how often its rows ran to max_new_tokens (moving); None: none ended

    def __post_init__(self) -> None:
        self.index.add(list(self.prompt))

    def rebuild(self, live: list[list[int]]) -> None:
        """A fresh index of the prompt, ``live`` rows' sequences and the latest finished rollouts."""
        self.finished = self.finished[-ROLLOUTS_PER_PROMPT:]
        self.index = NgramIndex()
        self.index.add(list(self.prompt))
        for seq in self.finished:
            self.index.add(seq, whole=True)
        for seq in live:
            self.index.add(seq)


@dataclass(eq=False)
class RowDraft:
    """A row's place in its prompt's index and how often its draft tokens are taken.

    A draft's tokens are taken up to its first miss, so each verify forward is a run of
    Bernoulli trials (the accepted tokens, then the miss if there was one): the chance that a
    draft token is taken given that those before it were is hits over trials, both decayed per
    forward (``DECAY``), kept per source (``LIVE``, ``HISTORY``, ``ACROSS``). ``rate``, that of
    the source of its latest draft, is what the ``Pacer`` expects of that draft (a geometric
    run). A row's draft is never cut on its own: a forward's cost is that of its
    widest row, so the Pacer cuts every draft to the one width that pays, each row weighed by its
    rate (a row whose drafts miss adds little to the gain, and nothing to the cost)."""

    entry: PromptIndex
    seq: list[int]  # the tail of the prompt, then the row's tokens (grows with them)
    sid: int
    # per source: a prior of one trial (at PRIORS, or at the rate its prompt's or every prompt's
    # drafts from that source were taken: DraftStore.row)
    hits: list[float] = field(default_factory=lambda: list(PRIORS))
    trials: list[float] = field(default_factory=lambda: [1.0] * SOURCES)
    source: int = LIVE  # that of its latest draft
    across: NgramIndex | None = None  # the index across prompts that holds its sequence
    aid: int = -1  # its id there

    @property
    def rate(self) -> float:
        return self.hits[self.source] / self.trials[self.source]

    def observe(self, drafted: int, accepted: int) -> float:
        """After a verify forward that fed ``drafted`` of its latest draft's tokens: -> this
        forward's rate."""
        trials = accepted + (accepted < drafted)
        src = self.source
        self.hits[src] = DECAY * self.hits[src] + accepted
        self.trials[src] = DECAY * self.trials[src] + trials
        return accepted / trials


class DraftStore:
    """A rank's prompt indexes, least recently used first, within ``budget`` tokens (finished
    rollouts, its own and those other ranks shared; the prompts and live rows are always kept).
    Driver thread only."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.entries: OrderedDict[tuple[int, ...], PromptIndex] = OrderedDict()
        self._by_digest: dict[int, PromptIndex] = {}
        self.pacer = Pacer()
        self.kept = 0  # finished rollouts' tokens held in the prompts' indexes
        self.evictions = 0
        # Every prompt's live rows and latest finished rollouts (within the budget), for the text
        # that prompts share (a format, quoted context, the same steps of another task).
        self.recent = NgramIndex()
        self._recent: deque[list[int]] = deque()
        self._recent_tokens = 0
        # Sharing with the other ranks (the driver turns it on where there are some): this
        # rank's finished rollouts (digest, tokens) and how far the first one went, until ticks
        # carry them ...
        self.share = False
        self.outbox: deque[tuple[int, list[int]]] = deque()
        self._outbox_tokens = 0
        self._sent = 0  # tokens of the outbox's first rollout already sent
        self._pieces: dict[int, tuple[int, int, list[int]]] = {}  # sender -> (digest, length, tokens so far)
        # ... and theirs, for prompts not indexed here, by digest: taken into a prompt's index
        # when a row of it starts here (within the budget, the oldest prompt out first).
        self.foreign: OrderedDict[int, list[list[int]]] = OrderedDict()
        self._foreign_tokens = 0
        self.received = 0  # rollouts taken from other ranks
        # How often finished rows ran to their max_new_tokens (not EOS, a stop string), over every
        # prompt (each prompt's own: PromptIndex.limited); None: no row finished yet. A call of
        # fixed rows ends with its last row, which is one of those (``last_row_weights``).
        self.limited: float | None = None
        self._finished_rows = 0
        # Every prompt's rows' acceptance per source (moving): where a row's prompt has none of a
        # source yet (a new prompt), its row starts from it.
        self.rates: list[float | None] = [None] * SOURCES

    def row(self, seq: Any) -> RowDraft:
        """``seq``'s (a ``SeqState``) draft state, made and indexed on first use."""
        state: RowDraft | None = seq.draft
        if state is None:
            key = tuple(seq.prompt_ids)
            entry = self.entries.get(key)
            if entry is None:
                entry = self._entry(key)
            self.entries.move_to_end(key)
            entry.live += 1
            own = list(seq.prompt_ids[-(MAX_NGRAM - 1) :]) + list(seq.tokens)
            state = seq.draft = RowDraft(entry, own, entry.index.add(own))
            # A new row starts, per source, from how well its prompt's drafts from it were taken
            # (an earlier epoch, a sibling), not from a guess: where they were, the Pacer widens
            # its first forwards. A new prompt's row starts from every prompt's rate where that is
            # above the prior, else from the prior: what other prompts' rows were fed from a
            # source is not what this one's will be, and its first verify forward decides (in a
            # trial, other prompts' text fed only where a row's own answer had run out read 0.05,
            # and a new prompt's rows, started there, never drafted from it).
            for src in range(SOURCES):
                known = entry.rates[src]
                if known is None and self.rates[src] is not None:
                    known = max(PRIORS[src], self.rates[src])
                if known is not None:
                    state.hits[src] = known
        return state

    def _entry(self, key: tuple[int, ...]) -> PromptIndex:
        """A new prompt's index, with the rollouts other ranks shared of it."""
        entry = self.entries[key] = PromptIndex(key, prompt_digest(key))
        self._by_digest[entry.digest] = entry
        for seq in self.foreign.pop(entry.digest, ()):
            self._foreign_tokens -= len(seq)
            self._keep(entry, seq)
        return entry

    def draft(self, seq: Any, limit: int) -> list[int]:
        """Up to ``limit`` draft tokens for ``seq``'s next positions; [] when it has none.
        Local; changes no row."""
        state = self.row(seq)
        if limit <= 0:
            return []
        self._sync(state, seq)
        context = [*seq.prompt_ids[-MAX_NGRAM:], *seq.tokens][-MAX_NGRAM:]
        own, whole, ends = state.entry.index.find(context, limit)
        state.source = HISTORY if whole else LIVE
        # Other prompts' rows, where they offer more: not past where an earlier rollout of this
        # prompt ended (its EOS is the draft's likeliest end; another prompt's text runs on, and
        # a row near its end, drafting it, read 0.15-0.22 and decoded its last tokens one a
        # forward).
        if len(own) < limit and not ends:
            other = self.recent.lookup(context, limit)
            if len(other) > len(own):
                state.source = ACROSS
                return other
        return own

    def drafts(
        self, seqs: list[Any], limits: list[int], waiting: bool = True, computed: int | None = None
    ) -> tuple[tuple[int, ...], ...] | None:
        """Every row's draft (finished rows and ``limits[i] <= 0``: none), cut to the length that
        pays (``Pacer.width``); None: a decode step pays more. ``waiting``: requests wait for a
        row's slot, so every row's tokens count alike (throughput); else the rows are all the
        call has, and the one that ends it counts (``last_row_weights``). ``computed``: the drafts
        go in a prefill's last forward of that many computed rows (``Pacer.fold_cost``); None: in
        a verify forward. Local; changes no row."""
        drafts = [
            self.draft(s, n) if n > 0 and not s.finished else [] for s, n in zip(seqs, limits, strict=True)
        ]
        if not any(drafts):
            return None
        rates = [s.draft.rate if s.draft is not None else 0.0 for s in seqs]
        weights = None
        if not waiting and self.limited:
            left = [0 if s.finished else max(1, tokens_left(s)) for s in seqs]
            limited = [self._limited(s) for s in seqs]
            weights = last_row_weights(left, rates, limited, [bool(d) for d in drafts])
        price = None
        if computed is not None:
            pacer, rows = self.pacer, len(seqs)
            price = lambda w: pacer.fold_cost(w, computed, rows)  # noqa: E731
        k = self.pacer.width(drafts, rates, sum(1 for s in seqs if not s.finished), weights, price)
        return tuple(tuple(d[:k]) for d in drafts) if k else None

    def _limited(self, seq: Any) -> float:
        """The chance that ``seq`` runs to its ``max_new_tokens``: its prompt's rows' rate where
        some finished, else every prompt's."""
        entry = seq.draft.entry if seq.draft is not None else None
        if entry is not None and entry.limited is not None:
            return entry.limited
        return self.limited or 0.0

    def observe(self, seq: Any, drafted: int, accepted: int) -> None:
        """After a verify forward that fed ``drafted`` of the row's draft tokens (0: none): its
        acceptance, and its prompt's (where its next rows start), follow."""
        state: RowDraft | None = seq.draft
        if state is None or not drafted:
            return
        taken = state.observe(drafted, accepted)
        src = state.source
        kept = [state.entry.rates]
        # Every prompt's rate is where a new prompt's rows start, so other prompts' text counts
        # there only for rows whose prompt has no answer yet, as a new prompt's. A prompt with
        # answers drafts from other prompts' text only where its own run out, where it is
        # seldom taken (it fell to 0.05, and a new prompt's rows stopped drafting from it).
        if src != ACROSS or not state.entry.finished:
            kept.append(self.rates)
        for rates in kept:
            was = rates[src]
            rates[src] = taken if was is None else was + AVERAGING * (taken - was)

    def release(self, seq: Any) -> None:
        """``seq`` ended outside a batch (a held row closed or gone stale while waiting): its draft
        state, if a plan made one, no longer holds its prompt's index live. Nothing is kept."""
        state: RowDraft | None = seq.draft
        if state is not None:
            seq.draft = None
            state.entry.live -= 1

    def finish(self, seq: Any) -> None:
        """``seq`` finished: its rollout stays in its prompt's index (within the budget) and goes
        to the other ranks (``outgoing``); whether it ran to its limit counts (``limited``)."""
        state: RowDraft | None = seq.draft
        ran = 1.0 if seq.finish_reason == "length" else 0.0
        self._finished_rows += 1
        step = max(AVERAGING_ROWS, 1.0 / self._finished_rows)  # the mean of the first rows, then moving
        self.limited = ran if self.limited is None else self.limited + step * (ran - self.limited)
        if state is None:
            return
        entry = state.entry
        entry.limited = ran if entry.limited is None else entry.limited + AVERAGING * (ran - entry.limited)
        seq.draft = None
        self._sync(state, seq)
        if entry.index.seqs[state.sid] is state.seq:
            entry.index.catch_up(state.sid, whole=True)
        entry.live -= 1
        self._remember(state.seq, state.across, state.aid)
        self._keep(entry, state.seq, indexed=True)
        if self.share and self.budget:
            self.outbox.append((entry.digest, state.seq))
            self._outbox_tokens += len(state.seq)
            while self._outbox_tokens > self.budget and len(self.outbox) > 1:  # no ticks for a while
                self._outbox_tokens -= len(self.outbox[1][1])  # the oldest out (the one under way stays)
                del self.outbox[1]
        self._evict()

    def outgoing(self, limit: int = SHARE_SLOT) -> list[int]:
        """What this rank shares this tick, as ints, at most ``limit`` (``share_limit``): the
        outbox's rollouts in pieces, each ``[digest, length, offset, n, *n tokens]``, a rollout's
        pieces in order over as many ticks as it takes (``incoming`` puts them back together)."""
        out: list[int] = []
        while self.outbox and limit - len(out) > PIECE_HEAD:
            digest, seq = self.outbox[0]
            n = min(len(seq) - self._sent, limit - len(out) - PIECE_HEAD)
            out += [digest, len(seq), self._sent, n, *seq[self._sent : self._sent + n]]
            self._sent += n
            if self._sent == len(seq):
                self.outbox.popleft()
                self._outbox_tokens -= len(seq)
                self._sent = 0
        return out

    def incoming(self, words: list[int], sender: int = 0) -> None:
        """Rank ``sender``'s ``outgoing``: each rollout, once whole, into its prompt's index where
        that prompt is indexed here, else kept by its digest until a row of it starts here; and
        into the index across prompts."""
        i = 0
        while i < len(words):
            digest, length, offset, n = words[i : i + PIECE_HEAD]
            piece = words[i + PIECE_HEAD : i + PIECE_HEAD + n]
            assert len(piece) == n, f"a shared piece of {len(piece)} tokens, not {n}"
            i += PIECE_HEAD + n
            if offset == 0:
                self._pieces[sender] = (digest, length, [])
            got = self._pieces.get(sender)
            assert got is not None and got[0] == digest and len(got[2]) == offset, "a piece out of order"
            got[2].extend(piece)
            if len(got[2]) < length:
                continue
            seq = self._pieces.pop(sender)[2]
            self.received += 1
            if not self.budget:
                continue
            self._remember(seq)
            entry = self._by_digest.get(digest)
            if entry is not None:
                self._keep(entry, seq)
                continue
            kept = self.foreign.setdefault(digest, [])
            self.foreign.move_to_end(digest)
            kept.append(seq)
            self._foreign_tokens += len(seq)
            if len(kept) > ROLLOUTS_PER_PROMPT:
                self._foreign_tokens -= len(kept.pop(0))
        self._evict()

    def _keep(self, entry: PromptIndex, seq: list[int], indexed: bool = False) -> None:
        """A finished rollout of ``entry``'s prompt kept in its index (``indexed``: it is there
        already, as a live row's sequence), the latest ``ROLLOUTS_PER_PROMPT`` of them."""
        entry.finished.append(seq)
        if not indexed:
            entry.index.add(seq, whole=True)
        self.kept += len(seq)
        if len(entry.finished) > 2 * ROLLOUTS_PER_PROMPT:
            dropped = sum(len(s) for s in entry.finished[:-ROLLOUTS_PER_PROMPT])
            self.kept -= dropped
            entry.rebuild([])  # its live rows re-index on their next draft

    def _remember(self, seq: list[int], across: NgramIndex | None = None, aid: int = -1) -> None:
        """A finished rollout kept in the index across prompts (``across``, ``aid``: that index
        and its id there, when it holds it already as a live row's); past the budget, the older
        half out (the live rows come back in at their next draft)."""
        if not self.budget:
            return
        self._recent.append(seq)
        self._recent_tokens += len(seq)
        if across is self.recent:
            self.recent.catch_up(aid, whole=True)
        else:
            self.recent.add(seq, whole=True)
        if self._recent_tokens > self.budget:
            while self._recent and self._recent_tokens > self.budget // 2:
                self._recent_tokens -= len(self._recent.popleft())
            self.recent = NgramIndex()
            for old in self._recent:
                self.recent.add(old, whole=True)

    def _sync(self, state: RowDraft, seq: Any) -> None:
        """The row's tokens since its last draft into its sequence and its prompt's index."""
        new = seq.tokens[len(state.seq) - min(len(seq.prompt_ids), MAX_NGRAM - 1) :]
        state.seq.extend(new)
        index = state.entry.index
        fresh = state.sid >= len(index.seqs) or index.seqs[state.sid] is not state.seq
        if fresh:
            state.sid = index.add(state.seq)  # the index was rebuilt since
        twin = None
        if self.budget:
            if state.across is not self.recent:  # (again) into the index across prompts
                state.across, state.aid = self.recent, self.recent.add(state.seq)
            else:
                twin = (self.recent, state.aid)
        if not fresh:
            index.catch_up(state.sid, twin=twin)
        elif twin is not None:
            self.recent.catch_up(state.aid)

    def _evict(self) -> None:
        """Within the budget: other ranks' rollouts of prompts not indexed here out first (the
        oldest prompt first), then the least recently used prompts' indexes."""
        while self.foreign and self.kept + self._foreign_tokens > self.budget:
            _, seqs = self.foreign.popitem(last=False)
            self._foreign_tokens -= sum(len(q) for q in seqs)
        for key in list(self.entries):
            if self.kept <= self.budget:
                return
            entry = self.entries[key]
            if entry.live:
                continue
            self.kept -= sum(len(s) for s in entry.finished)
            del self.entries[key]
            del self._by_digest[entry.digest]
            self.evictions += 1
