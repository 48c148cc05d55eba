"""The gather policy: how the engine's forwards get their weights (docs/ARCHITECTURE.md: how `auto` chooses).

``per-layer`` (each unit gathered in every forward), ``stationary`` (no big weight moves:
``backends/stationary``), ``once`` (the whole model gathered when work starts) and ``auto``:
``once`` where the replica fits on every rank, else per forward the cheaper of ``stationary``
and ``per-layer`` by the cost model of ``backends/stationary/cost.py``, from the tick's agreed
shapes (so every rank chooses the same).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from shardgen.backends import Backend
from shardgen.backends.stationary import link_for, stationary_cost
from shardgen.config import EngineConfig
from shardgen.core.protocol import TickState
from shardgen.generation.plan import Access
from shardgen.loading.memory import AUTO_PROBE_ROWS, kv_cache_bytes, memory_budget
from shardgen.log import get_logger

log = get_logger()


def _all(flag: bool, control: Any, world: int) -> bool:
    """Whether ``flag`` holds on every rank. Collective on ``control`` when ``world > 1``: one
    all-reduce, every rank at the same point of construction."""
    if world == 1:
        return flag
    t = torch.tensor([int(flag)], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=control)
    return bool(t.item())


def resolve(
    config: EngineConfig, backend: Backend, hf_config: Any, device: torch.device, control: Any, world: int
) -> str:
    """The engine's policy: ``per-layer``, ``once``, ``stationary`` or ``auto`` (per forward).

    Runs in the user thread, in the collective constructor: ``auto`` all-reduces whether the
    replica fits; ``stationary`` and ``auto`` (when it does not fit) all-reduce whether the
    stationary mode could be built (``Backend.enable_stationary``, local), so every rank
    resolves the same policy. Each all-reduce: every rank, the same point of construction."""
    policy = config.gather
    if not backend.lockstep:
        return "per-layer"  # nothing to gather
    if policy == "auto":
        rows = config.max_batch_size or AUTO_PROBE_ROWS  # unset: sized after the policy
        need = backend.full_param_bytes() + kv_cache_bytes(hf_config, rows)
        fits = _all(need <= memory_budget(config.memory_budget_gb, device), control, world)
        log.info(
            "gather='auto': %s (%.1f MB of weights + KV cache)",
            "fits" if fits else "does not fit",
            need / 1e6,
        )
        if fits:
            return "once"
    if policy in ("stationary", "auto"):
        why = backend.enable_stationary()
        ok = _all(why is None, control, world)
        if not ok:
            backend.drop_stationary()
            log.warning(
                "gather=%r: no weight-stationary mode (%s); gathering per layer", policy, why or "a peer"
            )
            return "per-layer"
    return policy


class ForwardMode:
    """Per tick: how the forward every rank runs gets its weights (the engine's policy, or
    ``auto``'s choice), an ``Access`` the driver puts into the tick's plan."""

    def __init__(self, policy: str, backend: Backend, rank: int) -> None:
        self.policy, self.backend, self.rank = policy, backend, rank
        self.link = link_for(backend.device)
        self._per_layer_s: float | None = None
        self.chosen = {str(Access.PER_LAYER): 0, str(Access.STATIONARY): 0}

    def word(self) -> str:
        """The mode in use, for ``stats()["gather"]``: ``once``, ``per-layer`` or ``stationary``;
        under ``auto`` per forward, the mix so far (``auto per forward: 12 stationary, 3
        per-layer``); ``none`` where nothing is gathered (the local backend). Any thread."""
        if not self.backend.lockstep:
            return "none"
        if self.policy != "auto":
            return self.policy
        chosen = dict(self.chosen)  # a copy: the driver thread counts on
        return f"auto per forward: {chosen['stationary']} stationary, {chosen['per-layer']} per-layer"

    def choose(self, state: TickState, whole: bool) -> Access:
        """The access of this tick's forward: ``REPLICA`` where the weights are ``whole`` on every
        rank (the ``once`` replica gathered, or the local backend: the driver knows it), else
        ``STATIONARY`` or ``PER_LAYER`` as the policy says (``auto``: the cheaper for the agreed
        shapes). Local: a function of the agreed state (and of the model), the same on every rank."""
        if whole:
            return Access.REPLICA
        if self.policy not in ("stationary", "auto"):
            return Access.PER_LAYER  # no stationary mode (resolve dropped it, or none was asked)
        assert self.backend.stationary is not None, f"gather={self.policy!r} with no stationary mode"
        access = Access.STATIONARY if self.policy == "stationary" else self.cheaper(state.shapes())
        self.chosen[str(access)] += 1
        return access

    def cheaper(self, shapes: list[tuple[int, int]]) -> Access:
        if self._per_layer_s is None:
            self._per_layer_s = self.backend.per_layer_cost().seconds(self.link)
        st = stationary_cost(self.backend.stationary.layout, shapes, self.rank).seconds(self.link)
        return Access.STATIONARY if st <= self._per_layer_s else Access.PER_LAYER
