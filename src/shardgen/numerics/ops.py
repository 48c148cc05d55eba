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
from typing import Any

import torch

#: Rows per matmul call of a linear (a decode step's rows fit one tile).
TILE_ROWS = 16
#: A linear's output features are zero-padded to a multiple of this: narrower products take
#: another kernel (on this CPU, fp32 products of up to 9 columns sum in another order).
COLUMN_MULTIPLE = 16
#: Keys per attention block; queries per attention tile.
KEY_BLOCK = 64
QUERY_TILE = 16

_checked: dict[tuple, str | None] = {}
_lock = threading.Lock()


def _tile_mm(tiles: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
    """``[n, T, K] @ [K, N] -> [n, T, N]``, one matmul of shape ``[T, K] x [K, N]`` per tile."""
    n = tiles.shape[0]
    if tiles.dtype == torch.float32:
        return torch.bmm(tiles, wt.expand(n, *wt.shape))  # one call; per tile checked equal to mm
    return torch.stack([torch.mm(t, wt) for t in tiles.unbind(0)])  # bf16/fp16 bmm is slow on CPU


def _padded_rows(x2: torch.Tensor, multiple: int) -> torch.Tensor:
    """``x2`` ``[M, K]`` copied into a fresh buffer, zero rows appended up to a multiple of
    ``multiple``: every tile then starts at the same alignment in every call."""
    pad = (-x2.shape[0]) % multiple
    return torch.cat([x2, x2.new_zeros(pad, x2.shape[1])])


def check_tiles(k: int, n: int, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why this machine's matmul of ``[TILE_ROWS, k] x [k, n]`` in ``dtype`` is not row-invariant
    (a row's result differs by its position in the tile or by the tile's neighbours), or None.
    Measured once per (k, n, dtype, device) in this process, on random values."""
    key = (k, n, dtype, device.type)
    with _lock:
        if key in _checked:
            return _checked[key]
    g = torch.Generator().manual_seed(k * 7919 + n)
    wt = torch.randn(n, k, generator=g).to(device=device, dtype=dtype).t()
    row = torch.randn(1, k, generator=g).to(device=device, dtype=dtype)
    why = None
    ref = None
    tile = torch.randn(TILE_ROWS, k, generator=g).to(device=device, dtype=dtype)
    wide = torch.mm(tile, wt)
    for c in sorted({0, (n // 2) // COLUMN_MULTIPLE * COLUMN_MULTIPLE, n - COLUMN_MULTIPLE}):
        narrow = torch.mm(tile, wt[:, c : c + COLUMN_MULTIPLE])  # the narrowest product it makes
        if not torch.equal(wide[:, c : c + COLUMN_MULTIPLE], narrow):
            why = (
                f"this machine's {dtype} matmul of [{TILE_ROWS}, {k}] x [{k}, {n}] on {device.type} gives "
                f"columns {c}..{c + COLUMN_MULTIPLE - 1} other bits than a product of those columns alone"
            )
    for j in range(TILE_ROWS if why is None else 0):
        tiles = torch.randn(2, TILE_ROWS, k, generator=g).to(device=device, dtype=dtype)
        tiles[1, j] = row[0]
        got = _tile_mm(tiles, wt)[1, j]
        ref = got if ref is None else ref
        if not torch.equal(got, ref) or not torch.equal(torch.mm(tiles[1], wt)[j], ref):
            why = (
                f"this machine's {dtype} matmul of [{TILE_ROWS}, {k}] x [{k}, {n}] on {device.type} gives a "
                f"row different bits at position {j} of a tile than at position 0"
            )
            break
    with _lock:
        _checked[key] = why
    return why


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.nn.functional.linear`` in tiles of ``TILE_ROWS`` rows (see the module docstring)."""
    k, n = x.shape[-1], weight.shape[0]
    wide = n + (-n) % COLUMN_MULTIPLE
    why = check_tiles(k, wide, x.dtype, x.device)
    if why is not None:
        raise ValueError(f"invariant numerics cannot serve this linear ({k} -> {n}): {why}")
    if wide != n:
        weight = torch.cat([weight, weight.new_zeros(wide - n, k)])
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    tiles = _padded_rows(x2, TILE_ROWS).view(-1, TILE_ROWS, k)
    out = _tile_mm(tiles, weight.t()).reshape(-1, wide)[:m, :n]
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
    b, hq, lq, d = q.shape
    lk, dv = k.shape[2], v.shape[-1]
    if k.shape[1] != hq:  # grouped-query heads (enable_gqa, or a caller's broadcast)
        k = k.repeat_interleave(hq // k.shape[1], dim=1)
        v = v.repeat_interleave(hq // v.shape[1], dim=1)
    vis, bias = _visibility(attn_mask, is_causal, lq, lk, q.device)
    vis = vis.expand(b, vis.shape[1], lq, lk)
    hm = vis.shape[1]
    # Each row's visible keys first, in order: key i of the row is its i-th visible key.
    order = torch.argsort((~vis.any(dim=2)).to(torch.int8), dim=-1, stable=True)  # [b, hm, lk]
    vis = vis.gather(-1, order[:, :, None, :].expand(b, hm, lq, lk))
    seen = vis.any(dim=2)  # [b, hm, lk]: a prefix of each row's keys
    k = k.gather(2, order[..., None].expand(b, hq, lk, d)).float()
    v = v.gather(2, order[..., None].expand(b, hq, lk, dv)).float()
    v = torch.where(seen[..., None], v, torch.zeros((), device=v.device))  # no NaN * 0 from a pad key
    if bias is not None:
        bias = bias.expand(b, hm, lq, lk).float()
        bias = bias.gather(-1, order[:, :, None, :].expand(b, hm, lq, lk))
    # Pad queries to tiles and keys to blocks (invisible keys, zero values).
    pq, pk = (-lq) % QUERY_TILE, (-lk) % KEY_BLOCK
    nq, nk = (lq + pq) // QUERY_TILE, (lk + pk) // KEY_BLOCK
    qf = torch.nn.functional.pad(q.float(), (0, 0, 0, pq)).view(b, hq, nq, QUERY_TILE, d)
    kf = torch.nn.functional.pad(k, (0, 0, 0, pk)).view(b, hq, nk, KEY_BLOCK, d)
    vf = torch.nn.functional.pad(v, (0, 0, 0, pk)).view(b, hq, nk, KEY_BLOCK, dv)
    vis = torch.nn.functional.pad(vis, (0, pk, 0, pq), value=False)
    vis = vis.view(b, hm, nq, QUERY_TILE, nk, KEY_BLOCK).transpose(3, 4)  # [b, hm, nq, nk, TQ, BK]
    s = torch.matmul(qf[:, :, :, None], kf[:, :, None].transpose(-1, -2))  # [b, hq, nq, nk, TQ, BK]
    s = s * (1.0 / math.sqrt(d) if scale is None else scale)
    if bias is not None:
        bias = torch.nn.functional.pad(bias, (0, pk, 0, pq)).view(b, hm, nq, QUERY_TILE, nk, KEY_BLOCK)
        s = s + bias.transpose(3, 4)
    s = torch.where(vis, s, torch.full((), -math.inf, device=s.device))
    top = s.amax(dim=(3, 5), keepdim=True)  # exact in any order
    top = torch.where(torch.isfinite(top), top, torch.zeros((), device=top.device))  # a query with no key
    p = _exp64(s - top)
    total = p.sum(dim=-1).cumsum(dim=3)[:, :, :, -1]  # [b, hq, nq, TQ]: block by block, in order
    out = torch.matmul(p, vf[:, :, None]).cumsum(dim=3)[:, :, :, -1]  # [b, hq, nq, TQ, dv]
    out = out / torch.where(total > 0, total, torch.ones((), device=total.device))[..., None]
    return out.reshape(b, hq, nq * QUERY_TILE, dv)[:, :, :lq].to(query.dtype)


def in_float64(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``fn`` on its first argument cast to float64, the result rounded once to that dtype."""

    def run(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        kwargs.pop("inplace", None)
        if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dtype == torch.float64:
            return fn(x, *args, **kwargs)
        return fn(x.double(), *args, **kwargs).to(x.dtype)

    return run
