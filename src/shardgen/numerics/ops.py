"""Batch-invariant ops: each row's result depends on that row's own values alone.

What makes an op's result for one row change with the rest of the batch is the kernel, not the
arithmetic: a matmul kernel picks its path by the row count (on this CPU, one row takes a GEMV
whose sums run in another order than a GEMM's), attention's kernel splits the keys by the
batch's column count and reaches a row's keys at an offset set by its left padding, and an
elementwise transcendental takes a vector path or a scalar one by the element's place in the
tensor (two implementations that may round differently). Each op here removes that freedom:

- ``linear``: the rows go through the matmul in tiles of exactly ``TILE_ROWS`` rows (the last
  one zero-padded), every tile one call of the same shape into a fresh buffer, and the output
  features padded to a multiple of ``COLUMN_MULTIPLE`` (a weight's shard, a single cut row of
  ``gather="stationary"``). Whether an output is the same at every position of a tile and in
  every width is the kernel's; ``check_tiles`` measures it once per shape and dtype on the
  running machine and refuses a kernel for which it is not.
- ``attention``: each row's visible keys are first moved to the front in order (so its key
  ``i`` is its ``i``-th visible key in any batch, whatever the padding), then scored and summed
  in blocks of ``KEY_BLOCK`` keys: scores and weighted values by tile matmuls of one shape,
  each block's sum over its keys in one fixed-length reduction, and the blocks added one after
  another (``cumsum``), so the blocks past a row's last key add exact zeros. The same query gets
  the same bits in a prefill, a chunk, a decode step and a trainer's causal forward.
- transcendentals (``exp``, ``sigmoid``, ``silu``, ``tanh``, ``gelu``, ``cos``, ``sin``): computed
  in float64 and rounded once to the input's dtype, so any two float64 implementations (vector,
  scalar, another CPU) give the same float32 or bfloat16 result except where the float64 value
  falls within one float64 rounding of a float32 tie (about 1 in 2^29).

Everything here is plain torch, differentiable: a trainer's backward runs through it.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

#: Rows per matmul call of a linear, the smallest tile (a decode step's rows fit one or two).
TILE_ROWS = 16
#: The tile sizes a linear's rows are cut into, largest first: each used only where the kernel
#: gives every row of it the bits a ``TILE_ROWS``-row tile gives (measured: ``check_tiles``), so
#: that a batch of 32 decode rows is one call and a long forward few.
TILE_SIZES = (256, 128, 64, 32, TILE_ROWS)
#: A linear's output features are zero-padded to a multiple of this: narrower products take
#: another kernel (on this CPU, fp32 products of up to 9 columns sum in another order).
COLUMN_MULTIPLE = 16
#: Keys per attention block (a row's keys are summed block by block, in order).
KEY_BLOCK = 32
#: Queries per attention tile: 4 where a call has few (a decode step's grouped queries), else 16;
#: both used only where the kernel gives a query the same bits in either (``check_blocks``).
QUERY_TILES = (16, 4)


@dataclass(frozen=True)
class TileCheck:
    """What ``check_tiles`` measured for one shape: why it is refused (None: served), and the
    tile sizes that give every row the bits a ``TILE_ROWS``-row tile gives it."""

    why: str | None
    sizes: tuple[int, ...]


_checked: dict[tuple, Any] = {}
_lock = threading.Lock()


def _mm_rows(buf: torch.Tensor, wt: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
    """``buf`` ``[M, K]`` (M a multiple of ``TILE_ROWS``, a fresh buffer) ``@ wt`` ``[K, N]``, the
    rows cut into tiles of ``sizes`` (largest first), each tile one call of its shape."""
    m = buf.shape[0]
    out = buf.new_empty(m, wt.shape[1])
    i = 0
    for size in sizes:
        if size == TILE_ROWS and buf.dtype == torch.float32 and m - i > TILE_ROWS:
            tiles = buf[i:].view(-1, TILE_ROWS, buf.shape[1])  # one call (bf16 bmm is slow on CPU)
            out[i:] = torch.bmm(tiles, wt.expand(tiles.shape[0], *wt.shape)).view(-1, wt.shape[1])
            return out
        while i + size <= m:
            torch.mm(buf[i : i + size], wt, out=out[i : i + size])
            i += size
    assert i == m, (i, m, sizes)
    return out


def _padded_rows(x2: torch.Tensor, multiple: int) -> torch.Tensor:
    """``x2`` ``[M, K]`` copied into a fresh buffer, zero rows appended up to a multiple of
    ``multiple``: every tile then starts at the same alignment in every call."""
    pad = (-x2.shape[0]) % multiple
    return torch.cat([x2, x2.new_zeros(pad, x2.shape[1])])


def _cached(key: tuple, measure: Callable[[], Any]) -> Any:
    with _lock:
        if key in _checked:
            return _checked[key]
    got = measure()
    with _lock:
        _checked[key] = got
    return got


def _rand(g: torch.Generator, dtype: torch.dtype, device: torch.device, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)


def check_tiles(k: int, n: int, dtype: torch.dtype, device: torch.device) -> TileCheck:
    """Measure, once per (k, n, dtype, device) in this process and on random values, whether this
    machine's matmul gives an output of ``[TILE_ROWS, k] x [k, n]`` the same bits at every
    position of the tile, whatever its neighbours, in a narrow product of its columns alone, and
    in which larger tiles of ``TILE_SIZES`` it gets those bits too."""

    def measure() -> TileCheck:
        g = torch.Generator().manual_seed(k * 7919 + n)
        wt, row = _rand(g, dtype, device, n, k).t(), _rand(g, dtype, device, k)
        tile = _rand(g, dtype, device, TILE_ROWS, k)
        shape = f"this machine's {dtype} matmul of [{TILE_ROWS}, {k}] x [{k}, {n}] on {device.type}"
        wide = torch.mm(tile, wt)
        for c in sorted({0, (n // 2) // COLUMN_MULTIPLE * COLUMN_MULTIPLE, n - COLUMN_MULTIPLE}):
            narrow = torch.mm(tile, wt[:, c : c + COLUMN_MULTIPLE])  # the narrowest product it makes
            if not torch.equal(wide[:, c : c + COLUMN_MULTIPLE], narrow):
                return TileCheck(f"{shape} gives columns {c}.. other bits than their own product", ())
        ref = None
        for j in range(TILE_ROWS):
            buf = _rand(g, dtype, device, 2 * TILE_ROWS, k)
            buf[TILE_ROWS + j] = row
            got = _mm_rows(buf, wt, (TILE_ROWS,))[TILE_ROWS + j]
            ref = got if ref is None else ref
            if not torch.equal(got, ref) or not torch.equal(torch.mm(buf[TILE_ROWS:], wt)[j], ref):
                return TileCheck(f"{shape} gives a row other bits at position {j} of a tile than at 0", ())
        sizes = [TILE_ROWS]
        for size in TILE_SIZES[:-1]:
            ok = True
            for j in (0, size // 2 + 1, size - 1):
                buf = _rand(g, dtype, device, size, k)
                buf[j] = row
                ok = ok and torch.equal(torch.mm(buf, wt)[j], ref)
            if ok:
                sizes.append(size)
        return TileCheck(None, tuple(sorted(sizes, reverse=True)))

    return _cached((k, n, dtype, device.type), measure)


def check_blocks(rows: int, k: int, n: int, device: torch.device) -> str | None:
    """Why this machine's float32 batched matmul of ``[rows, k] x [k, n]`` items (attention's
    tiles) gives an output other bits by its item, row or column position, or than an item of
    ``QUERY_TILES[-1]`` rows gives the same values (None: it does not)."""

    def measure() -> str | None:
        g = torch.Generator().manual_seed(rows * 131 + k * 7919 + n)
        small = QUERY_TILES[-1]
        a, b = _rand(g, torch.float32, device, small, k), _rand(g, torch.float32, device, k, n)
        ref = torch.bmm(a[None], b[None])[0, 0, 0]
        for item, r, c in ((0, 0, 0), (2, rows - 1, n - 1), (1, rows // 2, n // 2)):
            xa, xb = _rand(g, torch.float32, device, 3, rows, k), _rand(g, torch.float32, device, 3, k, n)
            xa[item, r], xb[item, :, c] = a[0], b[:, 0]
            if not torch.equal(torch.bmm(xa, xb)[item, r, c], ref):
                return (
                    f"this machine's float32 batched matmul of [{rows}, {k}] x [{k}, {n}] on {device.type} "
                    f"gives item {item}, row {r}, column {c} other bits than a [{small}, {k}] item at 0, 0, 0"
                )
        return None

    return _cached(("blocks", rows, k, n, device.type), measure)


class _TiledLinear(torch.autograd.Function):
    """``x2 @ weight.t()`` in tiles (forward); the backward is the plain one (gradients are not
    promised bit for bit, and tile by tile they would cost a weight gradient per tile)."""

    @staticmethod
    def forward(ctx: Any, x2: torch.Tensor, weight: torch.Tensor, wide: int, sizes: tuple) -> torch.Tensor:
        ctx.save_for_backward(x2, weight)
        n, k = weight.shape
        w = weight if wide == n else torch.cat([weight, weight.new_zeros(wide - n, k)])
        return _mm_rows(_padded_rows(x2, TILE_ROWS), w.t(), sizes)[: x2.shape[0], :n]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x2, weight = ctx.saved_tensors
        with torch._C.DisableTorchFunction():  # a backward inside the switch: plain products
            gx = grad.mm(weight) if ctx.needs_input_grad[0] else None
            gw = grad.t().mm(x2) if ctx.needs_input_grad[1] else None
        return gx, gw, None, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.nn.functional.linear`` in tiles of ``TILE_ROWS`` rows (see the module docstring)."""
    k, n = x.shape[-1], weight.shape[0]
    wide = n + (-n) % COLUMN_MULTIPLE
    check = check_tiles(k, wide, x.dtype, x.device)
    if check.why is not None:
        raise ValueError(f"invariant numerics cannot serve this linear ({k} -> {n}): {check.why}")
    out = _TiledLinear.apply(x.reshape(-1, k), weight, wide, check.sizes)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], n)


def matmul(a: torch.Tensor, b: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``a @ b`` where ``b`` is a 2-D weight (``[..., K] x [K, N]``: DeepSpeed's ZeRO-3 linear,
    a caller's own ``x @ W.t()``) as ``linear``; any other matmul as torch computes it."""
    if args or kwargs or not isinstance(b, torch.Tensor) or b.dim() != 2 or a.dim() < 2:
        return torch.matmul(a, b, *args, **kwargs)
    return linear(a, b.t())


def addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``torch.addmm(bias, a, b)`` (GPT-2's ``Conv1D``) as ``linear``; with ``beta``/``alpha``,
    as torch computes it."""
    if args or kwargs:
        return torch.addmm(bias, a, b, *args, **kwargs)
    return linear(a, b.t(), bias)


def _visibility(
    mask: torch.Tensor | None, is_causal: bool, lq: int, lk: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(which keys each query sees ``[B|1, H|1, lq, lk]`` bool, an additive float bias or None),
    from SDPA's ``attn_mask`` and ``is_causal`` with SDPA's meaning."""
    if mask is None:
        vis = torch.ones(lq, lk, dtype=torch.bool, device=device)
        if is_causal:
            vis = vis.tril()
        return vis[None, None], None
    while mask.dim() < 4:
        mask = mask[None]
    if mask.dtype == torch.bool:
        return mask, None
    vis = mask > torch.finfo(mask.dtype).min / 2  # HF writes the dtype's minimum, SDPA users -inf
    bias = torch.where(vis, mask, torch.zeros((), dtype=mask.dtype, device=mask.device))
    return vis, (bias if bool(bias.any()) else None)


def _exp64(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(x.double()).to(x.dtype)


def _keys_in_order(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``x`` ``[b, h, lk, e]`` with each row's keys taken in ``order`` (``[b, 1 | h, lk]``), as
    float32. One order for all heads: whole key rows copied by index (a gather's expanded index
    costs more than the copy)."""
    b, h, lk, e = x.shape
    if order.shape[1] != 1:
        return x.gather(2, order[..., None].expand(b, h, lk, e)).float()
    rows = (order[:, 0] + torch.arange(b, device=order.device)[:, None] * lk).reshape(-1)
    flat = x.transpose(1, 2).reshape(b * lk, h * e).index_select(0, rows)
    return flat.view(b, lk, h, e).transpose(1, 2).float()


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` with one reduction order per query
    (see the module docstring): float32 inside, the result in the query's dtype."""
    if dropout_p:
        raise ValueError(f"invariant numerics: attention dropout ({dropout_p}) is not deterministic")
    if query.dim() != 4 or key.dim() != 4:
        raise ValueError(f"invariant numerics: attention takes [batch, heads, tokens, dim] inputs, got "
                         f"query {tuple(query.shape)} and key {tuple(key.shape)}")  # fmt: skip
    q, k, v = query, key, value
    b, heads, lq0, d = q.shape
    lk, dv = k.shape[2], v.shape[-1]
    vis, bias = _visibility(attn_mask, is_causal, lq0, lk, q.device)
    vis = vis.expand(b, vis.shape[1], lq0, lk)
    rep = heads // k.shape[1]
    if rep > 1 and vis.shape[1] == 1 and bias is None:
        # Grouped-query heads: a key head's queries side by side (as HF packs a decode step's).
        q = q.reshape(b, k.shape[1], rep * lq0, d)
        vis = vis.repeat(1, 1, rep, 1)
    elif rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    hq, lq, hm = q.shape[1], q.shape[2], vis.shape[1]
    tq = QUERY_TILES[-1] if lq <= QUERY_TILES[-1] else QUERY_TILES[0]
    for why in (check_blocks(tq, d, KEY_BLOCK, q.device), check_blocks(tq, KEY_BLOCK, dv, q.device)):
        if why is not None:
            raise ValueError(f"invariant numerics cannot serve this attention: {why}")
    # Each row's visible keys first, in order: key i of the row is its i-th visible key.
    order = torch.argsort((~vis.any(dim=2)).to(torch.int8), dim=-1, stable=True)  # [b, hm, lk]
    vis = vis.gather(-1, order[:, :, None, :].expand(b, hm, lq, lk))
    seen = vis.any(dim=2)  # [b, hm, lk]: a prefix of each row's keys
    k, v = _keys_in_order(k, order), _keys_in_order(v, order)
    v = torch.where(seen[..., None], v, torch.zeros((), device=v.device))  # no NaN * 0 from a pad key
    if bias is not None:
        bias = bias.expand(b, hm, lq, lk).float()
        bias = bias.gather(-1, order[:, :, None, :].expand(b, hm, lq, lk))
    # Pad queries to tiles and keys to blocks (invisible keys, zero values).
    pq, pk = (-lq) % tq, (-lk) % KEY_BLOCK
    nq, nk = (lq + pq) // tq, (lk + pk) // KEY_BLOCK
    qf = torch.nn.functional.pad(q.float(), (0, 0, 0, pq)).view(b, hq, nq, tq, d)
    kf = torch.nn.functional.pad(k, (0, 0, 0, pk)).view(b, hq, nk, KEY_BLOCK, d)
    vf = torch.nn.functional.pad(v, (0, 0, 0, pk)).view(b, hq, nk, KEY_BLOCK, dv)
    vis = torch.nn.functional.pad(vis, (0, pk, 0, pq), value=False)
    vis = vis.view(b, hm, nq, tq, nk, KEY_BLOCK).transpose(3, 4)  # [b, hm, nq, nk, TQ, BK]
    s = torch.matmul(qf[:, :, :, None], kf[:, :, None].transpose(-1, -2))  # [b, hq, nq, nk, TQ, BK]
    s = s * (1.0 / math.sqrt(d) if scale is None else scale)
    if bias is not None:
        bias = torch.nn.functional.pad(bias, (0, pk, 0, pq)).view(b, hm, nq, tq, nk, KEY_BLOCK)
        s = s + bias.transpose(3, 4)
    s = torch.where(vis, s, torch.full((), -math.inf, device=s.device))
    top = s.amax(dim=(3, 5), keepdim=True)  # exact in any order
    top = torch.where(torch.isfinite(top), top, torch.zeros((), device=top.device))  # a query with no key
    p = _exp64(s - top)
    total = p.sum(dim=-1).cumsum(dim=3)[:, :, :, -1]  # [b, hq, nq, TQ]: block by block, in order
    out = torch.matmul(p, vf[:, :, None]).cumsum(dim=3)[:, :, :, -1]  # [b, hq, nq, TQ, dv]
    out = out / torch.where(total > 0, total, torch.ones((), device=total.device))[..., None]
    out = out.reshape(b, hq, nq * tq, dv)[:, :, :lq]
    return out.reshape(b, heads, lq0, dv).to(query.dtype)


def logsumexp(x: torch.Tensor, dim: Any, keepdim: bool = False) -> torch.Tensor:
    """``torch.logsumexp`` with the exponentials and their sum in float64, rounded once: the
    same bits whatever order a kernel sums in (and ``log_softmax`` below is ``x`` minus it, so a
    trainer's ``x[i] - logsumexp(x)`` and ``log_softmax(x)[i]`` are the same bits)."""
    if not x.is_floating_point():
        return torch.logsumexp(x, dim, keepdim)
    top = x.amax(dim=dim, keepdim=True).double()  # exact in any order
    top = torch.where(torch.isfinite(top), top, torch.zeros((), dtype=top.dtype, device=top.device))
    out = top + torch.exp(x.double() - top).sum(dim=dim, keepdim=True).log()
    return (out if keepdim else out.squeeze(dim)).to(x.dtype)


def log_softmax(x: torch.Tensor, dim: Any = None, _stacklevel: int = 3, dtype: Any = None) -> torch.Tensor:
    """``log_softmax`` as ``x - logsumexp(x)`` (``logsumexp`` above), in ``dtype`` if given."""
    if dtype is not None:
        x = x.to(dtype)
    if dim is None:
        dim = -1
    return x - logsumexp(x, dim, keepdim=True)


def in_float64(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``fn`` on its first argument cast to float64, the result rounded once to that dtype."""

    def run(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        kwargs.pop("inplace", None)
        if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dtype == torch.float64:
            return fn(x, *args, **kwargs)
        return fn(x.double(), *args, **kwargs).to(x.dtype)

    return run
