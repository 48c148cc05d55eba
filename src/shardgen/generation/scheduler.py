"""This rank's own work: requests waiting for a slot, and the batch decoding them.

Driver thread only; no collectives. The driver asks it for ONE real forward per
call (``step``): a new wave's prefill, a refill of finished slots (either, under
``max_prefill_tokens``, one chunk of it), or a decode step; the protocol decides whether a
forward happens at all. Requests with the same prompt join a batch together, so that the
batch prefills their prompt once (``share_prefill``, decode.py).
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from shardgen.config import EngineConfig
from shardgen.generation.decode import Batch, PrefillPlan, SeqState
from shardgen.generation.requests import Request


class Work(str, enum.Enum):
    """The kind of this rank's last real forward (the driver reports it as its ``Phase``)."""

    IDLE = "idle"
    PREFILL = "prefill"
    REFILL = "refill"  # a prefill joining a running batch
    DECODE = "decode"

    def __str__(self) -> str:
        return self.value


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
    ) -> None:
        self.model = model
        self.backend = backend  # its forward is looked up per batch (late binding)
        self.device = device
        self.config = config
        self.stats = stats
        self.on_finished = on_finished
        self.pending: deque[Request] = deque()
        self.batch: Batch | None = None
        self.prefilling: Batch | None = None  # a prefill under way (chunked), to join the batch
        self.phase = Work.IDLE

    @property
    def live(self) -> int:
        """Unfinished rows: the batch's and those of a prefill under way."""
        pre = len(self.prefilling.seqs) if self.prefilling is not None else 0
        return pre + (self.batch.live if self.batch is not None else 0)

    def step(self, admit: bool) -> bool:
        """One prefill, refill or decode forward of this rank's work; False when it has none.

        ``admit``: the agreed state allows taking new requests (not while everyone waits to pause).
        A prefill over the ``max_prefill_tokens`` budget runs as chunks, one per call, before
        anything else (its rows count as live meanwhile).
        """
        t0 = time.perf_counter()
        kind, n = self._next(admit)
        if kind is Work.PREFILL and self.prefilling is not None:
            self._prefill_forward()  # the next chunk (the phase stays the prefill's or refill's)
        elif kind is Work.PREFILL:
            self.phase = Work.PREFILL
            self._start(self._take(n))
        elif kind is Work.REFILL:
            self.phase = Work.REFILL
            self.stats.refills += 1
            self._start(self._take(n))
        elif kind is Work.DECODE:
            assert self.batch is not None
            self.phase = Work.DECODE
            self.batch.step()
            self.stats.decode_steps += 1
        else:
            return False
        self.stats.forwards += 1
        self.stats.busy_s += time.perf_counter() - t0
        self._collect()
        return True

    def _next(self, admit: bool) -> tuple[Work, int]:
        """What ``step(admit)`` runs now, and how many pending requests it takes; no side effect,
        so the tick can carry the shape of the forward before it runs. Local."""
        batch = self.batch
        if self.prefilling is not None:
            return Work.PREFILL, 0
        if batch is None and self.pending and admit:
            return Work.PREFILL, self._group_take(self.config.max_batch_size)
        if batch is not None and self.pending and admit and (n := self._refill_count(batch)):
            return Work.REFILL, n
        if batch is not None:
            return Work.DECODE, 0
        return Work.IDLE, 0

    def forward_shape(self, admit: bool) -> tuple[int, int]:
        """``(tokens, head_rows)`` of the forward ``step(admit)`` would run now, (0, 0) for none:
        the tokens every layer's input holds (rows x columns, padding included: a prefill chunk
        computes its distinct prompts' columns of the chunk) and the rows the LM head's input
        holds (one position per row; the last chunk of a shared prefill forks them to every
        row). The tick carries it, so the stationary mode's exchanges are sized from agreed
        numbers (and checked against them). Local, no side effect."""
        kind, n = self._next(admit)
        if kind is Work.PREFILL and self.prefilling is not None:
            return self.prefilling.next_prefill_shape()
        if kind in (Work.PREFILL, Work.REFILL):
            cfg = self.config
            prompts = [self.pending[i].seq.prompt_ids for i in range(n)]
            return PrefillPlan.of(prompts, cfg.share_prefill, cfg.max_prefill_tokens).shape(0)
        if kind is Work.DECODE:
            assert self.batch is not None
            return len(self.batch.seqs), len(self.batch.seqs)
        return 0, 0

    def _start(self, take: list[Request]) -> None:
        cfg = self.config
        seqs = [r.seq for r in take]
        self.prefilling = Batch(
            self.model, self.backend.forward, seqs, self.device,
            share=cfg.share_prefill, max_tokens=cfg.max_prefill_tokens,
        )  # fmt: skip
        self.stats.prefills += 1
        self._prefill_forward()

    def _prefill_forward(self) -> None:
        """The next forward of the prefill under way; once it is done its rows join the batch."""
        mini = self.prefilling
        assert mini is not None
        self.stats.prefill_tokens += mini.prefill_step()
        self.stats.prefill_forwards += 1
        if mini.prefilling:
            return
        self.prefilling = None
        if self.batch is None:
            self.batch = mini  # a new wave
        else:
            self.batch.merge(mini, max_rows=self.config.max_batch_size)

    def _group_take(self, room: int) -> int:
        """How many requests ``_take`` takes for ``room`` rows, first come first served, a group at
        a time: consecutive requests with the same prompt (the ``n`` samples of a rollout) join a
        batch together, so their prompt is prefilled once. A group that does not fit waits for
        free rows; one larger than a whole batch is taken in parts. 0 when the first group must
        wait. Local, no side effect."""
        pending = self.pending
        taken, i = 0, 0
        while i < len(pending) and taken < room:
            head = pending[i].seq.prompt_ids
            size = 0
            while i + size < len(pending) and pending[i + size].seq.prompt_ids == head:
                size += 1
            if size > room - taken:
                if taken or size <= self.config.max_batch_size:
                    break
                size = room  # a group larger than a batch: the part that fits
            taken += size
            i += size
        return taken

    def _take(self, n: int) -> list[Request]:
        take = [self.pending.popleft() for _ in range(n)]
        self.stats.requests += len(take)
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
        for s in batch.seqs:
            if s.finished and not s.tag.future.done():
                self.stats.generated_tokens += len(s.tokens)
                self.on_finished(s)
        if batch.done:
            self.batch = None
        elif self.config.refill and batch.free_slots() >= max(1, len(batch.seqs) // 8) and batch.can_refill():
            # Finished rows would be computed (as padding) every step until a refill takes their
            # slots: drop them once an eighth of the batch has finished (each drop copies the
            # cache once; a refill grows the batch back up to max_batch_size). Waves
            # (refill=False) keep their rows: such a batch is exactly the one HF would run.
            batch.drop_finished()
