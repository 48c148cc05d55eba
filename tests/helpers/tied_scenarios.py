"""Scenarios for tests/multirank/test_tied_embeddings.py; they run inside gloo ranks of a World.

A tiny Gemma (``models.tiny_config("gemma")``): its input embedding is a scaled subclass of
``nn.Embedding`` (never chunked: gathered whole), tied to the LM head unless ``tied=False``;
``plain=True`` swaps in a plain ``nn.Embedding`` on the same weight (chunked).
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from models import batch, hf_generate, tiny_model
from torch import nn

import shardgen


def gemma(tied: bool = True, plain: bool = False) -> nn.Module:
    """The same weights in every process; ``plain``: the embedding an ``nn.Embedding`` (no scaling)."""
    model = tiny_model("gemma", seed=31, tie_word_embeddings=tied)
    if plain:
        old = model.get_input_embeddings()
        emb = nn.Embedding(old.num_embeddings, old.embedding_dim, padding_idx=old.padding_idx)
        emb.weight = old.weight  # still the head's parameter when tied
        model.set_input_embeddings(emb)
    assert (model.lm_head.weight is model.get_input_embeddings().weight) == tied
    return model


def user_wrap(model: nn.Module, vocab_unit: bool) -> nn.Module:
    """``fully_shard`` as a user does: each decoder layer, then (``vocab_unit``) the tied embedding
    and head as one unit, then the root."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    if vocab_unit:
        fully_shard([model.get_input_embeddings(), model.lm_head])
    fully_shard(model)
    return model


def generate(
    path: str,
    backend: str = "fsdp2",
    tied: bool = True,
    plain: bool = False,
    ckpt: str | None = None,
    **options,
) -> dict:
    """Greedy generation on 2 ranks against HF ``generate()`` on the same model, and how the
    embedding and head were sharded. ``path``: ``engine`` (``Engine(model)``: shardgen shards it),
    ``user`` / ``user-unit`` (the user wrapped it: :func:`user_wrap`), ``pretrained``
    (``Engine.from_pretrained`` on ``ckpt``, written by rank 0). ``options``: engine options."""
    ref = gemma(tied, plain)
    if path == "pretrained":
        if dist.get_rank() == 0 and not os.path.exists(os.path.join(ckpt, "config.json")):
            ref.save_pretrained(ckpt)
        dist.barrier()
        engine = shardgen.Engine.from_pretrained(ckpt, backend=backend, **options, gather="per-layer")
    elif path in ("user", "user-unit"):
        engine = shardgen.Engine(
            user_wrap(gemma(tied, plain), path == "user-unit"), backend=backend, **options, gather="per-layer"
        )
    else:
        assert path == "engine", path
        engine = shardgen.Engine(gemma(tied, plain), backend=backend, **options, gather="per-layer")
    ids, mask = batch([3, 6, 2], seed=40 + dist.get_rank())
    try:
        out = engine.generate_ids(ids, attention_mask=mask, max_new_tokens=6)
        # Until every rank's generate has returned, this rank's driver may still run shadow
        # forwards (its units gathered meanwhile): look once no rank has work.
        dist.barrier()
        model = engine.model
        emb, head = model.get_input_embeddings(), model.lm_head
        chunked = getattr(engine.backend, "chunked", None)
        info = dict(
            tied=head.weight is emb.weight,
            chunks=chunked.describe() if chunked is not None else {},
        )
        if backend == "fsdp2":
            from torch.distributed.fsdp import FSDPModule
            from torch.distributed.tensor import DTensor

            root = model._get_fsdp_state()

            def unit(m: nn.Module) -> object:
                return m._get_fsdp_state() if isinstance(m, FSDPModule) else root

            def sharded() -> list[bool]:  # between forwards (FSDP2 registers the sharded DTensor again)
                return [isinstance(m.weight, DTensor) for m in (emb, head)]

            # The barrier can pass while a driver still ends a tick it agreed before its generate
            # returned (a shadow forward, its units gathered): give it a moment to leave it.
            deadline = time.monotonic() + 5.0
            while not all(sharded()) and time.monotonic() < deadline:
                time.sleep(0.01)
            info.update(
                # the embedding / head: a unit of its own (not the root, which stays gathered)
                own_units=[unit(m) is not root for m in (emb, head)],
                same_unit=unit(emb) is unit(head),
                sharded=sharded(),
            )
    finally:
        engine.close()
    info["equal"] = bool(torch.equal(out, hf_generate(ref, ids, mask, max_new_tokens=6)))
    return info
