"""``engine.score()`` on 2 and 3 gloo ranks, FSDP2 and DeepSpeed: uneven rows (a rank with none,
a rank generating meanwhile, a rank scoring from a second thread), every gather mode, chunked
rows, shared prompts, a rollout rescored under teacher prompts, and two engines at once.

One World of 2 ranks for the module (DeepSpeed's CPU accelerator set), one of 3 for the last
tests; every run under a hard timeout.
"""

from __future__ import annotations

import pytest
import score_scenarios as sc

pytestmark = pytest.mark.multirank

TOL = 2e-5


@pytest.mark.parametrize(
    "backend, gather, max_prefill_tokens",
    [
        ("fsdp2", "per-layer", None),
        ("fsdp2", "per-layer", 6),
        ("deepspeed", "per-layer", 5),
        ("fsdp2", "once", 6),
        ("deepspeed", "once", None),
        ("fsdp2", "stationary", 6),
        ("deepspeed", "stationary", None),
    ],
)
def test_score_uneven_rows_match_hf(ds_world2, backend, gather, max_prefill_tokens):
    out = ds_world2.run(sc.score_uneven, backend, gather, max_prefill_tokens, timeout=180)
    assert all(res["policy"] == gather for res in out)
    for r, res in enumerate(out):
        assert res["diff"] < TOL, f"rank {r}: {res['diff']}"
    assert out[1]["gen"] == 12  # rank 1 generated all along, beside rank 0's scoring


@pytest.mark.parametrize(
    "arch, backend, gather",
    [
        ("gemma", "fsdp2", "per-layer"),  # tied, scaled embeddings
        ("gemma", "deepspeed", "per-layer"),
        ("mixtral", "deepspeed", "per-layer"),  # MoE blocks gathered as one unit
        ("gpt2", "fsdp2", "stationary"),  # Conv1D: per-module fallbacks beside the exchanges
    ],
)
def test_score_architectures(ds_world2, arch, backend, gather):
    out = ds_world2.run(sc.score_uneven, backend, gather, 5, arch, timeout=180)
    assert all(res["policy"] == gather for res in out)
    assert all(res["diff"] < TOL for res in out), [res["diff"] for res in out]


@pytest.mark.parametrize("backend", ["fsdp2", "deepspeed"])
def test_rescore_rollout_under_teacher_prompts(ds_world2, backend):
    out = ds_world2.run(sc.rescore_rollout, backend, timeout=180)
    for r, res in enumerate(out):
        assert res["self"] < TOL and res["teacher"] < TOL, f"rank {r}: {res}"
    assert [res["rows"] for res in out] == [6, 3]


@pytest.mark.parametrize("backend", ["fsdp2", "deepspeed"])
def test_two_engines_at_once(ds_world2, backend):
    out = ds_world2.run(sc.two_engines, backend, timeout=180)
    for r, res in enumerate(out):
        assert res["diff"] < TOL and res["gen_ok"] and res["student_after"] == 4, f"rank {r}: {res}"
    assert out[0]["groups"][0] != out[0]["groups"][1]  # each engine has its own keys and groups


def test_score_three_ranks_both_backends(ds_world3):
    """3 ranks: rank 0 scores, rank 1 has no rows and generates, rank 2 scores from a thread
    beside its own generate(); FSDP2 per layer with chunks, DeepSpeed stationary."""
    world = ds_world3
    for backend, gather, chunk in (("fsdp2", "per-layer", 5), ("deepspeed", "stationary", None)):
        out = world.run(sc.score_uneven, backend, gather, chunk, timeout=180)
        assert all(res["diff"] < TOL for res in out), (backend, [res["diff"] for res in out])
        assert out[1]["gen"] == 12 and out[2]["gen"] == 6
