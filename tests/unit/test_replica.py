"""The gather-once replica and the bucket cutter, in process (no ranks)."""

from __future__ import annotations

import pytest
import torch
from models import batch, tiny_model

from shardgen.backends.replica import Replica


@pytest.mark.parametrize("arch", ["llama", "gpt2", "mixtral"])
def test_replica_forward_equals_the_model_and_frees(arch):
    """Loaded from the model's own parameters: same logits (tied weights stay tied, buffers
    shared); freed: no parameter storage left, and it loads again."""
    model = tiny_model(arch, seed=5)  # gpt2 ties its embeddings
    ids, mask = batch([4, 2], seed=1)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
    rep = Replica(model, type(model), torch.device("cpu"))
    assert rep.nbytes() == 0
    for _ in range(2):
        for name, p in model.named_parameters():
            rep.load(name, p.detach())
        rep.finish()
        assert torch.equal(rep(input_ids=ids, attention_mask=mask).logits, ref)
        full = sum(p.numel() * p.element_size() for p in model.parameters())
        assert rep.nbytes() == full  # tied weights counted (and stored) once
        rep.free()
        assert rep.nbytes() == 0 and not rep.live
    out = rep.module.get_output_embeddings().weight
    inp = rep.module.get_input_embeddings().weight
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert (out is inp) == tied and (tied or arch != "gpt2")


def test_replica_refuses_a_model_whose_parameters_differ_from_its_config():
    model = tiny_model("llama", seed=5)
    model.extra = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="other parameters than the model"):
        Replica(model, type(model), torch.device("cpu"))


def test_cut_buckets():
    from shardgen.backends.deepspeed.buckets import cut_buckets

    assert cut_buckets([3, 3, 3, 10, 1, 1], 6) == [[0, 1], [2], [3], [4, 5]]
    assert cut_buckets([1] * 5, 100) == [[0, 1, 2, 3, 4]]
    assert cut_buckets([], 4) == []
