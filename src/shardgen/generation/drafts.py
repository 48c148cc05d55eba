"""Drafts for speculative decoding from what the engine has already seen: no draft model.

A row's draft is the continuation of an earlier occurrence of its last n tokens (n from
``MAX_NGRAM`` down to ``MIN_NGRAM``: prompt lookup), searched in one n-gram index per prompt
that holds the prompt itself, the rows of this engine decoding it now (the row itself and its
group: the other samples of its prompt) and earlier rollouts of it (earlier calls, epochs,
training steps), then, where that offers less, in one index of every prompt's live rows and
latest rollouts (the text prompts share, as SuffixDecoding's global tree). A conversation's next turn is a new
prompt holding the conversation so far, which the index holds as its prompt. A stale or wrong
draft only lowers the acceptance: the verify forward keeps exactly the tokens the plain engine
draws (``verify.py``). Whether a verify forward pays, and how wide, the ``Pacer`` decides.

The indexes live on a rank's ``DraftStore`` for the engine's life, bounded by a token budget
(``EngineConfig.speculate_history_tokens``), the least recently used prompt out first. Each row
carries its ``RowDraft`` (``SeqState.draft``): its place in its prompt's index and its adaptive
draft length. Pure Python, no torch, no collectives: the driver thread only.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

#: The longest and shortest suffix looked up (longer ones first: fewer, better matches).
MAX_NGRAM = 4
MIN_NGRAM = 2
#: Occurrences kept per n-gram, the latest.
OCCURRENCES = 4
#: Finished rollouts kept per prompt (the latest): an older policy's text drafts worse.
ROLLOUTS_PER_PROMPT = 16
#: After this many verify forwards in a row where nothing of a row's draft was accepted, the row
#: stops drafting for ``COOLDOWN`` steps (drafting does not pay for it now).
MISSES_TO_PAUSE = 2
COOLDOWN = 4
#: Weight of the newest value in the moving averages (acceptance rates, forward times).
AVERAGING = 0.3
#: A verify forward's cost per extra column, relative to a decode step's, until measured: low,
#: so that each width is tried (its measured cost then decides).
UNMEASURED_COLUMN_COST = 0.05


class Pacer:
    """Whether a verify forward pays, and how wide: from each row's acceptance rate, the draft
    tokens it is expected to keep (a geometric run), against what the wider forward costs, per
    row, over a decode step, both measured on this rank (moving averages of the forward's
    seconds per row, per width). Per-layer gathers make a wider forward nearly free; with the
    weights at hand (``once``, local) it costs its compute, and only good drafts pay."""

    def __init__(self) -> None:
        self.per_row: dict[int, float] = {}  # width -> seconds per row of a forward that wide

    def timed(self, width: int, rows: int, seconds: float) -> None:
        """A decode (width 1) or verify forward of ``rows`` rows took ``seconds``."""
        per = seconds / max(1, rows)
        old = self.per_row.get(width)
        self.per_row[width] = per if old is None else old + AVERAGING * (per - old)

    def cost(self, width: int) -> float:
        """A forward ``width`` wide over a decode step, per row (1.0 for a decode step)."""
        one = self.per_row.get(1)
        measured = [w for w in self.per_row if w > 1]
        if one is None or not measured:
            return 1.0 + UNMEASURED_COLUMN_COST * (width - 1)
        if width in self.per_row:
            return self.per_row[width] / one
        near = min(measured, key=lambda w: abs(w - width))  # its cost per extra column, at this width
        return 1.0 + (self.per_row[near] / one - 1.0) * (width - 1) / (near - 1)

    def width(self, drafts: list[list[int]], rates: list[float], live: int) -> int:
        """The draft length K (0: a decode step) whose expected tokens gained, over the live
        rows, most exceed what the forward costs beyond a decode step's (in a row's tokens)."""
        best, best_k, gain = 0.0, 0, 0.0
        rows = [(len(d), r) for d, r in zip(drafts, rates, strict=True) if d]
        if not rows:
            return 0
        odds = [1.0] * len(rows)  # per row: the chance its draft is kept up to column k
        for k in range(1, max(n for n, _ in rows) + 1):
            # Column k adds the rows whose draft reaches it (one pass per column, not per width).
            for i, (n, r) in enumerate(rows):
                if n >= k:
                    odds[i] *= r
                    gain += odds[i]
            net = gain - (self.cost(k + 1) - 1.0) * live
            if net > best:
                best, best_k = net, k
        return best_k


class NgramIndex:
    """Sequences of token ids and, for every n-gram (n in ``MIN_NGRAM..MAX_NGRAM``) with at least
    one token after it, its latest ``OCCURRENCES`` occurrences ``(sequence, end)``: a live
    sibling's latest one has one token after it, an earlier rollout's the whole answer.
    Sequences grow (a live row) and are indexed up to their last token but one (what follows
    must exist)."""

    def __init__(self) -> None:
        self.seqs: list[list[int]] = []
        self._indexed: list[int] = []  # per sequence: n-grams ending before this are in the table
        self.table: dict[tuple[int, ...], list[tuple[int, int]]] = {}

    def add(self, seq: list[int], whole: bool = False) -> int:
        """Index ``seq`` (kept by reference: a live row's tokens grow in place; ``whole``: a
        finished one, indexed to its end); its id."""
        self.seqs.append(seq)
        self._indexed.append(0)
        self.catch_up(len(self.seqs) - 1, whole)
        return len(self.seqs) - 1

    def catch_up(self, sid: int, whole: bool = False) -> None:
        """Index sequence ``sid``'s n-grams ending before its last token (``whole``: all of them)."""
        seq, table = self.seqs[sid], self.table
        stop = len(seq) if whole else len(seq) - 1
        start = self._indexed[sid]
        for end in range(max(start, MIN_NGRAM), stop + 1):
            for n in range(MIN_NGRAM, min(MAX_NGRAM, end) + 1):
                key = tuple(seq[end - n : end])
                hits = table.get(key)
                if hits is None:  # (no empty list made for every n-gram seen before)
                    table[key] = [(sid, end)]
                    continue
                hits.append((sid, end))
                if len(hits) > OCCURRENCES:
                    del hits[0]
        self._indexed[sid] = max(start, stop + 1)

    def lookup(self, context: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens after an occurrence of ``context``'s longest indexed suffix: of its
        kept occurrences, the one with the most tokens after it (the latest among equals)."""
        for n in range(min(MAX_NGRAM, len(context)), MIN_NGRAM - 1, -1):
            best: list[int] = []
            for sid, end in reversed(self.table.get(tuple(context[-n:]), ())):
                out = self.seqs[sid][end : end + k]
                if len(out) > len(best):
                    best = out
            if best:
                return best
        return []


@dataclass(eq=False)
class PromptIndex:
    """One prompt's n-gram index: the prompt, its live rows and its latest finished rollouts."""

    prompt: tuple[int, ...]
    index: NgramIndex = field(default_factory=NgramIndex)
    finished: list[list[int]] = field(default_factory=list)
    live: int = 0  # rows decoding it now (never evicted while > 0)
    rate: float | None = None  # its rows' draft acceptance (a moving average); None: none drafted yet

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
    """A row's place in its prompt's index and its draft length, adapted to its acceptance."""

    entry: PromptIndex
    seq: list[int]  # the tail of the prompt, then the row's tokens (grows with them)
    sid: int
    k: int  # the draft length to ask for next
    misses: int = 0
    cooldown: int = 0
    rate: float = 0.5  # how often a draft token of it is accepted (a moving average)
    across: NgramIndex | None = None  # the index across prompts that holds its sequence
    aid: int = -1  # its id there

    def observe(self, drafted: int, accepted: int, max_k: int) -> None:
        """After a verify forward: grow the length while drafts are taken whole, shrink it to what
        was taken otherwise, and pause drafting after ``MISSES_TO_PAUSE`` misses in a row."""
        if drafted == 0:
            self.cooldown = max(0, self.cooldown - 1)
            return
        self.rate += AVERAGING * (accepted / drafted - self.rate)
        if accepted == drafted:
            self.k, self.misses = min(max_k, self.k + 1), 0
        elif accepted == 0:
            self.misses += 1
            self.k = 1
            if self.misses >= MISSES_TO_PAUSE:
                self.cooldown, self.misses = COOLDOWN, 0
        else:
            self.k, self.misses = max(1, accepted + 1), 0


class DraftStore:
    """A rank's prompt indexes, least recently used first, within ``budget`` tokens (finished
    rollouts; the prompts and live rows are always kept). Driver thread only."""

    def __init__(self, budget: int, max_k: int) -> None:
        self.budget = budget
        self.max_k = max_k
        self.entries: OrderedDict[tuple[int, ...], PromptIndex] = OrderedDict()
        self.pacer = Pacer()
        self.kept = 0  # finished rollouts' tokens held
        self.evictions = 0
        # Every prompt's live rows and latest finished rollouts (within the budget), for the text
        # that prompts share (a format, quoted context, the same steps of another task).
        self.recent = NgramIndex()
        self._recent: deque[list[int]] = deque()
        self._recent_tokens = 0

    def row(self, seq: Any) -> RowDraft:
        """``seq``'s (a ``SeqState``) draft state, made and indexed on first use."""
        state: RowDraft | None = seq.draft
        if state is None:
            key = tuple(seq.prompt_ids)
            entry = self.entries.get(key)
            if entry is None:
                entry = self.entries[key] = PromptIndex(key)
            self.entries.move_to_end(key)
            entry.live += 1
            own = list(seq.prompt_ids[-(MAX_NGRAM - 1) :]) + list(seq.tokens)
            state = seq.draft = RowDraft(entry, own, entry.index.add(own), self.max_k)
            if entry.rate is not None:
                # A new row of a prompt drafted before (an earlier epoch, a sibling) starts from
                # how well its drafts were taken, not from a guess: when they were, the Pacer
                # widens its first forwards. A new prompt's row starts from the guess: drafts
                # from other prompts' text are taken less.
                state.rate = entry.rate
        return state

    def draft(self, seq: Any, limit: int) -> list[int]:
        """Up to ``limit`` (and the row's adaptive length) draft tokens for ``seq``'s next
        positions; [] when it has none or does not draft now. Local; changes no row."""
        state = self.row(seq)
        k = min(state.k, limit)
        if k <= 0 or state.cooldown:
            return []
        self._sync(state, seq)
        context = [*seq.prompt_ids[-MAX_NGRAM:], *seq.tokens][-MAX_NGRAM:]
        own = state.entry.index.lookup(context, k)
        if len(own) < k:  # other prompts' rows, where they offer more
            other = self.recent.lookup(context, k)
            if len(other) > len(own):
                return other
        return own

    def drafts(self, seqs: list[Any], limits: list[int]) -> tuple[tuple[int, ...], ...] | None:
        """Every row's draft (finished rows and ``limits[i] <= 0``: none), cut to the length that
        pays (``Pacer.width``); None: a decode step pays more. Local; changes no row."""
        drafts = [
            self.draft(s, n) if n > 0 and not s.finished else [] for s, n in zip(seqs, limits, strict=True)
        ]
        if not any(drafts):
            return None
        rates = [s.draft.rate if s.draft is not None else 0.0 for s in seqs]
        k = self.pacer.width(drafts, rates, sum(1 for s in seqs if not s.finished))
        return tuple(tuple(d[:k]) for d in drafts) if k else None

    def observe(self, seq: Any, drafted: int, accepted: int) -> None:
        """After a verify forward: the row's acceptance adapts its draft length, and its
        prompt's acceptance (where its next rows start) follows."""
        state: RowDraft | None = seq.draft
        if state is None:
            return
        state.observe(drafted, accepted, self.max_k)
        if drafted:
            taken = accepted / drafted
            entry = state.entry
            entry.rate = taken if entry.rate is None else entry.rate + AVERAGING * (taken - entry.rate)

    def finish(self, seq: Any) -> None:
        """``seq`` finished: its rollout stays in its prompt's index (within the budget)."""
        state: RowDraft | None = seq.draft
        if state is None:
            return
        seq.draft = None
        self._sync(state, seq)
        entry = state.entry
        if entry.index.seqs[state.sid] is state.seq:
            entry.index.catch_up(state.sid, whole=True)
        entry.live -= 1
        entry.finished.append(state.seq)
        self._remember(state)
        self.kept += len(state.seq)
        if len(entry.finished) > 2 * ROLLOUTS_PER_PROMPT:
            dropped = sum(len(s) for s in entry.finished[:-ROLLOUTS_PER_PROMPT])
            self.kept -= dropped
            entry.rebuild([])  # its live rows re-index on their next draft
        self._evict()

    def _remember(self, state: RowDraft) -> None:
        """A finished rollout kept in the index across prompts; past the budget, the older half
        out (the live rows come back in at their next draft)."""
        if not self.budget:
            return
        seq = state.seq
        self._recent.append(seq)
        self._recent_tokens += len(seq)
        if state.across is self.recent:
            self.recent.catch_up(state.aid, whole=True)
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
        if state.sid >= len(index.seqs) or index.seqs[state.sid] is not state.seq:
            state.sid = index.add(state.seq)  # the index was rebuilt since
        else:
            index.catch_up(state.sid)
        if not self.budget:
            return
        if state.across is not self.recent:  # (again) into the index across prompts
            state.across, state.aid = self.recent, self.recent.add(state.seq)
        else:
            self.recent.catch_up(state.aid)

    def _evict(self) -> None:
        """Least recently used prompts out, until the finished rollouts fit the budget."""
        for key in list(self.entries):
            if self.kept <= self.budget:
                return
            entry = self.entries[key]
            if entry.live:
                continue
            self.kept -= sum(len(s) for s in entry.finished)
            del self.entries[key]
            self.evictions += 1
