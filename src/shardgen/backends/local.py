"""The local backend: the whole model on every rank, no parameter collectives.

For one rank, or replicated weights. Forwards issue no collectives, so a rank
with nothing to compute skips the shadow forward.
"""

from __future__ import annotations

from typing import Any

import torch

from shardgen.backends.base import Backend
from shardgen.backends.seq2seq_inputs import decoder_positions
from shardgen.generation.plan import ForwardPlan


class LocalBackend(Backend):
    name = "local"
    lockstep = False

    @classmethod
    def create(cls, model: Any, *, device: torch.device) -> LocalBackend:
        """Not collective."""
        model = model.to(device)
        return cls(model, model, device)

    def _replica_forward(self, inputs: dict[str, Any], positions: Any) -> Any:
        """The model itself holds the whole weights (the driver's plans say ``REPLICA``). Local."""
        with decoder_positions(self.hf_model, positions):
            return self.module(**inputs)

    def shadow_forward(self, plan: ForwardPlan) -> None:
        """Nothing to match: local forwards issue no collectives."""

    def gather_all(self) -> None:
        """Weights are already whole."""

    def release_all(self) -> None:
        """Weights stay whole."""
