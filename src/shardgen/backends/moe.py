"""Recognizing mixture-of-experts blocks (both backends: DeepSpeed ZeRO-3 leaves, stationary fallbacks).

An MoE block runs only the experts its router picks, so anything that gathers or exchanges
per expert would issue data-dependent collectives; both backends treat the whole block as one
unit instead. Not collective.
"""

from __future__ import annotations

import torch

_MOE_NAME_TAGS = ("SparseMoe", "MoeBlock", "MoEBlock", "MoeLayer", "MoELayer", "SparseMoE")


def is_moe_block(module: torch.nn.Module) -> bool:
    """By class name (``SparseMoe``, ``MoeBlock``, ... or ending in ``MoE``/``Moe``), or an
    ``experts`` child next to a ``gate`` or ``router``."""
    name = type(module).__name__
    if any(tag in name for tag in _MOE_NAME_TAGS) or name.endswith(("MoE", "Moe")):
        return True
    children = dict(module.named_children())
    return "experts" in children and ("gate" in children or "router" in children)
