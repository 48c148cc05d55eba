"""The KV cache of a batch: plain cache layers that reserve the columns their rows can reach, so
a decode step writes its column in place instead of concatenating a copy.

No ``torch.distributed``. The batch (``batch.py``) installs them in its ``DynamicCache`` and
tells them their reach (``ReservedLayer.reserve``).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

#: Columns a cache layer reserves beyond the ones it needs now, at most: a long generation
#: rewrites its K/V once per this many steps. The rows' remaining budget caps the reserve.
RESERVE_COLUMNS = 256


class ReservedLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys and values are views of buffers with room for the columns to
    come: up to ``reserve`` columns in all (what the batch's rows can still reach), and at most
    ``RESERVE_COLUMNS`` beyond the current need. A step writes its column into the buffer where
    ``DynamicLayer`` concatenates a copy one column longer. Why: on CPU, glibc's dynamic mmap
    threshold puts those copies on the heap, which keeps every freed one (about 150 MiB more
    peak per rank over a 16 MiB cache, docs/PERFORMANCE.md section 8); an accelerator's caching
    allocator fragments the same way. Keys and values hold the same numbers, in the same shapes,
    as ``DynamicLayer``'s (only the strides differ). Anything that replaces ``keys``/``values``
    (a fork, a merge, dropped rows) leaves the buffer, and the next update copies into a new
    one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reserve = 0  # columns the batch can reach in all (Batch._reserve sets it)
        self._kb: torch.Tensor | None = None
        self._vb: torch.Tensor | None = None

    def _in_buffer(self, past: int, n: int) -> bool:
        """The keys are the buffer's first ``past`` columns, and ``n`` more fit."""
        kb = self._kb
        return (
            kb is not None
            and past > 0
            and self.keys.data_ptr() == kb.data_ptr()
            and self.keys.stride() == kb.stride()
            and self.keys.shape[:-2] == kb.shape[:-2]
            and self.values.data_ptr() == self._vb.data_ptr()  # type: ignore[union-attr]
            and past + n <= kb.shape[-2]
        )

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        past = self.keys.shape[-2] if self.keys.numel() else 0
        n = key_states.shape[-2]
        if not self._in_buffer(past, n):
            need = past + n
            cap = max(need, min(self.reserve, need + RESERVE_COLUMNS))

            def buffer(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
                buf = new.new_empty((*new.shape[:-2], cap, new.shape[-1]))
                if past:
                    buf.narrow(-2, 0, past).copy_(old)
                return buf

            self._kb, self._vb = buffer(self.keys, key_states), buffer(self.values, value_states)
        assert self._kb is not None and self._vb is not None
        self._kb.narrow(-2, past, n).copy_(key_states)
        self._vb.narrow(-2, past, n).copy_(value_states)
        self.keys = self._kb.narrow(-2, 0, past + n)
        self.values = self._vb.narrow(-2, 0, past + n)
        return self.keys, self.values

    def reset(self) -> None:
        self._kb = self._vb = None
        super().reset()
