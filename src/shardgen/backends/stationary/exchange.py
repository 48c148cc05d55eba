"""The two exchanges of a weight-stationary linear, and the one of an embedding lookup.

Rank ``r`` holds ``T_r`` tokens of a forward (agreed in the tick: every rank knows every
``T_r``) and owns rows ``[a_r, b_r)`` of each weight. For a linear (or several that read the
same input, like q/k/v):

1. :func:`gather_rows` (or :func:`start_gather`, which returns before the rows arrive):
   every rank gets every rank's input rows, ``X = [T, in]`` (``T = sum T_r``): one
   ``all_to_all_single`` in which each rank sends its ``[T_r, in]`` rows to every other rank;
2. each rank computes its own columns ``Y_r = X @ W[a_r:b_r].T`` for every token;
3. :func:`return_columns`: one ``all_to_all_single`` in which rank ``s`` sends rank ``r`` the
   block ``Y_s[tokens of r]`` (``T_r x o_s``) and receives its own tokens' columns from every
   rank, which :func:`split_columns` cuts back into each linear's full ``[T_r, out]``.

Every output element is one whole row's dot product with one token's input, computed once, by
the row's owner. A rank with no tokens (a shadow forward) contributes zero rows and still
computes its columns for the others, in the same collectives.

An embedding lookup (:func:`lookup_rows`): the ids are gathered like inputs, each owner
copies the rows of the ids it owns, and one ``all_to_all_single`` brings each rank exactly its
tokens' rows; the split sizes (how many of ``r``'s tokens rank ``s`` owns) follow from the
gathered ids, which every rank holds.

Each function here is collective on ``group`` (its docstring says which calls); every rank of
the group calls the same sequence, which the module call order of the forward fixes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from shardgen.backends.buffer_pool import all_gather_single


def gather_counts(n: int, rank: int, world: int, group: Any, device: torch.device) -> list[int]:
    """Every rank's ``n`` (a token count no agreed shape gives: a tower's), in rank order.

    Collective on ``group``: one all-gather of one integer per rank (none in a group of one
    rank); every rank calls it at the same module call of the same forward."""
    if world == 1:
        return [n]
    out = torch.empty(world, dtype=torch.int64, device=device)
    all_gather_single()(out, torch.tensor([n], dtype=torch.int64, device=device), group=group)
    return [int(c) for c in out.tolist()]


def gather_rows(x: torch.Tensor, counts: list[int], rank: int, group: Any) -> torch.Tensor:
    """``[sum(counts), k]``: every rank's rows of ``x`` (``[counts[rank], k]`` here), in rank order.

    Collective on ``group``: one ``all_to_all_single`` (:func:`start_gather`; none in a group of
    one rank, or when no rank has a token: every rank knows both)."""
    parts = start_gather(x, counts, rank, group).wait()
    return parts[0] if len(parts) == 1 else torch.cat(parts)


class Gathering:
    """The handle of :func:`start_gather`: ``wait()`` returns each rank's rows, in rank order
    (the ranks with none left out; this rank's own are its input, never copied)."""

    def __init__(
        self, work: Any, got: torch.Tensor | None, x: torch.Tensor, counts: list[int], rank: int
    ) -> None:
        self.work, self.got, self.x, self.counts, self.rank = work, got, x, counts, rank

    def wait(self) -> list[torch.Tensor]:
        if self.work is not None:
            self.work.wait()
            self.work = None
        k, parts, pos = self.x.shape[-1], [], 0
        for r, c in enumerate(self.counts):
            if not c:
                continue
            if r == self.rank:
                parts.append(self.x)
            else:
                assert self.got is not None
                parts.append(self.got[pos : pos + c * k].view(c, k))
                pos += c * k
        return parts


def start_gather(x: torch.Tensor, counts: list[int], rank: int, group: Any) -> Gathering:
    """:func:`gather_rows` issued without waiting (``async_op``): this rank can compute with its
    own rows while the others' arrive.

    Collective on ``group``: one ``all_to_all_single`` in which every rank sends its rows to
    every other rank and receives exactly theirs (uneven counts need no padding; gloo's all-gather
    would also allocate an output-sized temporary per call), skipped in a group of one rank or
    when no rank has a token (every rank knows both)."""
    world, k = len(counts), x.shape[-1]
    if world == 1 or max(counts) == 0:
        return Gathering(None, None, x, counts, rank)
    mine = counts[rank]
    send = x.contiguous().view(-1)
    if world > 2 and mine:
        send = send.repeat(world - 1)  # one copy of this rank's rows for each other rank
    got = x.new_empty((sum(counts) - mine) * k)
    work = dist.all_to_all_single(
        got,
        send,
        output_split_sizes=[0 if r == rank else c * k for r, c in enumerate(counts)],
        input_split_sizes=[0 if r == rank else mine * k for r in range(world)],
        group=group,
        async_op=True,
    )
    return Gathering(work, got, x, counts, rank)


def return_columns(
    y: torch.Tensor, counts: list[int], widths: list[int], rank: int, group: Any
) -> list[torch.Tensor]:
    """This rank's tokens' columns from every rank: ``[counts[rank], widths[s]]`` per rank ``s``.

    ``y``: ``[sum(counts), widths[rank]]``, this rank's columns for every token (rank order).
    Collective on ``group``: one ``all_to_all_single`` (none in a group of one rank or when no
    rank has a token: every rank knows)."""
    world, mine = len(counts), counts[rank]
    if world == 1:
        return [y]
    if sum(counts) == 0:
        return [y.new_zeros((0, w)) for w in widths]
    out = y.new_empty(mine * sum(widths))
    dist.all_to_all_single(
        out,
        y.contiguous().view(-1),
        output_split_sizes=[mine * w for w in widths],
        input_split_sizes=[c * widths[rank] for c in counts],
        group=group,
    )
    blocks, pos = [], 0
    for w in widths:
        blocks.append(out[pos : pos + mine * w].view(mine, w))
        pos += mine * w
    return blocks


def split_columns(blocks: list[torch.Tensor], parts: list[list[int]]) -> list[torch.Tensor]:
    """Cut the per-rank blocks of a shared exchange back into each linear's output.

    ``parts[s]``: the widths of rank ``s``'s columns of each linear, in the group's order
    (so ``sum(parts[s]) == blocks[s].shape[1]``). Returns, per linear, ``[T_r, out]``: the
    columns of every rank side by side (rank order is row order). Local."""
    n_lin = len(parts[0])
    if n_lin == 1:
        return [blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=1)]
    cols: list[list[torch.Tensor]] = [[] for _ in range(n_lin)]
    for block, widths in zip(blocks, parts, strict=True):
        pos = 0
        for i, w in enumerate(widths):
            if w:
                cols[i].append(block[:, pos : pos + w])
            pos += w
    return [torch.cat(c, dim=1) if len(c) > 1 else c[0].contiguous() for c in cols]


def lookup_rows(
    ids: torch.Tensor,
    counts: list[int],
    ranges: list[tuple[int, int]],
    rows: list[tuple[int, torch.Tensor]],
    cols: int,
    dtype: torch.dtype,
    rank: int,
    group: Any,
) -> torch.Tensor:
    """``F.embedding(ids, W)`` for this rank's ``ids`` (``[counts[rank]]``), ``W``'s rows
    ``ranges[r]`` owned by rank ``r`` and held here as ``rows`` (``(first row, block)`` pairs).

    Collective on ``group``: :func:`gather_rows` of the ids, then one ``all_to_all_single`` of
    exactly the rows each rank asked for (both skipped in a group of one rank)."""
    world = len(counts)
    device = ids.device
    if world == 1:
        return _fill(ids, rows, cols, dtype)
    every = gather_rows(ids.view(-1, 1), counts, rank, group).view(-1)
    bounds = torch.tensor([b for _, b in ranges], device=device)
    owner = torch.bucketize(every, bounds, right=True).clamp_(max=world - 1)  # rank owning each id
    starts = [sum(counts[:r]) for r in range(world)]
    # Rows this rank sends to each rank r: r's tokens whose id it owns, in token order.
    mine = owner == rank
    send_idx = mine.nonzero().view(-1)
    send = _fill(every[send_idx], rows, cols, dtype)
    in_splits = [int(mine[s : s + c].sum()) * cols for s, c in zip(starts, counts, strict=True)]
    me = slice(starts[rank], starts[rank] + counts[rank])
    from_rank = owner[me]
    out_splits = [int((from_rank == s).sum()) * cols for s in range(world)]
    recv = send.new_empty(counts[rank] * cols)
    dist.all_to_all_single(
        recv, send.view(-1), output_split_sizes=out_splits, input_split_sizes=in_splits, group=group
    )
    # recv holds, rank by rank, the rows of this rank's tokens that rank owns, in token order.
    order = torch.argsort(from_rank, stable=True)
    out = recv.new_empty((counts[rank], cols))
    out[order] = recv.view(-1, cols)
    return out


def _fill(
    ids: torch.Tensor, rows: list[tuple[int, torch.Tensor]], cols: int, dtype: torch.dtype
) -> torch.Tensor:
    """Rows ``ids`` (all owned here) copied from the owned blocks. Local."""
    out = torch.zeros((ids.numel(), cols), dtype=dtype, device=ids.device)
    for first, block in rows:
        hit = ((ids >= first) & (ids < first + block.shape[0])).nonzero().view(-1)
        if hit.numel():
            out[hit] = block[ids[hit] - first].to(dtype)
    return out
