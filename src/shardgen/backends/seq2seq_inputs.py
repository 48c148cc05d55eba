"""What an encoder-decoder's forward takes beyond its own arguments: a shadow forward's inputs, and
each row's decoder positions.

- A shadow forward of an encoder-decoder feeds the decoder one token against a one-column
  encoder output, so the encoder (a tower, ``towers.py``) runs only where the tick agreed it.
- Rows that joined a running batch later (refills) sit left-padded in the decoder's columns, so
  their positions are not the columns'. BART's decoder counts its learned positions from the
  cache length and takes no position argument; ``decoder_positions`` gives its positional
  embedding each row's own (hooks on the module that runs, for the one forward). A
  model with relative positions (T5) needs none: the distances between a row's columns are the
  same either way.

Nothing here is collective.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from shardgen.backends.parts import float_dtype


def shadow_inputs(model: Any, device: torch.device) -> dict[str, Any]:
    """A shadow forward's inputs: one token, no cache. An encoder-decoder's: one decoder token
    against a one-column encoder output (its encoder runs only as an agreed tower). Local."""
    ids = torch.zeros((1, 1), dtype=torch.long, device=device)
    cfg = model.config
    if not getattr(cfg, "is_encoder_decoder", False):
        return {"input_ids": ids, "use_cache": False}
    width = int(getattr(cfg, "d_model", None) or cfg.hidden_size)
    dtype = float_dtype(model)
    hidden = torch.zeros((1, 1, width), dtype=dtype, device=device)
    mask = torch.ones_like(ids)
    return {"decoder_input_ids": ids, "encoder_outputs": (hidden,), "attention_mask": mask,
            "use_cache": False}  # fmt: skip


def learned_positions(model: nn.Module) -> nn.Module | None:
    """The decoder's positional embedding when it takes ``position_ids`` (BART's), else None."""
    get = getattr(model, "get_decoder", None)
    decoder = get() if callable(get) else None
    emb = getattr(decoder, "embed_positions", None)
    if not isinstance(emb, nn.Module):
        return None
    return emb if "position_ids" in inspect.signature(emb.forward).parameters else None


@contextlib.contextmanager
def decoder_positions(model: nn.Module, positions: torch.Tensor | None) -> Iterator[None]:
    """Within: ``model``'s decoder embeds ``positions`` (``[B, T]``, each row's own) instead of the
    columns' (None: the columns'). BART's embedding takes one 1-D ``position_ids`` for every row:
    it gets the rows' positions flat, and its ``[1, B * T, d]`` output is viewed as ``[B, T, d]``
    (the same values, each row's at its own positions). Local."""
    emb = learned_positions(model) if positions is not None else None
    if emb is None:
        yield
        return
    assert positions is not None

    def flat(_m: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        kwargs["position_ids"] = positions.reshape(-1)
        return args, kwargs

    def rows(_m: nn.Module, _args: tuple, _kwargs: dict, out: torch.Tensor) -> torch.Tensor:
        return out.reshape(*positions.shape, out.shape[-1])

    handles = [
        emb.register_forward_pre_hook(flat, with_kwargs=True),
        emb.register_forward_hook(rows, with_kwargs=True),
    ]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
