"""An ``nn.Embedding`` subclass's own forward, its lookups answered from a sharded weight.

Gemma's scaled embedding (``super().forward(ids) * embed_scale``), OPT's and BioGPT's learned
positions and many more subclass ``nn.Embedding`` and compute more than the lookup. Rather than
gather such a weight whole, shardgen runs the module's own forward with its ``weight`` swapped for a
storage-free stand-in (:func:`stand_in`) and every lookup of that stand-in (``F.embedding``,
``torch.embedding``) answered by the caller's sharded lookup (:class:`Lookups`, a torch function
mode: per thread, so other threads' forwards are untouched). Any other use of the weight (an
index, a product) goes to ``other``: a probe notes it, a real forward raises. Used by the
stationary mode (``stationary/layout.py``, ``runner.py``) and the row-chunked embeddings of per-layer
forwards (``chunked.py``). Nothing here issues a collective; the ``lookup`` callables may.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode


class Lookups(TorchFunctionMode):
    """While an ``nn.Embedding`` subclass's own forward runs: each lookup of ``weight`` (``F.embedding``
    or ``torch.embedding``, no ``max_norm``) is ``lookup(ids)``; any other use of ``weight`` that is
    not a metadata read (``.dtype``, ``.shape``: a getter returning no tensor) is ``other(func,
    args, kwargs)``. Torch's mode stack is per thread: other threads' forwards are untouched. Local."""

    def __init__(
        self,
        weight: Any,
        lookup: Callable[[torch.Tensor], torch.Tensor],
        other: Callable[[Any, tuple, dict], Any],
    ) -> None:
        super().__init__()
        self.weight, self.lookup, self.other = weight, lookup, other

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        w = self.weight
        if func is F.embedding or func is torch.embedding:
            names = ("input", "weight", "padding_idx", "max_norm")
            if func is torch.embedding:
                names = ("weight", "indices")
            bound = dict(zip(names, args, strict=False)) | kwargs
            ids = bound.get("input", bound.get("indices"))
            if bound.get("weight") is w and bound.get("max_norm") is None and ids is not None:
                return self.lookup(ids)
        if not any(a is w for a in (*args, *kwargs.values())):
            return func(*args, **kwargs)
        if getattr(func, "__name__", "") == "__get__":  # a property of the weight
            out = func(*args, **kwargs)
            if not isinstance(out, torch.Tensor):
                return out
        return self.other(func, args, kwargs)


def stand_in(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | None) -> torch.Tensor:
    """What an embedding subclass's own forward sees as its ``weight``: the full shape, the compute
    dtype (FSDP2's ``param_dtype``: Gemma scales by ``embed_scale.to(self.weight.dtype)``) and the
    device, no storage (one element expanded); :class:`Lookups` answers its lookups. Local."""
    return torch.empty((), dtype=dtype, device=device).expand(tuple(shape))


def own_forward(module: nn.Module) -> Callable[..., Any]:
    """The forward ``module`` runs now (an instance attribute, else its class's), bound. Local."""
    prev = module.__dict__.get("forward")
    return prev if prev is not None else type(module).forward.__get__(module)


@contextlib.contextmanager
def looking_up(
    module: nn.Module,
    weight: torch.Tensor,
    lookup: Callable[[torch.Tensor], torch.Tensor],
    other: Callable[[Any, tuple, dict], Any],
) -> Iterator[None]:
    """For the duration: ``module``'s ``weight`` is ``weight`` (a :func:`stand_in`), and
    :class:`Lookups` answers its uses; the module's own weight back after. Local."""
    saved = module._parameters["weight"]
    module._parameters["weight"] = weight
    try:
        with Lookups(weight, lookup, other):
            yield
    finally:
        module._parameters["weight"] = saved


def lookup_only(
    module: nn.Module, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | None
) -> bool:
    """Whether ``module`` (an ``nn.Embedding`` subclass with weight ``shape``) reads its weight only
    by lookups: its own forward run once on one id, the weight a stand-in, the lookups zeros. A
    forward that takes other arguments, raises, looks nothing up or uses its weight otherwise:
    False. Local; no collective."""
    seen = {"lookups": 0, "other": 0}

    def lookup(ids: torch.Tensor) -> torch.Tensor:
        seen["lookups"] += 1
        return torch.zeros((*ids.shape, shape[-1]), dtype=dtype, device=ids.device)

    def other(func: Any, args: tuple, kwargs: dict) -> Any:
        seen["other"] += 1
        raise _OtherUse

    forward = own_forward(module)
    ids = torch.zeros((1, 1), dtype=torch.long, device=device)
    try:
        with torch.no_grad(), looking_up(module, stand_in(shape, dtype, device), lookup, other):
            forward(ids)
    except Exception:  # its forward takes something else, or reads its weight otherwise
        return False
    return seen["lookups"] > 0 and not seen["other"]


class _OtherUse(Exception):
    pass
