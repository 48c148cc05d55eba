"""Input embeddings and LM head gathered in fixed-size row chunks, never whole.

A big-vocabulary model's embeddings and head are each bigger than a decoder layer
(Llama-3-8B: 2.4 layers each); gathered whole, they set the peak of per-layer generation.
In shardgen's own forwards (real or shadow) an ``nn.Embedding`` / bias-free ``nn.Linear``
over the vocabulary runs here instead, from its shard:

* Both backends partition such a weight *flat*: rank ``r`` holds row-major elements
  ``[r * P, r * P + P)`` (FSDP2: ``P = ceil(V / N)`` rows of ``H``, ``torch.chunk`` along
  dim 0; DeepSpeed ZeRO-3: ``P = ceil(V * H / N)`` elements), the last ranks padded.
* Chunk ``c`` is elements ``[c * E, c * E + E)`` of every rank's partition (the last chunk
  what is left), gathered on the weight's parameter group: with a pool (a CPU device),
  one broadcast per rank into its slice of a pooled buffer (``buffer_pool.gather_in_place``),
  else one ``all_gather_single`` of equal pieces; ``E`` is a whole number of rows sized so that a chunk's
  ``N * E`` elements hold at most ``chunk_bytes`` (default: half the largest decoder layer,
  as gloo gathers into a temporary and copies out, so a chunk briefly costs twice its
  size: at most what one layer's gather costs). The schedule (how many chunks,
  their sizes, their order) is a function of the weight's shape, dtype, the group size and
  ``chunk_bytes`` only: every rank issues the same gathers in the same order whatever its
  input, so a shadow forward (1x1 input) matches any real forward.
* From each chunk, the complete rows it holds are used where they belong: the embedding
  fills the positions whose ids fall in them (exact: a copy), the head computes their
  logits into its slice of the vocabulary. A row cut by a partition or chunk boundary
  (DeepSpeed, when ``P`` is not a multiple of ``H``) is assembled across chunks and used
  once complete, so every row is used whole, exactly once.

Peak gathered weight of these modules: one chunk, gathered into a buffer of the backend's
``buffer_pool.BufferPool`` (kept across forwards, emptied at pauses and close). Outside
shardgen's forwards (a training step in ``Engine.paused()``) the modules run their own
forward under the backend's hooks.
Nothing here issues a collective except :meth:`FlatWeight.gather` (and the forwards that
call it), as their docstrings say.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardgen.backends.buffer_pool import BufferPool, all_gather_single, gather_in_place
from shardgen.backends.lookups import looking_up, own_forward, stand_in
from shardgen.backends.parts import plain_type
from shardgen.log import get_logger

log = get_logger()


def chunk_rows(rows_per_rank: int, cols: int, itemsize: int, world: int, chunk_bytes: int) -> int:
    """Rows of each rank's partition per chunk: the most whose ``world`` pieces fit ``chunk_bytes``
    (at least one, at most the partition)."""
    per_row = max(1, world * cols * itemsize)
    return max(1, min(rows_per_rank, chunk_bytes // per_row))


class FlatWeight:
    """A 2-D weight partitioned flat over the ranks of ``group``.

    ``local()`` returns this rank's partition as a 1-D tensor of at most ``part`` elements
    (shorter when the backend stores it unpadded). Per-forward state: the rows being
    assembled across chunks; :meth:`for_each_rows` resets it.
    """

    def __init__(
        self,
        shape: tuple[int, int],
        part: int,
        local: Callable[[], torch.Tensor],
        group: Any,
        dtype: torch.dtype,
        chunk_bytes: int,
        world: int | None = None,
    ) -> None:
        self.rows, self.cols = int(shape[0]), int(shape[1])
        self.numel = self.rows * self.cols
        self.part = int(part)
        self.local = local
        self.group = group
        self.dtype = dtype
        self.world = world if world is not None else dist.get_world_size(group)
        self.itemsize = itemsize = torch.empty((), dtype=dtype).element_size()
        k = chunk_rows(-(-self.part // self.cols), self.cols, itemsize, self.world, chunk_bytes)
        self.piece = min(k * self.cols, self.part)  # E: elements per rank per chunk
        self.n_chunks = -(-self.part // self.piece)
        self._pending: dict[int, list[Any]] = {}
        #: Where the gathers write (``buffer_pool.BufferPool``: kept across forwards), or None
        #: (fresh tensors).
        self.pool: BufferPool | None = None

    def _empty(self, numel: int, device: torch.device) -> torch.Tensor:
        if self.pool is None:
            return torch.empty(numel, dtype=self.dtype, device=device)
        return self.pool.take(numel, self.dtype, device)

    def size(self, c: int) -> int:
        """Elements per rank in chunk ``c``: ``E``, the last one what is left of the partition."""
        return min(self.piece, self.part - c * self.piece)

    def gather(self, c: int, device: torch.device) -> torch.Tensor:
        """Chunk ``c`` of every rank's partition, ``(world * size(c),)``, rank-major. Collective on
        ``group``: every rank, for the same ``c``, in the same order (see :meth:`for_each_rows`)."""
        local = self.local()
        lo, size = c * self.piece, self.size(c)
        n = max(0, min(size, local.numel() - lo))
        pooled = None
        if n == size and local.device == device and local.is_contiguous():
            send = local.narrow(0, lo, n)
        else:  # padding (a rank past the rows), or a partition offloaded to another device
            send = pooled = self._empty(size, device)
            send[n:].zero_()
            if n:
                send[:n].copy_(local.narrow(0, lo, n))
        out = self._empty(self.world * size, device)
        if self.pool is not None:  # in place: no gloo temporary (buffer_pool.gather_in_place)
            gather_in_place(out, send, self.group).wait()
        else:
            all_gather_single()(out, send, group=self.group)
        if pooled is not None and self.pool is not None:
            self.pool.release(pooled)  # gathered: gloo is done with it
        return out

    def assemble(self, c: int, buf: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """The complete rows chunk ``c`` (gathered into ``buf``) yields: ``(first row, rows)``
        pairs, ``rows`` a ``(k, cols)`` view or an assembled row. Local."""
        cols, out, size = self.cols, [], self.size(c)
        for r in range(self.world):
            lo = r * self.part + c * self.piece
            hi = min(lo + size, (r + 1) * self.part, self.numel)
            if hi <= lo:
                continue
            piece = buf[r * size : r * size + (hi - lo)]
            first, last = -(-lo // cols), hi // cols  # rows [first, last) lie wholly in the piece
            if first < last:
                a = first * cols - lo
                out.append((first, piece[a : a + (last - first) * cols].view(last - first, cols)))
            frags = [(lo, first * cols), (last * cols, hi)] if first <= last else [(lo, hi)]
            for f_lo, f_hi in frags:
                if f_hi <= f_lo:
                    continue
                v = f_lo // cols
                row, filled = self._pending.get(v) or [
                    torch.empty(cols, dtype=buf.dtype, device=buf.device),
                    0,
                ]
                row[f_lo - v * cols : f_hi - v * cols] = piece[f_lo - lo : f_hi - lo]
                filled += f_hi - f_lo
                if filled == cols:
                    self._pending.pop(v, None)
                    out.append((v, row.view(1, cols)))
                else:
                    self._pending[v] = [row, filled]
        return out

    def for_each_rows(self, device: torch.device, fn: Callable[[int, torch.Tensor], None]) -> None:
        """Gather the chunks in order and call ``fn(first_row, rows)`` for each complete block of
        rows; ``fn`` must not keep ``rows`` (a view of the chunk, released before the next
        gather, which reuses its pooled buffer: one chunk alive at a time). Collective on
        ``group``: ``n_chunks`` gathers, chunk 0 first, whatever ``fn`` does; every rank calls it."""
        self._pending = {}
        for c in range(self.n_chunks):
            buf = self.gather(c, device)
            blocks = self.assemble(c, buf)
            while blocks:
                fn(*blocks.pop(0))
            if self.pool is not None:
                self.pool.release(buf)  # its rows are used (the assembled ones are copies)
        assert not self._pending, f"rows left incomplete: {sorted(self._pending)[:4]}"


def embedding_forward(weight: FlatWeight, ids: torch.Tensor) -> torch.Tensor:
    """``F.embedding(ids, W)`` from the chunks of ``W``. Collective (``weight.for_each_rows``)."""
    flat = ids.reshape(-1)
    out = torch.zeros((flat.numel(), weight.cols), dtype=weight.dtype, device=ids.device)

    def fill(first: int, block: torch.Tensor) -> None:
        hit = ((flat >= first) & (flat < first + block.shape[0])).nonzero().squeeze(1)
        if hit.numel():
            out[hit] = block[flat[hit] - first]

    weight.for_each_rows(ids.device, fill)
    return out.view(*ids.shape, weight.cols)


def linear_forward(weight: FlatWeight, x: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, W)`` (no bias) from the chunks of ``W``: each chunk's rows make their slice of
    the output. Collective (``weight.for_each_rows``)."""
    out: list[torch.Tensor] = []

    def project(first: int, block: torch.Tensor) -> None:
        part = F.linear(x, block)
        if not out:
            out.append(part.new_empty((*x.shape[:-1], weight.rows)))
        out[0][..., first : first + block.shape[0]] = part

    weight.for_each_rows(x.device, project)
    return out[0]


class ChunkedModules:
    """The chunked embedding / head of one model, swapped in around shardgen's forwards.

    ``weights``: ``name -> (module, FlatWeight)``; ``hook_ids``: the ids of the backend's
    hooks on those modules (its gathers), set aside while a chunked forward runs.
    """

    def __init__(self, weights: dict[str, tuple[nn.Module, FlatWeight]], hook_ids: set[int]) -> None:
        self.weights = weights
        self.hook_ids = hook_ids

    @property
    def modules(self) -> list[nn.Module]:
        return [m for m, _ in self.weights.values()]

    def max_chunk_bytes(self) -> int:
        """Bytes of the largest chunk gathered (all ranks' pieces)."""
        return max(w.world * w.piece * w.itemsize for _, w in self.weights.values())

    def describe(self) -> dict[str, int]:
        """Gathers per forward of each chunked module (tests, logs)."""
        return {name: w.n_chunks for name, (_, w) in self.weights.items()}

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Around one of shardgen's forwards: the modules compute from chunks, their backend hooks
        (whole-unit gathers) set aside; other hooks (instrumentation) keep their order. Local."""
        saved: list[tuple[nn.Module, str, Any]] = []
        for module, weight in self.weights.values():
            if isinstance(module, nn.Embedding) and plain_type(module) is not nn.Embedding:
                module.forward = _own_forward_chunked(module, weight)  # type: ignore[method-assign]
            else:
                fn = embedding_forward if isinstance(module, nn.Embedding) else linear_forward
                module.forward = lambda x, *_a, _fn=fn, _w=weight, **_k: _fn(_w, x)  # type: ignore[method-assign]
            for attr in ("_forward_pre_hooks", "_forward_hooks"):
                d = getattr(module, attr)
                if any(k in self.hook_ids for k in d):
                    saved.append((module, attr, d))
                    setattr(module, attr, OrderedDict((k, v) for k, v in d.items() if k not in self.hook_ids))
        try:
            yield
        finally:
            for module, attr, d in saved:
                setattr(module, attr, d)
            for module, _ in self.weights.values():
                del module.forward


def _own_forward_chunked(module: nn.Module, weight: FlatWeight) -> Callable[..., Any]:
    """An embedding subclass's own forward, its weight a stand-in and each lookup of it
    :func:`embedding_forward` (``lookups.py``). Collective as ``embedding_forward``, once per lookup
    (the probe of ``parts.io_embeddings`` saw at least one and no other use of the weight)."""
    orig = own_forward(module)
    name = type(module).__name__

    def other(func: Any, *_: Any) -> Any:
        raise RuntimeError(
            f"{name} used its weight in {getattr(func, '__name__', func)}; only lookups are chunked"
        )

    def forward(*args: Any, **kwargs: Any) -> Any:
        device = next((a.device for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        w = stand_in((weight.rows, weight.cols), weight.dtype, device)
        with looking_up(module, w, lambda ids: embedding_forward(weight, ids), other):
            return orig(*args, **kwargs)

    return forward


def hook_ids(handles: list[Any]) -> set[int]:
    """Ids of ``RemovableHandle`` s (or handles grouping several in ``.handles``)."""
    out: set[int] = set()
    for h in handles:
        for one in getattr(h, "handles", None) or (h,):
            if one is not None and hasattr(one, "id"):
                out.add(one.id)
    return out


def chunk_budget(chunk_bytes: int | None, layer_bytes: int) -> int | None:
    """Bytes of full weight per chunk: ``chunk_bytes`` as set, None (gather whole) when it is 0,
    and by default half the largest decoder layer (``layer_bytes``): gloo gathers into a
    temporary it copies out of, so a chunk costs twice its size at the peak."""
    if chunk_bytes == 0:
        return None
    return chunk_bytes if chunk_bytes is not None else max(1, layer_bytes // 2)


def chunked_modules(
    weights: dict[str, tuple[nn.Module, FlatWeight]], hooks: set[int], budget: int, pool: BufferPool | None
) -> ChunkedModules | None:
    """The backend's :class:`ChunkedModules`, logged once; None when no module can be chunked. The
    chunks are gathered into ``pool``'s buffers when it is given."""
    if not weights:
        return None
    for _, weight in weights.values():
        weight.pool = pool
    chunked = ChunkedModules(weights, hooks)
    log.info("gathering %s in row chunks of <= %.2f MB", chunked.describe(), budget / 2**20)
    return chunked


def active(chunked: ChunkedModules | None) -> contextlib.AbstractContextManager:
    """``chunked.active()``, or nothing to do when the backend chunks nothing."""
    return chunked.active() if chunked is not None else contextlib.nullcontext()
