"""How many rows a rank's batch holds and how many tokens its prefix cache keeps, when the config
leaves them unset: from the memory budget left beside the weights a forward keeps.

Computed once, in the user thread, while the ``Engine`` constructor builds the driver (after the
gather policy is resolved, before the driver builds its local work). Per rank, no collective:
ranks need not agree on either.
"""

from __future__ import annotations

from typing import Any

import torch

from shardgen.backends import Backend
from shardgen.config import EngineConfig
from shardgen.loading.memory import batch_rows, kv_cache_bytes, memory_budget
from shardgen.log import get_logger

log = get_logger()


def sized(
    config: EngineConfig, backend: Backend, gather_policy: str, hf_config: Any, device: torch.device
) -> tuple[EngineConfig, int]:
    """-> (``config`` with ``max_batch_size`` set (``sized_batch``), the prefix cache's bound in
    tokens (``prefix_tokens`` of that config)). Per rank, no collective."""
    config = sized_batch(config, backend, gather_policy, hf_config, device)
    return config, prefix_tokens(config, backend, gather_policy, hf_config, device)


def sized_batch(
    config: EngineConfig, backend: Backend, gather_policy: str, hf_config: Any, device: torch.device
) -> EngineConfig:
    """The config with ``max_batch_size`` set: as given, else as many rows as the memory
    budget holds next to the weights a forward keeps (the whole model with ``once``; per
    layer, the gathered layer is transient and not counted). Per rank, no collective: ranks
    need not agree on it."""
    if config.max_batch_size is not None:
        return config
    free = kv_budget(config, backend, gather_policy, device)
    rows = batch_rows(free, kv_cache_bytes(hf_config, 1))
    log.info("max_batch_size unset: %d rows (%.1f MB of budget for the KV cache)", rows, free / 1e6)
    return config.replace(max_batch_size=rows)


def prefix_tokens(
    config: EngineConfig, backend: Backend, gather_policy: str, hf_config: Any, device: torch.device
) -> int:
    """The prefix cache's bound in tokens: as configured, else a quarter of the memory budget
    left beside the batch's KV cache (``max_batch_size`` rows of 2048 tokens). Per rank."""
    if config.prefix_cache_tokens is not None:
        return config.prefix_cache_tokens
    batch = kv_cache_bytes(hf_config, config.max_batch_size or 1)
    free = kv_budget(config, backend, gather_policy, device) - batch
    return max(0, int(0.25 * free) // max(kv_cache_bytes(hf_config, 1, tokens=1), 1))


def kv_budget(config: EngineConfig, backend: Backend, gather_policy: str, device: torch.device) -> int:
    """Bytes of the memory budget left for KV caches beside the weights a forward keeps (the
    whole model with ``once``; per layer, the gathered layer is transient and not counted)."""
    held = backend.full_param_bytes() if gather_policy == "once" else 0
    return memory_budget(config.memory_budget_gb, device) - held
