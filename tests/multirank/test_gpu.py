"""Tier 3 (CUDA only, skipped elsewhere): the engine on a GPU, single process and FSDP2 over NCCL."""

from __future__ import annotations

import pytest
import torch
from models import batch, hf_generate, tiny_model
from numerics import assert_rows_are_their_own_bits

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


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_fsdp2_nccl_two_gpus_uneven_calls():
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "helpers" / "gpu_rank.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rank 0: ok" in proc.stdout and "rank 1: ok" in proc.stdout


@pytest.mark.parametrize("backend", ["fsdp2", "deepspeed"])
def test_stationary_on_cuda_world_size_1(backend):
    """gather="stationary" at world size 1 on a CUDA device (NCCL parameter group, gloo control
    plane): CUDA tensors through the whole stationary forward; greedy == HF on the same device."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "helpers" / "gpu_rank.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", str(script)]
    env = {**os.environ, "GATHER": "stationary", "BACKEND": backend}
    env.pop("DS_ACCELERATOR", None)  # DeepSpeed picks its CUDA accelerator
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rank 0: ok" in proc.stdout


def test_invariant_numerics_on_cuda_rows_are_their_own_bits():
    """The switch's ops on a CUDA device (their tile checks measure the GPU's kernels): a row's
    logits batched, alone and decoded from the KV cache are the same bits, in bf16."""
    model = tiny_model("llama", seed=1, hidden_size=64, intermediate_size=128).cuda().to(torch.bfloat16)
    ids, mask = batch([5, 9, 3, 7], seed=0)
    assert_rows_are_their_own_bits(model, ids.cuda(), mask.cuda())
