"""Memory: the ``auto`` gather policy's estimates (full weights + KV cache vs what is free after
loading) and the batch size an unset ``max_batch_size`` gets from them. How the CPU backends
keep gathered weights from piling up in the heap without an allocator setting:
``backends/buffer_pool.py``."""

from __future__ import annotations

import os
from typing import Any

import torch

from shardgen.config import context_length


def kv_cache_bytes(cfg: Any, batch: int, tokens: int = 2048) -> int:
    """A generous KV-cache estimate: ``batch`` sequences of ``tokens`` (capped by the context; an
    encoder-decoder's cross-attention cache counted as long as its self-attention one),
    in the model's dtype (``cfg.dtype``, which ``from_pretrained`` / ``from_config`` set; fp32 if unset)."""
    text = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
    layers = getattr(text, "num_hidden_layers", None) or getattr(text, "n_layer", 1)
    heads = getattr(text, "num_attention_heads", None) or getattr(text, "n_head", 1)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    hidden = getattr(text, "hidden_size", None) or getattr(text, "n_embd", 0)
    head_dim = getattr(text, "head_dim", None) or getattr(text, "d_kv", None) or hidden // max(heads, 1)
    n_ctx = context_length(text) or tokens
    dtype = getattr(cfg, "dtype", None) or getattr(text, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    size = torch.empty((), dtype=dtype).element_size() if isinstance(dtype, torch.dtype) else 4
    caches = 2 if getattr(cfg, "is_encoder_decoder", False) else 1  # + cross-attention's, as long
    return caches * 2 * layers * kv_heads * head_dim * min(tokens, n_ctx) * batch * size


MAX_SIZED_BATCH = 256
"""The most rows an unset ``max_batch_size`` is sized to (``batch_rows``)."""
AUTO_PROBE_ROWS = 16
"""The rows ``gather='auto'`` counts the KV cache of when ``max_batch_size`` is unset (the batch
is sized after the policy, in what the policy leaves)."""


def batch_rows(free_bytes: int, row_bytes: int, most: int = MAX_SIZED_BATCH) -> int:
    """Rows whose KV cache (``row_bytes`` each) fits in ``free_bytes``: at least 1, at most ``most``."""
    return max(1, min(most, free_bytes // max(row_bytes, 1)))


def host_available_bytes() -> int:
    """Memory the host can still give this process: ``MemAvailable`` (free + reclaimable cache),
    capped by the cgroup's limit minus its usage when the process runs in a limited cgroup."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if avail is None:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read())
        if limit != "max":
            avail = min(avail, int(limit) - used)
    except (OSError, ValueError):
        pass
    return max(avail, 0)


def memory_budget(budget_gb: float | None, device: torch.device) -> int:
    """Bytes this rank may add for full weights + KV cache: the configured budget, else 80% of
    what is free now. Called after loading, so the shards this rank holds are already counted
    as used. CUDA: free device memory plus what torch's caching allocator holds unused. CPU:
    the host's available memory (see :func:`host_available_bytes`) split between the ranks on
    the host (``LOCAL_WORLD_SIZE``), which all gather at once."""
    if budget_gb is not None:
        return int(budget_gb * 1e9)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(0.8 * free)
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # ranks on a host share its RAM
    return int(0.8 * host_available_bytes() / max(local_ranks, 1))
