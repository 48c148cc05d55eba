"""Tied input embeddings and LM head whatever the embedding class (a Gemma-style scaled subclass of
``nn.Embedding``), on every path that shards the model: fsdp2 sharded by shardgen (chunked, or
gathered whole), sharded by the user, loaded sharded by ``Engine.from_pretrained``; deepspeed
on the same model. Tied weights must stay one parameter in one FSDP unit (FSDP2 refuses a
parameter shared between two units). 2 gloo ranks in one World for the module, greedy output
compared with single-process HF ``generate()``.
"""

from __future__ import annotations

import pytest
import tied_scenarios as sc
from torch import nn
from world import World

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


# ----------------------------------------------------------------------------- 2 ranks
class _TiedWorld:
    """One World of 2 ranks for the module, restarted if a failed test left it broken."""

    def __init__(self) -> None:
        self.world: World | None = None

    def run(self, fn, *args, timeout: float = 120.0, **kwargs):
        if self.world is None or self.world.broken:
            if self.world is not None:
                self.world.close()
            self.world = World(2, env=ENV, start_timeout=120.0)
        return self.world.run(fn, *args, timeout=timeout, **kwargs)

    def close(self) -> None:
        if self.world is not None:
            self.world.close()


@pytest.fixture(scope="module")
def tworld():
    handle = _TiedWorld()
    yield handle
    handle.close()


def _check(runs: list[dict], **want) -> None:
    for r, res in enumerate(runs):
        assert res["equal"], f"rank {r}: outputs differ from HF generate(): {res}"
        for key, value in want.items():
            assert res[key] == value, (r, key, res)


@pytest.mark.multirank
def test_fsdp2_tied_plain_embedding_and_head_chunked_in_one_unit(tworld):
    runs = tworld.run(sc.generate, "engine", tied=True, plain=True, chunk_mb=CHUNK_MB)
    _check(runs, tied=True, own_units=[True, True], same_unit=True, sharded=[True, True])
    assert all(r["chunks"] == {"model.embed_tokens": 8, "lm_head": 8} for r in runs), runs


@pytest.mark.multirank
@pytest.mark.parametrize("chunk_mb", [CHUNK_MB, 0], ids=["chunked", "whole"])
def test_fsdp2_tied_scaled_embedding_gathers_its_unit_whole(tworld, chunk_mb):
    # The head alone could be chunked, but its unit holds the scaled embedding, which FSDP2 gathers
    # whole: the tied unit is gathered whole (once per forward), nothing chunked.
    runs = tworld.run(sc.generate, "engine", tied=True, chunk_mb=chunk_mb)
    _check(runs, tied=True, own_units=[True, True], same_unit=True, sharded=[True, True], chunks={})


@pytest.mark.multirank
def test_fsdp2_untied_scaled_embedding_is_a_unit_of_its_own(tworld):
    # Gathered whole, but in its own unit: in the root it would stay gathered between forwards.
    runs = tworld.run(sc.generate, "engine", tied=False, chunk_mb=CHUNK_MB)
    _check(runs, tied=False, own_units=[True, True], same_unit=False, sharded=[True, True])
    assert all(r["chunks"] == {"lm_head": 8} for r in runs), runs


@pytest.mark.multirank
@pytest.mark.parametrize("path", ["user", "user-unit"])
def test_fsdp2_user_sharded_tied_scaled_embedding(tworld, path):
    # The user's units are kept as they are: the tied weight in the root, or in a unit of the two.
    runs = tworld.run(sc.generate, path, tied=True, chunk_mb=CHUNK_MB)
    _check(runs, tied=True, own_units=[path == "user-unit"] * 2, same_unit=True, chunks={})


@pytest.mark.multirank
@pytest.mark.parametrize("backend", ["fsdp2", "deepspeed"])
def test_from_pretrained_tied_scaled_embedding(tworld, tmp_path_factory, backend):
    if backend == "deepspeed":
        pytest.importorskip("deepspeed")
    ckpt = str(tmp_path_factory.mktemp(f"gemma-{backend}"))
    runs = tworld.run(sc.generate, "pretrained", backend, tied=True, ckpt=ckpt, chunk_mb=CHUNK_MB)
    if backend == "fsdp2":
        _check(runs, tied=True, own_units=[True, True], same_unit=True, sharded=[True, True], chunks={})
    else:  # DeepSpeed gathers per module: the head is chunked, the embedding gathered whole
        _check(runs, tied=True, chunks={"lm_head": 8})


@pytest.mark.multirank
def test_deepspeed_tied_scaled_embedding(tworld):
    pytest.importorskip("deepspeed")
    runs = tworld.run(sc.generate, "engine", "deepspeed", tied=True, chunk_mb=CHUNK_MB)
    _check(runs, tied=True, chunks={"lm_head": 8})
