"""The allocator setting the CPU backends make so that freed gathers leave the process (glibc's
mmap threshold; process-wide, see the function's docstring)."""

from __future__ import annotations

import os

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
