"""This rank's own work: requests waiting for a slot, and the batch decoding them.

Driver thread only; no collectives. Each tick the driver asks it for the plan of its next
forward (``plan(admit)``, a ``ForwardPlan``: pure, once for each outcome of the tick's
admission), carries the plan's shape in the tick, and then has it execute exactly the plan the
agreed state selects (``step(plan)``): a new wave's prefill, a refill of finished slots (either,
under ``max_prefill_tokens``, one chunk of it), the next chunk of a prefill under way, or a
decode step. Nothing is decided twice: the prefill's ``PrefillPlan`` computed for the tick is
the one the batch runs (every plan is a value of ``plan.py``). vLLM v1's ``schedule() ->
SchedulerOutput`` has the same shape. Requests with the same prompt join a batch together, so
that the batch prefills their prompt once (``share_prefill``, ``PrefillPlan``). A finished
row's KV goes to the rank's prefix cache (``prefix_cache.py``), and a prefill skips the columns
it holds for every row it computes.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from shardgen.config import EngineConfig
from shardgen.generation import parking
from shardgen.generation.batch import Batch, verifiable
from shardgen.generation.drafts import DraftStore, tokens_left
from shardgen.generation.plan import IDLE_PLAN, ForwardPlan, PrefillPlan, Work
from shardgen.generation.prefix_cache import PrefixCache
from shardgen.generation.requests import Request
from shardgen.generation.row_kinds import row_kind
from shardgen.generation.score import RowScore, ScoreRequest
from shardgen.generation.score_run import ScoreRun
from shardgen.generation.sequence import SeqState
from shardgen.generation.verify import Verified, verify_step


class LocalWork:
    """The request queue and the batch of one rank. ``on_finished`` resolves a finished request."""

    def __init__(
        self,
        model: Any,
        backend: Any,
        device: torch.device,
        config: EngineConfig,
        stats: Any,
        on_finished: Callable[[SeqState], None],
        on_scored: Callable[[ScoreRequest, RowScore], None] | None = None,
        prefix_cache_tokens: int = 0,
    ) -> None:
        self.model = model
        self.backend = backend  # its forward is looked up per forward (late binding: tests wrap it)
        self.device = device
        self.config = config
        self.stats = stats
        self.on_finished = on_finished
        self.on_scored = on_scored
        self.pending: deque[Request] = deque()
        self.scoring: deque[ScoreRequest] = deque()  # score rows waiting for a run
        self.scorer: ScoreRun | None = None  # the score run under way
        self.batch: Batch | None = None
        self.prefilling: Batch | None = None  # a prefill under way (chunked), to join the batch
        self.phase = Work.IDLE
        self.prefixes = PrefixCache(prefix_cache_tokens)
        self.kind = row_kind(model)  # what a prefill or score run of its rows is (row_kinds.py)
        self._training = bool(getattr(model, "training", False))  # the mode the cache was filled in
        self.parked: list[tuple[Request, int]] = []  # held rows out of the batch (``parking.py``)
        self.releases = 0  # the quota calls whose start the driver has seen
        self.version = 0  # the weights' version: the pauses so far
        # Speculative decoding's n-gram indexes: kept for the engine's life (a pause or a new
        # policy only makes a draft stale, which lowers the acceptance and changes no row).
        self.drafts = DraftStore(config.speculate_history_tokens)
        self._drafted: tuple[Any, tuple[tuple[int, ...], ...] | None] = (None, None)  # (batch state, drafts)
        # A prefill's last forward may feed its rows' drafts too (``_fold``): text rows of plain caches.
        self._folds = bool(config.speculate) and self.kind.speculates and verifiable(model)

    def forget_prefixes(self) -> None:
        """Drop the prefix cache: the weights may change (a pause, ``close()``). Driver thread."""
        self.stats.prefix_cache_drops += self.prefixes.clear()

    def check_mode(self) -> None:
        """Drop the prefix cache when the model's ``train()``/``eval()`` mode changed since it was
        filled: a mode switch is where a trainer's step begins or ends. Driver thread, each tick."""
        training = bool(getattr(self.model, "training", False))
        if training != self._training:
            self._training = training
            self.forget_prefixes()

    @property
    def live(self) -> int:
        """Unfinished rows: the batch's and those of a prefill under way."""
        pre = len(self.prefilling.seqs) if self.prefilling is not None else 0
        scoring = len(self.scorer.reqs) if self.scorer is not None else 0
        return pre + scoring + (self.batch.live if self.batch is not None else 0)

    @property
    def waiting(self) -> int:
        """Requests not yet admitted: generation and score rows."""
        return len(self.pending) + len(self.scoring)

    def add(self, reqs: list[Any]) -> None:
        """New requests from the inbox, in order, each to its queue."""
        for r in reqs:
            (self.scoring if isinstance(r, ScoreRequest) else self.pending).append(r)

    def plan(self, admit: bool) -> ForwardPlan:
        """The forward ``step`` would run now: ``admit`` says whether the agreed state allows taking
        new requests (not while everyone waits to pause). A prefill over the
        ``max_prefill_tokens`` budget runs as chunks, one per forward, before anything else (its
        rows count as live meanwhile). Local, no side effect: the tick carries its shape."""
        batch, mini = self.batch, self.prefilling
        if mini is not None:
            x = mini.next_prefill_inputs()  # a later chunk's images
            towers = self.backend.tower_mask(x) if x else 0
            return ForwardPlan(Work.CHUNK, 0, None, *mini.next_prefill_shape(), towers=towers)
        if self.scorer is not None:
            return ForwardPlan(Work.SCORE, 0, None, *self.scorer.next_shape())
        kind, n = Work.IDLE, 0
        if batch is None and self.pending and admit:
            kind, n = Work.PREFILL, self._group_take(self.config.max_batch_size)
        elif batch is not None and self.pending and admit and (n := self._refill_count(batch)):
            kind = Work.REFILL
        cfg = self.config
        if kind is not Work.IDLE:
            seqs = [self.pending[i].seq for i in range(n)]
            matches = None
            if len(self.prefixes) and self.kind.prefix_cache:
                matches = [self._match(s) for s in seqs]
                # A prefill computes every row from the first column no row has cached: rows with
                # a cached prefix and rows without go in separate prefills (the first run of
                # either kind now, the rest next tick), so that a miss does not undo the hits.
                hit = matches[0][1] > 0
                n = next((i for i, (_, c) in enumerate(matches) if (c > 0) != hit), n)
                seqs, matches = seqs[:n], matches[:n]
            plan = self.kind.prefill(
                kind, seqs, matches, cfg.share_prefill, cfg.max_prefill_tokens, self._towers
            )
            return self._fold(plan, seqs)
        if self.scoring and admit:  # a score run goes before decode steps, as a prefill does
            rows = [self.scoring[i] for i in range(self._score_take())]
            return self.kind.score(rows, cfg.share_prefill, cfg.max_prefill_tokens, self._towers)
        if batch is not None:
            drafts = self._drafts(batch)
            if drafts is not None:
                tokens = len(batch.seqs) * (max(len(d) for d in drafts) + 1)
                return ForwardPlan(Work.VERIFY, 0, None, tokens, tokens, drafts=drafts)
            return ForwardPlan(Work.DECODE, 0, None, len(batch.seqs), len(batch.seqs))
        return IDLE_PLAN

    def _fold(self, plan: ForwardPlan, seqs: list[SeqState]) -> ForwardPlan:
        """``plan`` (a prefill of ``seqs``, new rows) with its last forward feeding each prompt's
        draft after it, where one pays (``DraftStore.drafts``, priced as the computed rows'
        columns: ``Pacer.fold_cost``): that forward then commits each row's first tokens as a
        verify forward does, and the verify forward that would have fed the draft next is saved.
        At the prefill a row's context is its prompt, so the rows of a shared prompt share its
        draft, as they share its prefill. Not for rows that have tokens already (a resumed row),
        images, or a kind or cache that cannot verify; the forward stays within
        ``max_prefill_tokens``. Local; changes no row (a row's draft state is made on first use)."""
        pre, cfg = plan.prefill, self.config
        assert pre is not None
        if not self._folds or any(s.tokens or s.inputs is not None for s in seqs):
            return plan
        c0, c1 = pre.chunks[-1]
        width = cfg.speculate
        if cfg.max_prefill_tokens is not None:  # its columns, and its head's positions
            width = min(width, cfg.max_prefill_tokens // len(pre.rows) - (c1 - c0),
                        cfg.max_prefill_tokens // len(seqs) - 1)  # fmt: skip
        if width <= 0:
            return plan
        waiting = len(self.pending) > len(seqs)  # requests beyond these wait for a slot
        limits = [min(width, tokens_left(s)) for s in seqs]
        drafts = self.drafts.drafts(seqs, limits, waiting, computed=len(pre.rows))
        if drafts is None:
            return plan
        pre = pre.with_drafts(tuple(drafts[r] for r in pre.rows))
        if not pre.drafts:
            return plan
        tokens, head = pre.shape(0)
        return replace(plan, prefill=pre, tokens=tokens, head_rows=head)

    def _drafts(self, batch: Batch) -> tuple[tuple[int, ...], ...] | None:
        """Each row's draft for the next decode step (``DraftStore.draft``), or None: no row has
        one, speculation is off, or the batch's rows cannot be verified (``Batch.can_verify``).
        A draft reaches no further than the row may draw in this call (``tokens_left``), and the
        forward's tokens stay within ``max_prefill_tokens``. Local; changes no row."""
        cfg = self.config
        if not cfg.speculate or not self.kind.speculates or not batch.can_verify():
            return None
        width = cfg.speculate
        if cfg.max_prefill_tokens is not None:
            width = min(width, cfg.max_prefill_tokens // len(batch.seqs) - 1)
        if width <= 0:
            return None
        # The driver plans each tick twice (admitted or held) over the same batch: drafted once.
        # Requests waiting for a slot: a finished row makes room for one, and every row's tokens
        # count alike; none: the call ends with its last row (``DraftStore.drafts``).
        waiting = bool(self.pending)
        key = (id(batch), batch.steps, width, tuple(map(id, batch.seqs)), waiting)
        if self._drafted[0] != key:
            # No draft reaches past max_new_tokens or a partial rollout's budget: what lay beyond
            # could only be cut.
            limits = [min(width, tokens_left(s)) for s in batch.seqs]
            self._drafted = (key, self.drafts.drafts(batch.seqs, limits, waiting))
        return self._drafted[1]

    def _towers(self, inputs: dict[str, Any]) -> int:
        """The towers a forward's own ``inputs`` run (the backend's, looked up when asked: a
        forward of text rows asks nothing)."""
        return self.backend.tower_mask(inputs)

    def step(self, plan: ForwardPlan) -> bool:
        """Run ``plan`` (from ``plan()``, with no change to the queue or the batch since, then
        ``agreed`` by the driver): ONE forward of this rank's work; False for an ``IDLE`` plan.
        The forward is the backend's, looked up now (late binding), given the plan and the model's
        inputs apart: on the parameter group it is as collective as the plan's access makes it."""
        if plan.kind is Work.IDLE:
            return False
        assert plan.access is not None, f"a {plan.kind} forward the tick has not agreed"
        t0 = time.perf_counter()

        def forward(**inputs: Any) -> Any:
            return self.backend.forward(plan, inputs)

        # Counted first: a score run's last forward resolves its rows' futures, and a stats() read
        # right after the call returns must count it.
        self.stats.forwards += 1
        if plan.kind is Work.SCORE:
            self._score_forward(plan, forward)
        elif plan.kind is Work.CHUNK:
            assert self.prefilling is not None, "a chunk planned with no prefill under way"
            self._prefill_forward(forward)
        elif plan.kind in (Work.PREFILL, Work.REFILL):
            assert plan.prefill is not None and self.prefilling is None
            assert (self.batch is None) == (plan.kind is Work.PREFILL), "the batch changed since the plan"
            self.phase = plan.kind
            if plan.kind is Work.REFILL:
                self.stats.refills += 1
            self._start(self._take(plan.take), plan.prefill, forward)
        else:
            assert plan.kind in (Work.DECODE, Work.VERIFY), plan.kind
            assert self.batch is not None and self.prefilling is None
            self.phase = Work.DECODE
            self._decode(plan, forward)
        self.stats.busy_s += time.perf_counter() - t0
        self._collect()
        return True

    def _decode(self, plan: ForwardPlan, forward: Callable[..., Any]) -> None:
        """A decode step, or (``VERIFY``) one feeding the plan's drafts; its counters."""
        batch, st = self.batch, self.stats
        assert batch is not None
        live = [s for s in batch.seqs if not s.finished]
        before = sum(len(s.tokens) for s in live)
        rows, t0 = len(batch.seqs), time.perf_counter()
        if plan.kind is Work.VERIFY:
            assert plan.drafts is not None
            self._verified(batch.seqs, plan.drafts, verify_step(batch, forward, plan.drafts))
            st.verify_forwards += 1
        else:
            batch.step(forward)
            if self.config.speculate:
                for s in live:
                    self.drafts.observe(s, 0, 0)
        if self.config.speculate:  # what a forward of this width costs here (Pacer)
            width = 1 + (max(len(d) for d in plan.drafts) if plan.drafts else 0)
            self.drafts.pacer.timed(width, rows, time.perf_counter() - t0)
        st.decode_steps += 1
        st.decode_row_steps += len(live)
        st.decode_tokens += sum(len(s.tokens) for s in live) - before

    def _verified(self, seqs: list[SeqState], drafts: tuple[tuple[int, ...], ...], done: Verified) -> None:
        """A forward that fed ``drafts`` (a verify forward, or a prefill's last): each row's
        acceptance to its draft state, and the counters."""
        for s, d, a in zip(seqs, drafts, done.accepted, strict=True):
            self.drafts.observe(s, len(d), a)
        st = self.stats
        st.drafted += done.drafted
        st.accepted += sum(done.accepted)
        st.forwards_saved += max(done.committed) - 1

    def _score_forward(self, plan: ForwardPlan, forward: Callable[..., Any]) -> None:
        """The first forward of a new score run (``plan.score``), or the next of the one under way;
        once its last is done, every row's future is resolved."""
        self.phase = Work.SCORE
        if plan.score is not None:
            assert self.scorer is None and self.prefilling is None
            take = [self.scoring.popleft() for _ in range(plan.take)]
            self.stats.requests += len(take)
            self.scorer = self.kind.score_run(self.model, take, self.device, plan.score)
        run = self.scorer
        assert run is not None, "a score forward planned with no run"
        self.stats.prefill_tokens += run.step(forward)
        self.stats.prefill_forwards += 1
        if run.done:
            self.scorer = None
            assert self.on_scored is not None, "score rows with no one to resolve them"
            for req, row in run.results():
                self.on_scored(req, row)

    def _score_take(self) -> int:
        """How many waiting score rows the next run takes: up to ``max_batch_size`` consecutive rows
        of one setting (one call's rows share it), first come first served, a group of rows with
        one prompt at a time (its prompt computed once), as ``_group_take`` does. Local."""
        q, room = self.scoring, self.config.max_batch_size
        first, taken = q[0].params, 0
        while taken < len(q) and taken < room and q[taken].params == first:
            key, size = (first, q[taken].prompt_ids), 0
            while taken + size < len(q) and (q[taken + size].params, q[taken + size].prompt_ids) == key:
                size += 1
            if size > room - taken:
                if taken:
                    break  # the group waits for the next run
                size = room  # a group larger than a run: the part that fits
            taken += size
        return taken

    def _start(self, take: list[Request], plan: PrefillPlan, forward: Callable[..., Any]) -> None:
        for entry, cached in plan.reuse:
            if entry is not None and cached:
                self.prefixes.touch(entry)
                self.stats.cached_prompt_tokens += cached
        self.prefilling = self.kind.batch(self.model, [r.seq for r in take], self.device, plan)
        self.stats.prefills += 1
        self._prefill_forward(forward)

    def _prefill_forward(self, forward: Callable[..., Any]) -> None:
        """The next forward of the prefill under way; once it is done its rows join the batch."""
        mini = self.prefilling
        assert mini is not None
        self.stats.prefill_tokens += mini.prefill_step(forward)
        self.stats.prefill_forwards += 1
        if mini.prefilling:
            return
        if mini.folded is not None:  # its last forward fed drafts (``_fold``)
            self._verified(mini.seqs, mini.prefill_drafts(), mini.folded)
            self.stats.folded_prefills += 1
        self.prefilling = None
        if self.batch is None:
            self.batch = mini  # a new wave
        else:
            self.batch.merge(mini, max_rows=self.config.max_batch_size)

    def _match(self, s: SeqState) -> tuple[Any, int]:
        """The prefix-cache entry sharing the longest prefix with ``s``'s prompt and its length,
        lowered to the start of an image it would cut; ``(None, 0)``: none. Pure."""
        keys = s.cache_keys
        if keys is None:
            return None, 0
        entry, n = self.prefixes.match(keys)
        if s.images is not None:
            n = s.images.cut(n)
        return (entry, n) if n else (None, 0)

    def _group_take(self, room: int) -> int:
        """How many requests ``_take`` takes for ``room`` rows, first come first served, a group at
        a time: consecutive requests with the same prompt (the ``n`` samples of a rollout) join a
        batch together, so their prompt is prefilled once. A group that does not fit waits for
        free rows; one larger than a whole batch is taken in parts. 0 when the first group must
        wait. Local, no side effect."""
        pending = self.pending
        taken, i = 0, 0
        while i < len(pending) and taken < room:
            head = (pending[i].seq.prompt_ids, pending[i].seq.inputs_key)
            size = 0
            while (
                i + size < len(pending)
                and (pending[i + size].seq.prompt_ids, pending[i + size].seq.inputs_key) == head
            ):
                size += 1
            if size > room - taken:
                if taken or size <= self.config.max_batch_size:
                    break
                size = room  # a group larger than a batch: the part that fits
            taken += size
            i += size
        return taken

    def _keep(self, batch: Batch, i: int, s: SeqState) -> None:
        """Row ``i`` (just finished) to the prefix cache: the KV of its prompt and its tokens but the
        last (never fed: the next turn's prompt computes it)."""
        cache = self.prefixes
        fresh = s.tokens[s.fed :]  # a resumed row's prompt_ids hold its earlier tokens
        length = len(s.prompt_ids) + len(fresh) - 1
        keys = s.cache_keys  # an image row's: its ids salted by its images
        if keys is None or not cache.keeps(length) or not batch.cacheable():
            return
        tokens = (*keys, *fresh[:-1])  # the cache's key as it is (tuple() of a tuple makes no copy)
        if cache.refresh(tokens):  # held already: no copy of the row's KV (copying is most of the cost)
            return
        assert batch.cache.layers[0].keys.shape[-2] == batch.input_ids.shape[1] - 1, "cache and ids apart"
        evicted = cache.evictions
        cache.add(tokens, batch.row_kv(i, length))
        self.stats.prefix_cache_evictions += cache.evictions - evicted

    def _take(self, n: int) -> list[Request]:
        take = [self.pending.popleft() for _ in range(n)]
        self.stats.requests += sum(1 for r in take if not r.seq.tokens)  # a resumed row counted once
        for r in take:  # its next tokens are drawn under these weights; its budget counts from here
            r.seq.version, r.seq.admitted_at = self.version, len(r.seq.tokens)
        return take

    def _free(self, batch: Batch) -> int:
        return batch.free_slots() + self.config.max_batch_size - len(batch.seqs)

    def _refill_count(self, batch: Batch) -> int:
        """Refill finished slots now? Each refill costs the live rows one tick (a chunk each, under
        a budget), so wait until a quarter of the slots are free, or until every waiting request
        fits. The requests to take; 0 for not now. Local, no side effect."""
        if not self.config.refill or not batch.can_refill():
            return 0
        free = self._free(batch)
        if free > 0 and free >= min(len(self.pending), max(1, self.config.max_batch_size // 4)):
            return self._group_take(free)
        return 0

    def _collect(self) -> None:
        batch = self.batch
        if batch is None:
            return
        parking.park_spent(self, batch)
        for i, s in enumerate(batch.seqs):
            if s.finished and not s.parked and not s.tag.future.done():
                self.stats.generated_tokens += len(s.tokens)
                self.drafts.finish(s)
                self._keep(batch, i, s)
                self.on_finished(s)
        if batch.done:
            self.batch = None
        elif self.config.refill and batch.free_slots() >= max(1, len(batch.seqs) // 8) and batch.can_refill():
            # Finished rows would be computed (as padding) every step until a refill takes their
            # slots: drop them once an eighth of the batch has finished (each drop copies the
            # cache once; a refill grows the batch back up to max_batch_size). Waves
            # (refill=False) keep their rows: such a batch is exactly the one HF would run.
            batch.drop_finished()
