"""This rank's own work: requests waiting for a slot, and the batch decoding them.

Driver thread only; no collectives. The driver asks it for ONE real forward per
call (``step``): a new wave's prefill, a refill of finished slots, or a decode
step; the protocol decides whether a forward happens at all.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from shardgen.config import EngineConfig
from shardgen.generation.decode import Batch, SeqState
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
        self.phase = Work.IDLE

    @property
    def live(self) -> int:
        return self.batch.live if self.batch is not None else 0

    def step(self, admit: bool) -> bool:
        """One prefill, refill or decode forward of this rank's work; False when it has none.

        ``admit``: the agreed state allows taking new requests (not while everyone waits to pause).
        """
        t0 = time.perf_counter()
        cap = self.config.max_batch_size
        batch = self.batch
        kind, n = self._next(admit)
        if kind is Work.PREFILL:
            take = self._take(n)
            self.phase = Work.PREFILL
            self.batch = Batch(self.model, self.backend.forward, [r.seq for r in take], self.device)
            self.batch.prefill()
            self.stats.prefills += 1
        elif kind is Work.REFILL:
            assert batch is not None
            take = self._take(n)
            self.phase = Work.REFILL
            batch.refill([r.seq for r in take], max_rows=cap)
            self.stats.prefills += 1
            self.stats.refills += 1
        elif kind is Work.DECODE:
            assert batch is not None
            self.phase = Work.DECODE
            batch.step()
            self.stats.decode_steps += 1
        else:
            return False
        self.stats.forwards += 1
        self.stats.busy_s += time.perf_counter() - t0
        self._collect()
        return True

    def _next(self, admit: bool) -> tuple[Work, int]:
        """What ``step(admit)`` runs now, and how many pending requests it takes. Local."""
        batch = self.batch
        if batch is None and self.pending and admit:
            return Work.PREFILL, min(self.config.max_batch_size, len(self.pending))
        if batch is not None and self.pending and admit and self._should_refill(batch):
            return Work.REFILL, min(self._free(batch), len(self.pending))
        if batch is not None:
            return Work.DECODE, 0
        return Work.IDLE, 0

    def forward_shape(self, admit: bool) -> tuple[int, int]:
        """``(rows, width)`` of the ``input_ids`` that ``step(admit)`` would feed the model now, (0, 0)
        for none: a prefill or refill feeds its new prompts left-padded to the longest, a decode
        step one column of every row of the batch (finished rows too). The tick carries it, so
        the stationary mode's exchanges are sized from agreed numbers (and check them)."""
        kind, n = self._next(admit)
        if kind in (Work.PREFILL, Work.REFILL):
            return n, max(len(self.pending[i].seq.prompt_ids) for i in range(n))
        if kind is Work.DECODE:
            assert self.batch is not None
            return len(self.batch.seqs), 1
        return 0, 0

    def _take(self, n: int) -> list[Request]:
        take = [self.pending.popleft() for _ in range(min(n, len(self.pending)))]
        self.stats.requests += len(take)
        return take

    def _free(self, batch: Batch) -> int:
        return batch.free_slots() + self.config.max_batch_size - len(batch.seqs)

    def _should_refill(self, batch: Batch) -> bool:
        """Refill finished slots now? Each refill costs the live rows one tick, so wait until
        a quarter of the slots are free, or until every waiting request fits."""
        if not self.config.refill or not batch.can_refill():
            return False
        free = self._free(batch)
        return free > 0 and free >= min(len(self.pending), max(1, self.config.max_batch_size // 4))

    def _collect(self) -> None:
        batch = self.batch
        assert batch is not None
        for s in batch.seqs:
            if s.finished and not s.tag.future.done():
                self.stats.generated_tokens += len(s.tokens)
                self.on_finished(s)
        if batch.done:
            self.batch = None
