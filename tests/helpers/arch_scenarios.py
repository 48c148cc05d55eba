"""Decoder architectures beyond the dev ones (tests/helpers/models.py), each a 2-layer model built from
``AutoConfig.for_model``, for tests/multirank/test_arch_matrix.py: greedy tokens on ranks with uneven
prompts against single-process HF ``generate()``."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from models import batch, hf_generate

#: model type -> its config's own settings beside the shared ones (``make``).
ARCHS: dict[str, dict[str, Any]] = {
    "phi3": dict(intermediate_size=64, num_key_value_heads=2),
    "gpt_neox": dict(intermediate_size=64),
    "falcon": dict(),
    "gemma2": dict(intermediate_size=64, num_key_value_heads=2, head_dim=8, sliding_window=8),
    "gemma3_text": dict(intermediate_size=64, num_key_value_heads=2, head_dim=8, sliding_window=8),
    "qwen3": dict(intermediate_size=64, num_key_value_heads=2, head_dim=8),
    "qwen3_moe": dict(
        intermediate_size=64,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        num_key_value_heads=2,
        head_dim=8,
    ),  # fmt: skip
    "olmo2": dict(intermediate_size=64, num_key_value_heads=2),
    "starcoder2": dict(intermediate_size=64, num_key_value_heads=2),
    "phi": dict(intermediate_size=64),
    "gptj": dict(n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=256),
    "bloom": dict(n_embd=32, n_layer=2, n_head=4),
    "cohere": dict(intermediate_size=64, num_key_value_heads=2),
    "stablelm": dict(intermediate_size=64, num_key_value_heads=2),
    "granite": dict(intermediate_size=64, num_key_value_heads=2),
    "smollm3": dict(intermediate_size=64, num_key_value_heads=2),
    "glm4": dict(intermediate_size=64, num_key_value_heads=2, head_dim=8),
}


def make(arch: str, seed: int = 0) -> Any:
    """A 2-layer ``arch`` with random weights of ``seed``, in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kw: dict[str, Any] = dict(
        vocab_size=96, bos_token_id=1, eos_token_id=2, pad_token_id=0, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=256,
    )  # fmt: skip
    kw.update(ARCHS[arch])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **kw)).eval()
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 2
    return model


def arch_equal(arch: str, backend: str, gather: str) -> dict[str, Any]:
    """Rank 0: three prompts, rank 1: one; 6 tokens each, no EOS. -> the gather policy run and the
    rows whose tokens differ from HF's."""
    import shardgen

    r = dist.get_rank()
    model, ref = make(arch), make(arch)
    ids, mask = batch([5, 9, 3] if r == 0 else [7], seed=10 + r)
    prompts = [ids[i][mask[i].bool()].tolist() for i in range(ids.shape[0])]
    with shardgen.Engine(model, backend=backend, gather=gather) as eng:
        got = eng.generate(prompts, max_new_tokens=6, eos_token_id=[])
    ref.generation_config.eos_token_id = None  # HF merges a None argument with the model's EOS
    bad = []
    for p, c in zip(prompts, got, strict=True):
        x = torch.tensor([p])
        want = hf_generate(ref, x, torch.ones_like(x), max_new_tokens=6)[0, len(p) :].tolist()
        if c.token_ids != want:
            bad.append((p, c.token_ids, want))
    return {"policy": eng.gather_policy, "bad": bad}
