"""Memory estimates for the ``auto`` gather policy (full weights + KV cache vs a budget)."""

from __future__ import annotations

import os
from typing import Any

import torch

from .requests import context_length


def kv_cache_bytes(cfg: Any, batch: int, tokens: int = 2048) -> int:
    """A generous KV-cache estimate: ``batch`` sequences of ``tokens`` (capped by the context)."""
    text = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
    layers = getattr(text, "num_hidden_layers", None) or getattr(text, "n_layer", 1)
    heads = getattr(text, "num_attention_heads", None) or getattr(text, "n_head", 1)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    hidden = getattr(text, "hidden_size", None) or getattr(text, "n_embd", 0)
    head_dim = getattr(text, "head_dim", None) or hidden // max(heads, 1)
    n_ctx = context_length(text) or tokens
    return 2 * layers * kv_heads * head_dim * min(tokens, n_ctx) * batch * 4


def memory_budget(budget_gb: float | None, device: torch.device) -> int:
    """Bytes this rank may spend on full weights: the configured budget, else 80% of what is free."""
    if budget_gb is not None:
        return int(budget_gb * 1e9)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(0.8 * free)
    avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # ranks on a host share its RAM
    return int(0.8 * avail / max(local_ranks, 1))


_MMAP_THRESHOLD_SET = [False]


def return_freed_weights_to_os(threshold: int = 128 << 10) -> bool:
    """Fix glibc's mmap threshold so freed gathered weights leave the process. Idempotent.

    Per-layer gathers on the CPU allocate and free every layer's full weights each forward.
    glibc raises its mmap threshold (up to 32 MiB) whenever a mapped block is freed, so
    after the first few layers those blocks come from the heap, and a freed heap block
    is kept by the process: measured on a 20-layer Llama (FSDP2, 2 ranks), one forward
    left ~33 MB resident per layer, most of the full model. Fixing the threshold at glibc's
    own starting value (128 KiB, ``mallopt(M_MMAP_THRESHOLD)``) keeps large blocks mapped, so
    ``free`` unmaps them (a 1 MiB threshold still left DeepSpeed's per-module gathers of
    sub-MiB weights resident). ``SHARDGEN_MMAP_THRESHOLD`` (bytes) overrides it.
    Process-wide; only on glibc (returns False elsewhere).
    """
    if _MMAP_THRESHOLD_SET[0]:
        return True
    threshold = int(os.environ.get("SHARDGEN_MMAP_THRESHOLD", threshold))
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        ok = bool(libc.mallopt(-3, threshold))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False
    _MMAP_THRESHOLD_SET[0] = ok
    return ok
