"""The invariant-numerics switch: a ``TorchFunctionMode`` that routes a forward's ops to ``ops``.

The mode is per thread (torch keeps the mode stack per thread): the engine's driver thread runs
inside it for its whole life when ``EngineConfig(numerics="invariant")``, and a trainer wraps
its own forward in ``invariant_numerics()``. Both then run the same ops on the same values, so
the rollout's logprobs and the trainer's are the same bits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from shardgen.config import NUMERICS
from shardgen.numerics import ops

__all__ = ["NUMERICS", "InvariantMode", "active", "invariant_numerics", "unsupported"]

_VF = torch._C._VariableFunctions  # torch's own builtins: what reaches a mode, even where
# ``torch.addmm`` or ``F.linear`` has been wrapped (a profiler, a test's rounding switch)


def _both(name: str) -> tuple[Any, ...]:
    """``torch.<name>`` as it is now and torch's builtin of that name."""
    return (getattr(torch, name), getattr(_VF, name))


_f64 = {
    fn: ops.in_float64(raw)
    for raw, fns in (
        (_VF.exp, (*_both("exp"), torch.Tensor.exp)),
        (_VF.sigmoid, (*_both("sigmoid"), torch.Tensor.sigmoid, F.sigmoid)),
        (_VF.tanh, (*_both("tanh"), torch.Tensor.tanh, F.tanh)),
        (_VF.cos, (*_both("cos"), torch.Tensor.cos)),
        (_VF.sin, (*_both("sin"), torch.Tensor.sin)),
        (F.silu, (F.silu,)),
        (F.gelu, (F.gelu,)),
    )
    for fn in fns
}
_ROUTES: dict[Any, Any] = {
    torch._C._nn.linear: ops.linear,
    torch._C._nn.scaled_dot_product_attention: ops.attention,
    **{
        fn: ops.matmul
        for fn in (
            *_both("matmul"),
            *_both("mm"),
            torch.Tensor.matmul,
            torch.Tensor.__matmul__,
            torch.Tensor.mm,
        )
    },  # fmt: skip
    **{fn: ops.addmm for fn in (*_both("addmm"), torch.Tensor.addmm)},
    **{fn: ops.logsumexp for fn in (*_both("logsumexp"), torch.Tensor.logsumexp)},
    **{fn: ops.log_softmax for fn in (*_both("log_softmax"), torch.Tensor.log_softmax, F.log_softmax)},
    **_f64,
}


def active() -> bool:
    """An ``InvariantMode`` is on this thread's stack of torch function modes."""
    from torch.overrides import _get_current_function_mode_stack

    return any(isinstance(m, InvariantMode) for m in _get_current_function_mode_stack())


class InvariantMode(TorchFunctionMode):
    """Every ``F.linear`` (and matmul by a 2-D weight), ``scaled_dot_product_attention`` and
    transcendental of the thread's forward through its batch-invariant form (``ops``);
    everything else as it is."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        route = _ROUTES.get(func)
        if route is None:
            return func(*args, **(kwargs or {}))
        return route(*args, **(kwargs or {}))


@contextlib.contextmanager
def invariant_numerics(enabled: bool = True) -> Iterator[None]:
    """Run this thread's torch ops with batch-invariant numerics (``enabled``) while inside.

    For the trainer: wrap the forward that recomputes a rollout's logprobs (and its backward, if
    you like: gradients are finite, close to the plain path's, not promised bit for bit). Inside,
    a row's logits depend on that row alone, so they equal the engine's under
    ``EngineConfig(numerics="invariant")`` bit for bit. Local to the calling thread; nests."""
    if not enabled:
        yield
        return
    with InvariantMode():
        yield


def unsupported(model: Any) -> str | None:
    """Why ``model`` cannot run under invariant numerics (its kind, its attention), or None."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return None
    impl = getattr(cfg, "_attn_implementation", None)
    if impl not in (None, "sdpa"):
        return (
            f"its attention implementation is {impl!r}; invariant numerics replaces 'sdpa' "
            f"(load it with attn_implementation='sdpa')"
        )
    text = getattr(cfg, "get_text_config", lambda: cfg)()
    window = getattr(text, "sliding_window", None)
    uses = getattr(text, "use_sliding_window", True)
    layer_types = getattr(text, "layer_types", None) or []
    limit = getattr(text, "max_position_embeddings", None)
    never_binds = bool(window and limit and window >= limit)  # no sequence is longer than the window
    if ("sliding_attention" in layer_types or (window and uses)) and not never_binds:
        return (
            f"{text.model_type} attends through a sliding window ({window} tokens): a row's keys then "
            f"start at another position in decode than in a full forward"
        )
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        if getattr(text, name, None):
            return f"{text.model_type} is a mixture of experts ({name}={getattr(text, name)})"
    return None
