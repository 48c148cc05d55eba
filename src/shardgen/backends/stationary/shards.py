"""Where each rank's elements of a sharded parameter lie, and the gathers that read them.

Both backends leave each rank a contiguous run of the parameter's row-major elements, in rank
order (:class:`FlatShard`):

* FSDP2 shards dim 0 with ``torch.chunk`` semantics: ``c = ceil(d0 / N)`` rows per rank, the
  last ranks short or empty (:func:`dim0_layout`);
* DeepSpeed ZeRO-3 partitions the flattened parameter: ``P = ceil(numel / N)`` elements per
  rank (``ds_tensor``), the last one padded (:func:`flat_layout`).

For a 2-D weight ``[out, in]`` a row belongs to the rank holding its first element
(:func:`row_ranges`): rank ``r`` owns rows ``[a_r, b_r)``. Under FSDP2 every owned row lies
whole in the owner's shard. Under DeepSpeed the last owned row may run past the end of the
owner's partition into the next ranks' (a *cut* row): its tail is the *leading fragment* of
those ranks, the elements before their own first row. :func:`gather_pieces` fetches such
pieces (cut-row fragments, or whole small parameters) for many parameters in one collective.

Nothing here issues a collective except :func:`gather_pieces` and :func:`gather_full`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from shardgen.backends.buffer_pool import all_gather_single


@dataclass
class FlatShard:
    """One parameter as the ranks of its group hold it: rank ``r`` has global flat elements
    ``[starts[r], starts[r] + sizes[r])`` (a contiguous run; the runs cover the parameter in rank
    order). ``local()`` returns this rank's run as a 1-D tensor on the compute device, possibly
    longer (padding). ``dtype``: the dtype forwards compute in."""

    shape: tuple[int, ...]
    starts: list[int]
    sizes: list[int]
    local: Callable[[], torch.Tensor]
    dtype: torch.dtype
    rank: int
    key: Any = None  # identity of the parameter (tied weights share one)
    _rows: list[tuple[int, int]] | None = field(default=None, repr=False)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= int(s)
        return n

    @property
    def world(self) -> int:
        return len(self.sizes)

    def row_ranges(self) -> list[tuple[int, int]]:
        """``(a_r, b_r)`` per rank: the rows each rank owns (a 2-D weight)."""
        if self._rows is None:
            self._rows = row_ranges(self.shape, self.starts, self.sizes)
        return self._rows

    def fragment(self, r: int) -> int:
        """Elements at the start of rank ``r``'s run that belong to a row owned by an earlier rank."""
        cols = int(self.shape[1])
        if self.sizes[r] == 0:
            return 0
        a, _ = self.row_ranges()[r]
        return min(self.sizes[r], a * cols - self.starts[r])

    def cut(self, r: int) -> bool:
        """Whether rank ``r``'s last owned row runs past the end of its run."""
        a, b = self.row_ranges()[r]
        return b > a and b * int(self.shape[1]) > self.starts[r] + self.sizes[r]

    @property
    def has_cut_rows(self) -> bool:
        return any(self.cut(r) for r in range(self.world))


def dim0_layout(shape: tuple[int, ...], world: int) -> tuple[list[int], list[int]]:
    """(starts, sizes) of a tensor sharded along dim 0 like FSDP2 (``torch.chunk``, empty chunks
    padded in)."""
    d0 = int(shape[0])
    rest = 1
    for s in shape[1:]:
        rest *= int(s)
    c = -(-d0 // world) if d0 else 0
    rows = [max(0, min(c, d0 - r * c)) for r in range(world)]
    starts = [min(r * c, d0) * rest for r in range(world)]
    return starts, [n * rest for n in rows]


def flat_layout(numel: int, part: int, world: int) -> tuple[list[int], list[int]]:
    """(starts, sizes) of a flat partition of ``part`` elements per rank (DeepSpeed ZeRO-3)."""
    starts = [min(r * part, numel) for r in range(world)]
    return starts, [max(0, min(part, numel - r * part)) for r in range(world)]


def row_ranges(shape: tuple[int, ...], starts: list[int], sizes: list[int]) -> list[tuple[int, int]]:
    """Rows ``[a_r, b_r)`` owned by each rank: those whose first element rank ``r`` holds."""
    out_rows, cols = int(shape[0]), int(shape[1])
    ranges = []
    for s, n in zip(starts, sizes, strict=True):
        a = min(out_rows, -(-s // cols))
        b = min(out_rows, -(-(s + n) // cols)) if n else a
        ranges.append((a, max(a, b)))
    return ranges


def gather_pieces(
    items: list[tuple[list[int], torch.Tensor | None]],
    group: Any,
    rank: int,
    world: int,
    device: torch.device,
    dtypes: list[torch.dtype],
) -> list[list[torch.Tensor]]:
    """Every rank's piece of every item: ``items[i] = (sizes per rank, this rank's piece)`` (a 1-D
    tensor of at least ``sizes[rank]`` elements, or None when that is 0); ``dtypes[i]`` its dtype.
    Returns, per item, the ``world`` pieces (views of one buffer per dtype).

    Collective on ``group``: one all-gather (``all_gather_single``) per distinct dtype, in the order the
    dtypes first appear in ``items``. Every rank calls it with the same sizes and dtypes (they
    are functions of the parameters' shapes and the group size only), in the same order."""
    out: list[list[torch.Tensor]] = [[] for _ in items]
    order = list(dict.fromkeys(dtypes))
    for dtype in order:
        idx = [i for i, d in enumerate(dtypes) if d == dtype]
        width = max(sum(items[i][0][r] for i in idx) for r in range(world))
        send = torch.zeros(width, dtype=dtype, device=device)
        pos = 0
        for i in idx:
            n = items[i][0][rank]
            if n:
                send[pos : pos + n].copy_(items[i][1][:n])
            pos += n
        if world > 1 and width:
            buf = torch.empty(world * width, dtype=dtype, device=device)
            all_gather_single()(buf, send, group=group)
        else:
            buf = send
        for r in range(world):
            pos = r * width
            for i in idx:
                n = items[i][0][r]
                out[i].append(buf[pos : pos + n])
                pos += n
    return out


def gather_full(shards: list[FlatShard], group: Any, device: torch.device) -> list[torch.Tensor]:
    """The full value of each parameter (a new tensor each, in its compute dtype).

    Collective on ``group``: :func:`gather_pieces` (one all-gather per dtype); every rank, same
    list in the same order."""
    if not shards:
        return []
    rank, world = shards[0].rank, shards[0].world
    items = [(s.sizes, s.local() if s.sizes[rank] else None) for s in shards]
    pieces = gather_pieces(items, group, rank, world, device, [s.dtype for s in shards])
    full = []
    for s, parts in zip(shards, pieces, strict=True):
        flat = torch.cat([p for p in parts if p.numel()]) if s.numel else parts[0][:0]
        full.append(flat.view(s.shape))
    return full


class CutRows:
    """The rows of 2-D weights whose elements span ranks (DeepSpeed), assembled whole on their
    owners and kept until :meth:`clear` (a pause may change the weights)."""

    def __init__(self, shards: list[FlatShard]) -> None:
        self.shards = [s for s in shards if s.has_cut_rows]
        self.rows: dict[int, torch.Tensor] | None = None  # id(shard) -> [1, in] row of this rank

    def clear(self) -> None:
        self.rows = None

    def ensure(self, group: Any, device: torch.device) -> None:
        """Assemble this rank's cut rows unless kept. Collective on ``group`` when not kept (one
        all-gather per dtype of every rank's leading fragments: :func:`gather_pieces`); every rank
        calls it at the same point, and all hold or lack their rows together."""
        if self.rows is not None:
            return
        self.rows = {}
        if not self.shards:
            return
        rank, world = self.shards[0].rank, self.shards[0].world
        items = []
        for s in self.shards:
            sizes = [s.fragment(r) for r in range(world)]
            items.append((sizes, s.local() if sizes[rank] else None))
        pieces = gather_pieces(items, group, rank, world, device, [s.dtype for s in self.shards])
        for s, parts in zip(self.shards, pieces, strict=True):
            if not s.cut(rank):
                continue
            cols = int(s.shape[1])
            _, b = s.row_ranges()[rank]
            first = (b - 1) * cols  # the cut row's first element (this rank holds it)
            own = s.local()[first - s.starts[rank] : s.sizes[rank]]
            tail, need = [], cols - own.numel()
            for r in range(rank + 1, world):
                if need <= 0:
                    break
                tail.append(parts[r][:need])
                need -= tail[-1].numel()
            self.rows[id(s)] = torch.cat([own.to(s.dtype), *tail]).view(1, cols)


def local_rows(shard: FlatShard, cut: CutRows) -> list[tuple[int, torch.Tensor]]:
    """This rank's owned rows of a 2-D weight as ``(first row, [k, in] block)`` pairs: a view of the
    whole rows in its run, then the assembled cut row if any. Local (``cut`` ensured first)."""
    cols = int(shard.shape[1])
    rank = shard.rank
    a, b = shard.row_ranges()[rank]
    if b == a:
        return []
    last_whole = b - 1 if shard.cut(rank) else b
    blocks = []
    if last_whole > a:
        lo = a * cols - shard.starts[rank]
        blocks.append((a, shard.local()[lo : lo + (last_whole - a) * cols].view(last_whole - a, cols)))
    if last_whole < b:
        assert cut.rows is not None, "cut rows used before they were assembled"
        blocks.append((b - 1, cut.rows[id(shard)]))
    return blocks
