"""What a forward's collectives cost, per gather policy: the layout's count, and a time estimate.

For a stationary forward (:func:`stationary_cost`) the count is exact, computed from the layout
and the agreed token counts: collectives issued, elements in their output buffers on a rank
(what a recorder of ``torch.distributed`` calls sees: tests/multirank/test_stationary.py checks it), and
bytes each rank receives from others. A model with towers: the exchanges sized at the call (a
tower's, an encoder-decoder's cross-attention) are left out, their counts not being agreed.
A per-layer forward moves every unit's full weights (the backends' ``per_layer_cost``).
``auto`` compares :meth:`Cost.seconds` of both with one link model per device type
(:data:`LINKS`), from the tick's agreed state only, so every rank makes the same choice. Pure
functions; no collective.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardgen.backends.stationary.layout import Layout


@dataclass(frozen=True)
class Link:
    """A collective's fixed cost (s) and the bytes per second a rank receives."""

    latency: float
    bandwidth: float


#: Measured on the 2-core CPU machine of docs/PERFORMANCE.md (gloo, 2 ranks): about 1 ms per
#: collective, about 0.3 GB/s into a rank. CUDA: NCCL over NVLink, orders of magnitude (not
#: measured here).
LINKS = {"cpu": Link(1.0e-3, 0.3e9), "cuda": Link(30e-6, 100e9)}


def link_for(device: torch.device) -> Link:
    return LINKS.get(torch.device(device).type, LINKS["cuda"])


@dataclass
class Cost:
    collectives: int = 0
    elements: int = 0  # elements of the collectives' output buffers on this rank
    wire_bytes: int = 0  # bytes received from other ranks by the rank that receives most

    def seconds(self, link: Link) -> float:
        return self.collectives * link.latency + self.wire_bytes / link.bandwidth


def _isz(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def stationary_cost(layout: Layout, shapes: list[tuple[int, int]], rank: int) -> Cost:
    """The collectives of one stationary forward after the first (kept parameters and cut rows
    already held), for rank ``rank``, given every rank's agreed ``(tokens, head_rows)``."""
    world = len(shapes)
    cost = Cost()
    if world == 1:
        return cost
    # "free" (a tower's modules, sized at the call): not in the agreed shapes, left out (a
    # tower runs in few forwards: a prefill's with an image, a request's first)
    counts = {"body": [t for t, _ in shapes], "rows": [r for _, r in shapes], "free": [0] * world}
    wire = [0] * world
    for group in layout.groups:
        lead = group[0]
        c = counts[lead.rule]
        calls, cols, isz = max(lead.calls, 0), int(lead.shard.shape[1]), _isz(lead.shard.dtype)
        widths = [sum(b - a for a, b in (s.shard.row_ranges()[r] for s in group)) for r in range(world)]
        for _ in range(calls):
            if max(c):  # the inputs: each rank receives every other rank's rows
                cost.collectives += 1
                cost.elements += (sum(c) - c[rank]) * cols
                for r in range(world):
                    wire[r] += (sum(c) - c[r]) * cols * isz
            if sum(c):
                cost.collectives += 1
                cost.elements += c[rank] * sum(widths)
                for r in range(world):
                    wire[r] += c[r] * (sum(widths) - widths[r]) * isz
    for emb in layout.embeddings.values():
        c, cols, isz = counts[emb.rule], int(emb.shard.shape[1]), _isz(emb.shard.dtype)
        for _ in range(emb.calls):
            if max(c):
                cost.collectives += 2
                cost.elements += sum(c) - c[rank] + c[rank] * cols
                for r in range(world):
                    wire[r] += (sum(c) - c[r]) * 8 + c[r] * cols * isz  # at most all its rows
    for fb in layout.fallbacks.values():
        by_dtype: dict[torch.dtype, list[int]] = {}
        for ref in fb.refs:
            sizes = by_dtype.setdefault(ref.shard.dtype, [0] * world)
            for r in range(world):
                sizes[r] += ref.shard.sizes[r]
        for _ in range(fb.calls):
            for dtype, sizes in by_dtype.items():
                if max(sizes):
                    cost.collectives += 1
                    cost.elements += world * max(sizes)
                    for r in range(world):
                        wire[r] += (world - 1) * max(sizes) * _isz(dtype)
    cost.wire_bytes = max(wire)
    return cost


def gathered_cost(collectives: int, full_bytes: int, world: int) -> Cost:
    """A forward that all-gathers ``full_bytes`` of full weights in ``collectives`` collectives
    (per-layer): each rank receives the other ranks' ``(world - 1) / world`` of them."""
    if world == 1:
        return Cost()
    return Cost(collectives, 0, full_bytes * (world - 1) // world)
