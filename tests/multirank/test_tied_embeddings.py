"""Tied input embeddings and LM head whatever the embedding class (a Gemma-style scaled subclass of
``nn.Embedding``: its own forward runs with its lookups chunked), on every path that shards the
model: fsdp2 sharded by shardgen (chunked, or gathered whole), sharded by the user, loaded
sharded by ``Engine.from_pretrained``; deepspeed on the same model. Tied weights must stay one
parameter in one FSDP unit (FSDP2 refuses a parameter shared between two units). 2 gloo ranks
in one World for the module, greedy output compared with single-process HF ``generate()``.
"""

from __future__ import annotations

import pytest
import tied_scenarios as sc
from torch import nn

ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
CHUNK_MB = 1.5 / 1024  # 6 rows of 32 fp32 per rank per chunk: 8 gathers for 48 rows


# ----------------------------------------------------------------------------- in-process
@pytest.mark.parametrize("head", ["linear", "biased"])
def test_tied_embedding_and_head_are_one_unit_whatever_their_class(head):
    from shardgen.backends.fsdp2 import vocab_units

    model = sc.gemma(tied=True)
    emb = model.get_input_embeddings()
    if head == "biased":  # a head with a bias (never chunked), on the embedding's weight
        model.lm_head = nn.Linear(emb.embedding_dim, emb.num_embeddings, bias=True)
        model.lm_head.weight = emb.weight
    assert vocab_units(model, set()) == [[emb, model.lm_head]]
    plain = sc.gemma(tied=True, plain=True)
    assert vocab_units(plain, set()) == [[plain.get_input_embeddings(), plain.lm_head]]
    untied = sc.gemma(tied=False)
    assert vocab_units(untied, set()) == [[untied.get_input_embeddings()], [untied.lm_head]]


def test_embedding_subclasses_are_chunked_when_they_only_look_up():
    """``io_embeddings``' local probe: Gemma's scaled embedding looks its weight up (chunkable), as
    does one that computes its own indices (a lookup is chunked whatever it looks up); one that
    indexes its weight, or whose forward the probe cannot call on one tensor, is gathered whole."""
    import torch

    from shardgen.backends.parts import io_embeddings

    class Indexed(nn.Embedding):
        def forward(self, ids):
            return self.weight[ids]

    class Positions(nn.Embedding):  # OPT's learned positions: indices from an attention mask
        def forward(self, attention_mask, cache_length=0):
            return super().forward(attention_mask.cumsum(1)[:, cache_length:])

    class Scaled(nn.Embedding):  # a forward with a second required argument
        def forward(self, ids, scale):
            return super().forward(ids) * scale

    model = sc.gemma(tied=False)
    flags = {name: ok for name, _, ok in io_embeddings(model)}
    assert flags == {"model.embed_tokens": True, "lm_head": True}, flags
    emb = model.get_input_embeddings()
    for cls, chunkable in ((Positions, True), (Indexed, False), (Scaled, False)):
        other = cls(emb.num_embeddings, emb.embedding_dim)
        model.set_input_embeddings(other)
        flags = {name: ok for name, _, ok in io_embeddings(model)}
        assert flags["model.embed_tokens"] is chunkable, (cls.__name__, flags)
        assert isinstance(other.weight, nn.Parameter) and other.weight.shape == emb.weight.shape  # put back
    model.set_input_embeddings(emb)
    assert torch.equal(emb(torch.tensor([[3, 4]])), emb.weight[[3, 4]][None] * emb.embed_scale)


# ----------------------------------------------------------------------------- 2 ranks
@pytest.fixture(scope="module")
def tworld(world2):
    return world2


def _check(runs: list[dict], **want) -> None:
    for r, res in enumerate(runs):
        assert res["equal"], f"rank {r}: outputs differ from HF generate(): {res}"
        for key, value in want.items():
            assert res[key] == value, (r, key, res)


@pytest.mark.multirank
def test_fsdp2_tied_plain_embedding_and_head_chunked_in_one_unit(tworld):
    runs = tworld.run(sc.generate, "engine", tied=True, plain=True, chunk_mb=CHUNK_MB, timeout=120)
    _check(runs, tied=True, own_units=[True, True], same_unit=True, sharded=[True, True])
    assert all(r["chunks"] == {"model.embed_tokens": 8, "lm_head": 8} for r in runs), runs


@pytest.mark.multirank
@pytest.mark.parametrize("chunk_mb", [CHUNK_MB, 0], ids=["chunked", "whole"])
def test_fsdp2_tied_scaled_embedding_chunked_in_one_unit(tworld, chunk_mb):
    # The scaled embedding runs its own forward with its lookups from row chunks (lookups.py), so
    # the tied unit is chunked like a plain one; with chunk_mb=0 the unit is gathered whole.
    runs = tworld.run(sc.generate, "engine", tied=True, chunk_mb=chunk_mb, timeout=120)
    chunks = {"model.embed_tokens": 8, "lm_head": 8} if chunk_mb else {}
    _check(runs, tied=True, own_units=[True, True], same_unit=True, sharded=[True, True], chunks=chunks)


@pytest.mark.multirank
def test_fsdp2_untied_scaled_embedding_is_a_unit_of_its_own(tworld):
    # In its own unit (in the root it would stay gathered between forwards), chunked.
    runs = tworld.run(sc.generate, "engine", tied=False, chunk_mb=CHUNK_MB, timeout=120)
    _check(runs, tied=False, own_units=[True, True], same_unit=False, sharded=[True, True])
    assert all(r["chunks"] == {"model.embed_tokens": 8, "lm_head": 8} for r in runs), runs


@pytest.mark.multirank
@pytest.mark.parametrize("path", ["user", "user-unit"])
def test_fsdp2_user_sharded_tied_scaled_embedding(tworld, path):
    # The user's units are kept as they are: the tied weight in the root, or in a unit of the two.
    runs = tworld.run(sc.generate, path, tied=True, chunk_mb=CHUNK_MB, timeout=120)
    _check(runs, tied=True, own_units=[path == "user-unit"] * 2, same_unit=True, chunks={})


@pytest.mark.multirank
@pytest.mark.parametrize("backend", ["fsdp2", "deepspeed"])
def test_from_pretrained_tied_scaled_embedding(tworld, tmp_path_factory, backend):
    if backend == "deepspeed":
        pytest.importorskip("deepspeed")
    ckpt = str(tmp_path_factory.mktemp(f"gemma-{backend}"))
    runs = tworld.run(
        sc.generate, "pretrained", backend, tied=True, ckpt=ckpt, chunk_mb=CHUNK_MB, timeout=120
    )
    both = {"model.embed_tokens": 8, "lm_head": 8}
    if backend == "fsdp2":
        _check(runs, tied=True, own_units=[True, True], same_unit=True, sharded=[True, True], chunks=both)
    else:  # DeepSpeed gathers per module: both chunked
        _check(runs, tied=True, chunks=both)


@pytest.mark.multirank
def test_deepspeed_tied_scaled_embedding(tworld):
    pytest.importorskip("deepspeed")
    runs = tworld.run(sc.generate, "engine", "deepspeed", tied=True, chunk_mb=CHUNK_MB, timeout=120)
    _check(runs, tied=True, chunks={"model.embed_tokens": 8, "lm_head": 8})
