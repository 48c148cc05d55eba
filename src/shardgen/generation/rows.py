"""A batch's rows and their KV cache columns, between forwards: the columns each row can reach
(reserved in the cache layers), the prefix cache's columns installed into a prefill and a row's
copied out of a finished one, finished rows dropped, and a refill's rows merged into the free
slots (continuous refill). ``Batch`` (``batch.py``) builds the rows and runs their forwards.

No ``torch.distributed`` here: every operation is local, an ``index_select`` or a left-pad of each
row's tensors, so a kept row's inputs stay what they were.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from shardgen.generation.cache import ReservedLayer
from shardgen.generation.plan import PrefillPlan
from shardgen.generation.sequence import SeqState


class BatchRows:
    """The row bookkeeping of a left-padded ``[B, T]`` batch (``Batch``): ``seqs`` one per row,
    ``input_ids`` / ``position_ids`` / ``attention_mask`` (None: all ones, as HF passes it) per
    column, M-RoPE offsets ``rope_deltas``, and ``cache``, whose layers hold each row's KV."""

    seqs: list[SeqState]
    device: torch.device
    steps: int
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    rope_deltas: torch.Tensor | None
    cache: Any

    def _reserve(self) -> None:
        """Tell the cache layers how many columns the rows can reach: the batch's width now plus
        the most tokens a live row may still generate."""
        left = max((s.params.max_new_tokens - len(s.tokens) for s in self.seqs if not s.finished), default=0)
        reach = self.input_ids.shape[1] + left
        for layer in self._layers():
            if isinstance(layer, ReservedLayer):
                layer.reserve = reach

    def _install_cached(self, plan: PrefillPlan) -> None:
        """The cache's columns ``[0, plan.start)`` for the computed rows, from the prefix cache: a
        row's cached tokens at its own columns (left padding first), zeros on its padding (masked
        out, as the padding's own KV is). The chunks then run from ``plan.start`` on, as the
        later chunks of a chunked prefill do."""
        start, width = plan.start, self.input_ids.shape[1]
        used = [(u, e, c) for u, (e, c) in enumerate(plan.reuse) if c]
        first = used[0][1].kv  # start > 0: some row takes columns from an entry
        for li, (k0, v0) in enumerate(first):
            keys = k0.new_zeros((len(plan.rows), k0.shape[0], start, k0.shape[-1]))
            values = v0.new_zeros((len(plan.rows), v0.shape[0], start, v0.shape[-1]))
            for u, entry, c in used:
                col = width - len(self.seqs[plan.rows[u]].prompt_ids)  # the row's first column
                keys[u, :, col : col + c] = entry.kv[li][0][:, :c]
                values[u, :, col : col + c] = entry.kv[li][1][:, :c]
            self.cache.update(keys.to(self.device), values.to(self.device), li)

    def _layers(self) -> list[Any]:
        """The cache layers of the decoder's own columns (an encoder-decoder's self-attention)."""
        return getattr(self.cache, "layers", None) or []

    def cacheable(self) -> bool:
        """Its rows' KV can go to the prefix cache: plain cache layers only (a sliding window's
        cache forgets columns, a recurrent state is not per column)."""
        layers = getattr(self.cache, "layers", None)
        return bool(layers) and all(
            type(layer) in (DynamicLayer, ReservedLayer) and layer.is_initialized for layer in layers
        )

    def can_verify(self) -> bool:
        """A verify forward (``verify.py``) can run: plain cache layers (a rejected draft leaves a
        hole, which a sliding window's or a recurrent state's cache cannot hold) and plain
        positions (an M-RoPE model's are not the mask's count)."""
        return self.steps > 0 and self.rope_deltas is None and self.cacheable()

    def row_kv(self, i: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of row ``i``'s KV for its last ``length`` computed columns (its real tokens: a
        row's columns are left padding, then its tokens, with no gap but the holes of rejected
        drafts, mask 0, which are left out), per layer ``[H, length, D]``."""
        layers = self._layers()
        t = layers[0].keys.shape[-2] if layers else 0
        assert length <= t, f"row {i}: {length} tokens kept of {t} columns"
        cols: torch.Tensor | None = None  # None: the last ``length`` columns, no hole among them
        if self.attention_mask is not None:
            seen = self.attention_mask[i, :t].nonzero().flatten()[-length:]
            assert len(seen) == length, f"row {i}: {length} tokens kept of {len(seen)} seen columns"
            cols = seen if int(seen[0]) != t - length else None
        out = []
        for layer in layers:
            if cols is None:
                out.append((layer.keys[i, :, t - length :].clone(), layer.values[i, :, t - length :].clone()))
            else:
                at = cols.to(layer.keys.device)
                out.append((layer.keys[i].index_select(-2, at), layer.values[i].index_select(-2, at)))
        return out

    @property
    def prefilling(self) -> bool:
        """The prefill has not produced the first tokens yet (``prefill_step()`` has chunks left)."""
        return self.steps == 0

    @property
    def live(self) -> int:
        return sum(1 for s in self.seqs if not s.finished)

    @property
    def done(self) -> bool:
        return all(s.finished for s in self.seqs)

    # ------------------------------------------------------------------ continuous refill
    def free_slots(self) -> int:
        """Finished rows, which a refill may take (the scheduler adds the growth up to its
        ``max_batch_size``)."""
        return sum(1 for s in self.seqs if s.finished)

    def can_refill(self) -> bool:
        """Refill needs caches it can re-align: plain ``DynamicLayer``s (no sliding windows)."""
        return self.steps > 0 and self.cacheable()

    def drop_finished(self) -> int:
        """Take the finished rows out of the batch (their results are already collected), so the
        next steps compute the live rows only; the rows dropped. Each kept row keeps its own
        tokens, positions, mask and cache columns (an ``index_select`` of each), so its inputs are
        what they were. Needs ``can_refill()`` (plain caches)."""
        keep = [i for i, s in enumerate(self.seqs) if not s.finished]
        dropped = len(self.seqs) - len(keep)
        if not keep or not dropped:
            return 0
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.input_ids = self.input_ids.index_select(0, idx)
        self.position_ids = self.position_ids.index_select(0, idx)
        if self.rope_deltas is not None:
            self.rope_deltas = self.rope_deltas.index_select(0, idx)
        if self.attention_mask is not None:
            self.attention_mask = self.attention_mask.index_select(0, idx)
        for layer in self._layers():
            layer.keys = layer.keys.index_select(0, idx.to(layer.keys.device))
            layer.values = layer.values.index_select(0, idx.to(layer.values.device))
        self._keep_rows(idx)
        self.seqs = [self.seqs[i] for i in keep]
        self._reserve()
        return dropped

    def _keep_rows(self, idx: torch.Tensor) -> None:
        """``drop_finished``'s ``index_select`` of per-row state beyond the decoder's (a subclass's)."""

    def merge(self, mini: BatchRows, max_rows: int) -> None:
        """Merge the prefilled batch ``mini`` into finished rows, growing to ``max_rows``.

        The new rows join the batch's KV cache left-padded to a common length, so the
        next ``step()`` decodes old and new rows together. Columns padded in every row
        are dropped, so the cache never grows beyond the longest live history.
        """
        assert self.can_refill() and not mini.prefilling
        slots = [i for i, s in enumerate(self.seqs) if s.finished]
        assert len(mini.seqs) <= len(slots) + max_rows - len(self.seqs), "refill beyond free slots"
        self._merge(mini, slots[: len(mini.seqs)])

    def _merge(self, mini: BatchRows, slots: list[int]) -> None:
        width = max(self.input_ids.shape[1], mini.input_ids.shape[1])
        a_mask = self._full_mask()
        b_mask = mini._full_mask()

        def left(t: torch.Tensor, dim: int) -> torch.Tensor:  # left-pad along dim to the common width
            extra = width - t.shape[dim] if dim != -2 else (width - 1) - t.shape[dim]
            if extra == 0:
                return t
            shape = list(t.shape)
            shape[dim] = extra
            return torch.cat([t.new_zeros(shape), t], dim=dim)

        def combine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return combine_rows(a, b, slots)

        self.input_ids = combine(left(self.input_ids, 1), left(mini.input_ids, 1))
        self.position_ids = combine(left(self.position_ids, 1), left(mini.position_ids, 1))
        mask = combine(left(a_mask, 1), left(b_mask, 1))
        if self.rope_deltas is not None and mini.rope_deltas is not None:
            self.rope_deltas = combine(self.rope_deltas, mini.rope_deltas)
        for la, lb in zip(self._layers(), mini._layers(), strict=True):
            la.keys = combine(left(la.keys, -2), left(lb.keys, -2))
            la.values = combine(left(la.values, -2), left(lb.values, -2))
        self._merge_rows(mini, slots)
        for i, seq in zip(slots, mini.seqs, strict=False):
            self.seqs[i] = seq
        self.seqs.extend(mini.seqs[len(slots) :])
        # Drop the leading columns that are padding in every row (finished rows' history included).
        first = int((mask.cumsum(-1) == 0).sum(-1).min())
        if first > 0:
            self.input_ids = self.input_ids[:, first:]
            self.position_ids = self.position_ids[:, first:]
            mask = mask[:, first:]
            for layer in self._layers():
                layer.keys = layer.keys[..., first:, :]
                layer.values = layer.values[..., first:, :]
        self.attention_mask = mask
        self._reserve()

    def _merge_rows(self, mini: BatchRows, slots: list[int]) -> None:
        """``merge``'s per-row state beyond the decoder's (a subclass's): ``mini``'s rows into
        ``slots``, the rest appended (``combine_rows``)."""

    def _full_mask(self) -> torch.Tensor:
        """The 2D mask over ``input_ids`` columns (materialized when HF would pass None)."""
        if self.attention_mask is not None:
            return self.attention_mask
        return torch.ones(self.input_ids.shape, dtype=torch.long, device=self.device)


def combine_rows(a: torch.Tensor, b: torch.Tensor, slots: list[int]) -> torch.Tensor:
    """``a``'s rows with ``b``'s first rows put in ``slots`` (finished rows) and the rest of ``b``
    appended; both of one shape beyond the rows."""
    n = min(len(slots), b.shape[0])
    out = a.clone()
    if n:
        out[torch.tensor(slots[:n], dtype=torch.long, device=a.device)] = b[:n]
    return torch.cat([out, b[n:]], dim=0) if b.shape[0] > n else out
