"""Tier 3 (CUDA only, skipped elsewhere): the engine on a GPU, single process and FSDP2 over NCCL."""

from __future__ import annotations

import pytest
import torch
from models import batch, hf_generate, tiny_model

import shardgen

pytestmark = pytest.mark.gpu


def test_local_engine_on_cuda_matches_hf():
    model = tiny_model("llama", seed=41).cuda()
    ids, mask = batch([3, 7, 5], seed=42)
    ids, mask = ids.cuda(), mask.cuda()
    expected = hf_generate(model, ids, mask, max_new_tokens=12)
    with shardgen.Engine(model, backend="local") as eng:
        assert eng.device.type == "cuda"
        got = eng.generate_ids(ids, attention_mask=mask, max_new_tokens=12)
    assert got.device.type == "cuda" and torch.equal(got, expected)


def gpu_fsdp2_scenario():
    import os

    import torch.distributed as dist

    ref = tiny_model("llama", seed=43).cuda()
    eng = shardgen.Engine(tiny_model("llama", seed=43), backend="fsdp2")  # moves to cuda:LOCAL_RANK
    assert eng.device == torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    ids, mask = batch([4, 6], seed=44 + dist.get_rank())
    got = eng.generate_ids(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=10)
    assert torch.equal(got, hf_generate(ref, ids.cuda(), mask.cuda(), max_new_tokens=10))
    eng.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_fsdp2_nccl_two_gpus():
    from world import run_ranks

    run_ranks(2, gpu_fsdp2_scenario, timeout=180)
