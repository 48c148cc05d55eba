"""Finding a model's parts, for both backends and the stationary mode: its decoder layers, its
input embeddings and LM head (and which of them can be chunked, with the lookups probe of an
embedding subclass), its mixture-of-experts blocks, a wrapped module's own class, and the
dtype its inputs take.

These decide the units a model is gathered in, so every rank must find the same parts: each
function is a function of the model's structure (and, for the probe, of a local forward on a
stand-in weight) only. Nothing here is collective.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shardgen.backends.lookups import lookup_only


def float_dtype(module: nn.Module) -> torch.dtype:
    """The dtype of ``module``'s first floating-point parameter (float32 without one): what a
    shadow or probe input of the module must be in."""
    return next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)


def plain_type(module: nn.Module) -> type:
    """The module's class without a mix-in sharding wrapper (FSDP2's ``fully_shard`` swaps in a
    subclass that mixes in ``FSDPModule``)."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))


def outermost(model: nn.Module, pred: Callable[[nn.Module], bool]) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of the modules of ``model`` (not itself) for which ``pred`` holds and
    that lie inside no other such module, in module order."""
    found = [(n, m) for n, m in model.named_modules() if m is not model and pred(m)]
    inner = {id(c) for _, m in found for c in m.modules() if c is not m}
    return [(n, m) for n, m in found if id(m) not in inner]


# ----------------------------------------------------------------------------- decoder layers
def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks to gather one by one.

    HF models name them in ``_no_split_modules`` (LlamaDecoderLayer, GPT2Block, ...), the
    outermost matches only (never a block inside another); otherwise take the largest
    ``ModuleList`` of same-class modules. A mixture-of-experts block lives inside its decoder
    layer, so all experts are gathered as one unit and routing can never change the gather
    sequence.
    """
    names = set(getattr(model, "_no_split_modules", None) or [])
    found = [m for _, m in outermost(model, lambda m: type(m).__name__ in names)]
    if found:
        return found
    best: list[nn.Module] = []
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) > 1 and len({type(c) for c in m}) == 1:
            if sum(p.numel() for p in m.parameters()) > sum(p.numel() for b in best for p in b.parameters()):
                best = list(m)
    return best


def largest_layer_bytes(model: nn.Module, numel: Callable[[Any], int] | None = None) -> int:
    """Full bytes of the largest decoder layer; ``numel(p)``: a parameter's full element count
    (default ``p.numel()``, global for an FSDP2 DTensor; DeepSpeed passes its own)."""
    count = numel or (lambda p: p.numel())
    layers = decoder_layers(model)
    return max((sum(count(p) * p.element_size() for p in m.parameters()) for m in layers), default=0)


# ----------------------------------------------------------------------------- embeddings and head
def io_embeddings(model: nn.Module) -> list[tuple[str, nn.Module, bool]]:
    """``(name, module, chunkable)`` of the input embeddings and the LM head, of any class (a
    module both returns: once). ``chunkable``: a plain ``nn.Embedding`` (no ``max_norm``) /
    bias-free plain ``nn.Linear``, which ``chunked.embedding_forward`` / ``chunked.linear_forward``
    compute exactly, or an ``nn.Embedding`` subclass whose own forward reads its weight by
    lookups only (Gemma's scaled embedding: ``lookups.lookup_only``, a local probe), run with
    its lookups chunked; any other (a head with a bias) is gathered whole."""
    out: list[tuple[str, nn.Module, bool]] = []
    names = {id(m): n for n, m in model.named_modules()}
    for getter, kind in (("get_input_embeddings", nn.Embedding), ("get_output_embeddings", nn.Linear)):
        try:
            m = getattr(model, getter)()
        except (AttributeError, NotImplementedError):
            m = None
        if m is None or id(m) not in names or any(m is o for _, o, _ in out):
            continue
        ok = plain_type(m) is kind
        ok = ok and getattr(m, "max_norm", None) is None and getattr(m, "bias", None) is None
        if not ok and kind is nn.Embedding and isinstance(m, nn.Embedding) and m.max_norm is None:
            # a subclass (Gemma's scaled embedding): its own forward, its lookups chunked
            ok = _lookup_only(m)
        out.append((names[id(m)], m, ok))
    return out


def _lookup_only(m: nn.Embedding) -> bool:
    """Whether an embedding subclass reads its weight only by lookups (``lookups.lookup_only``)."""
    own = {n for n, v in m._parameters.items() if v is not None}
    if own != {"weight"}:
        return False
    w = m.weight
    shape = tuple(getattr(w, "ds_shape", None) or w.shape)  # DeepSpeed: the full shape
    return len(shape) == 2 and lookup_only(m, shape, w.dtype, w.device)


def vocab_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of the input embeddings and the LM head when they can be chunked
    (:func:`io_embeddings`)."""
    return [(name, m) for name, m, ok in io_embeddings(model) if ok]


# ----------------------------------------------------------------------------- mixture of experts
# An MoE block runs only the experts its router picks, so anything that gathers or exchanges per
# expert would issue data-dependent collectives; both backends treat the whole block as one unit
# instead (DeepSpeed: a ZeRO-3 leaf; the stationary mode: a fallback computed whole).
_MOE_NAME_TAGS = ("SparseMoe", "MoeBlock", "MoEBlock", "MoeLayer", "MoELayer", "SparseMoE")


def is_moe_block(module: nn.Module) -> bool:
    """By class name (``SparseMoe``, ``MoeBlock``, ... or ending in ``MoE``/``Moe``), or an
    ``experts`` child next to a ``gate`` or ``router``."""
    name = type(module).__name__
    if any(tag in name for tag in _MOE_NAME_TAGS) or name.endswith(("MoE", "Moe")):
        return True
    children = dict(module.named_children())
    return "experts" in children and ("gate" in children or "router" in children)


# ----------------------------------------------------------------------------- cross-attention
#: The names encoder-decoders give their decoder layers' cross-attention (T5, BART and its kin).
_CROSS_ATTENTION_NAMES = ("EncDecAttention", "encoder_attn")


def cross_attention_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of an encoder-decoder's cross-attention modules (outermost). Their key
    and value projections run only at a request's first decoder step (later steps reuse the
    cached keys and values), so anything that gathers per submodule would issue data-dependent
    collectives: like an MoE block, each is gathered as one unit."""
    if not getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return []
    return [(n, m) for n, m in model.named_modules() if n.rpartition(".")[2] in _CROSS_ATTENTION_NAMES]
