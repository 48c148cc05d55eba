"""``numerics="invariant"``: a request's bits do not depend on its batch, and the trainer's
forward inside ``shardgen.invariant_numerics()`` gives the rollout's logprobs bit for bit.

Multi-rank: uneven prompts per rank, sampled with a seed, on FSDP2 and DeepSpeed, every gather
mode, bf16 and fp32 (tests/helpers/invariant_scenarios.py); with speculative decoding, the rows of
the plain engine. The control runs the same scenario with the
switch's op replacements removed: it must then fall short, or these tests could not fail.
"""

from __future__ import annotations

import pytest
import torch
from arch_scenarios import ARCHS, make
from invariant_scenarios import invariant_rollouts, shared_history, speculative_rollouts
from models import batch, tiny_model
from numerics import assert_rows_are_their_own_bits

import shardgen
from shardgen.numerics import ops

pytestmark = pytest.mark.multirank

CASES = [
    ("fsdp2", "per-layer", "float32"),
    ("fsdp2", "once", "bfloat16"),
    ("fsdp2", "stationary", "bfloat16"),
    ("deepspeed", "per-layer", "bfloat16"),
    ("deepspeed", "stationary", "float32"),
    ("deepspeed", "once", "bfloat16"),
]


def _all_equal(out: list[dict]) -> None:
    for r, res in enumerate(out):
        short = {k: v for k, v in res.items() if v[0] != v[1]}
        assert not short, f"rank {r}: rows equal / compared: {short}"


@pytest.mark.parametrize(("backend", "gather", "dtype"), CASES)
def test_every_row_is_its_own_bits_at_2_ranks(ds_world2, backend, gather, dtype):
    _all_equal(ds_world2.run(invariant_rollouts, backend, gather, dtype, timeout=300))


# FSDP2 at 3 ranks under the switch in `make test`: the speculative case below; this one in `make fuzz`.
@pytest.mark.parametrize(
    ("backend", "dtype"),
    [pytest.param("fsdp2", "bfloat16", marks=pytest.mark.long), ("deepspeed", "float32")],
)
def test_every_row_is_its_own_bits_at_3_ranks(ds_world3, backend, dtype):
    _all_equal(ds_world3.run(invariant_rollouts, backend, "per-layer", dtype, timeout=300))


SPECULATIVE = [
    ("fsdp2", "per-layer"),
    ("fsdp2", "once"),
    ("fsdp2", "stationary"),
    ("deepspeed", "per-layer"),
    ("deepspeed", "once"),
    ("deepspeed", "stationary"),
]


@pytest.mark.parametrize(("backend", "gather"), SPECULATIVE)
def test_speculative_rows_are_the_plain_engines_at_2_ranks(ds_world2, backend, gather):
    """``speculate``: drafts accepted and rejected, uneven rows per rank (each rank's verify forward
    its own shape), every row's tokens and logprobs the plain engine's bits."""
    _all_equal(ds_world2.run(speculative_rollouts, backend, gather, "float32", timeout=300))


@pytest.mark.parametrize("backend", ["fsdp2", "deepspeed"])
def test_speculative_rows_are_the_plain_engines_at_3_ranks(ds_world3, backend):
    _all_equal(ds_world3.run(speculative_rollouts, backend, "per-layer", "float32", timeout=300))


# fp32 and bf16, both backends, three gather modes; the third in `make fuzz`
CONTROLS = [CASES[0], CASES[5], pytest.param(*CASES[2], marks=pytest.mark.long)]


@pytest.mark.parametrize(("backend", "gather", "dtype"), CONTROLS)
def test_without_the_op_replacements_the_rows_differ(ds_world2, backend, gather, dtype):
    """The control: a case above falls short with the switch's op replacements removed (on this
    CPU every one of CASES did, in the trainer, score, alone and chunked counts; three run here,
    one of them in `make fuzz`)."""
    out = ds_world2.run(invariant_rollouts, backend, gather, dtype, False, timeout=300)
    short = [k for res in out for k, v in res.items() if v[0] != v[1]]
    assert short, f"the control matched everywhere: {out}"


# ----------------------------------------------------------------------------- one process


SERVED = ["llama", "qwen2", "qwen3", "gemma", "mistral", "phi3", "gpt_neox", "falcon", "olmo2", "starcoder2",
          "phi", "gptj", "cohere", "stablelm", "granite", "smollm3", "glm4", "gpt2", "opt"]  # fmt: skip


def _arch(arch: str):
    if arch in ARCHS:
        return make(arch)
    over = {"sliding_window": None} if arch == "mistral" else {}  # a window that never binds
    return tiny_model(arch, seed=1, **over)


@pytest.mark.parametrize("arch", SERVED)
def test_a_row_is_the_same_bits_in_any_batch_and_padding_and_in_decode(arch):
    """The model alone, no engine: a row's logits batched (left-padded among others), alone, and
    its last token decoded from a KV cache, in fp32 and bf16 (fp32 only beyond the five families
    the switch was built for: where this CPU's kernels vary most, and half the time)."""
    for dtype in (torch.float32, torch.bfloat16) if arch in SERVED[:5] else (torch.float32,):
        ids, mask = batch([5, 9, 3, 7, 12], seed=0, vocab=60)
        assert_rows_are_their_own_bits(_arch(arch).to(dtype), ids, mask, dtype)


def test_attention_and_linear_agree_with_torch_within_rounding():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 4, 7, 16, generator=g) for _ in range(3))
    mask = torch.ones(3, 1, 7, 7, dtype=torch.bool).tril()
    mask[1, :, :, :2] = False  # left padding
    mask[1, :, :2, :2] = torch.eye(2, dtype=torch.bool)  # padded queries attend themselves
    for kw in ({"attn_mask": mask}, {"is_causal": True}, {}, {"attn_mask": mask, "scale": 0.3}):
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, **kw)
        torch.testing.assert_close(ops.attention(q, k, v, **kw), ref, atol=2e-6, rtol=1e-5)
    gqa = ops.attention(q, k[:, :2], v[:, :2], attn_mask=mask, enable_gqa=True)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k[:, :2], v[:, :2], attn_mask=mask, enable_gqa=True
    )
    torch.testing.assert_close(gqa, ref, atol=2e-6, rtol=1e-5)
    x, w, b = torch.randn(37, 24, generator=g), torch.randn(40, 24, generator=g), torch.randn(40, generator=g)
    torch.testing.assert_close(ops.linear(x, w, b), torch.nn.functional.linear(x, w, b), atol=1e-5, rtol=1e-5)


def test_the_trainer_backward_runs_and_is_close_to_the_plain_one():
    model = tiny_model("llama", seed=2, hidden_size=64, intermediate_size=128)
    ids, mask = batch([6, 10, 4], seed=3)
    grads = []
    for on in (False, True):
        model.zero_grad()
        with shardgen.invariant_numerics(on):
            loss = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
            loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert torch.isfinite(grads[1]).all()
    torch.testing.assert_close(grads[1], grads[0], atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize(
    ("arch", "over", "word"),
    [
        ("mistral", {}, "sliding window"),
        ("mixtral", {}, "mixture of experts"),
        ("llama", {"eager": 1}, "eager"),
    ],
)
def test_a_model_the_switch_cannot_serve_is_refused_by_name(arch, over, word):
    model = tiny_model(arch, seed=0)
    if over.get("eager"):
        model.set_attn_implementation("eager")
    with pytest.raises(ValueError, match=word):
        shardgen.Engine(model, backend="local", numerics="invariant")


def test_numerics_is_checked_at_the_door():
    with pytest.raises(ValueError, match="numerics"):
        shardgen.Engine(tiny_model("llama"), backend="local", numerics="exact")


# The sharing is the driver's, whatever the backend: DeepSpeed stationary and the control in
# `make fuzz`.
@pytest.mark.parametrize(
    ("backend", "gather"),
    [("fsdp2", "per-layer"), pytest.param("deepspeed", "stationary", marks=pytest.mark.long)],
)
def test_drafts_come_from_the_rollouts_of_other_ranks(ds_world3, backend, gather):
    """A prompt dealt to another rank each call drafts from the rollout the rank before answered:
    every call after the first accepts most of its answer, the rows the plain engine's."""
    for r, res in enumerate(ds_world3.run(shared_history, backend, gather, timeout=300)):
        assert res["equal"], f"rank {r}: rows differ from the plain engine's"
        assert all(a >= 10 for a in res["accepted"][1:]), f"rank {r}: accepted per call {res['accepted']}"
        # Two peers' rollouts of every call but the last (whose may not be carried yet).
        assert res["received"] >= 2 * 2, f"rank {r}: received {res['received']}"
        assert res["payload"] > 0, res


@pytest.mark.long
def test_without_sharing_no_draft_comes_from_another_ranks_prompt(ds_world3):
    """The control, ``speculate_share=False``: each rank's rollouts kept on it (the tick carries no
    payload), the same calls accept next to nothing (the prompts' answers share no numbers), so
    the test above measures the sharing."""
    for r, res in enumerate(ds_world3.run(shared_history, "fsdp2", "per-layer", False, timeout=300)):
        assert res["received"] == 0 and max(res["accepted"][1:]) < 3, f"rank {r}: {res}"
        assert res["payload"] == 0, res
