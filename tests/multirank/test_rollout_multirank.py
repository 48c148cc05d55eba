"""``engine.rollout()`` and training inside ``engine.paused()`` on 2 gloo ranks, FSDP2 and DeepSpeed.

One World for the module (DeepSpeed's CPU accelerator set), every run under a hard timeout.
"""

from __future__ import annotations

import pytest
import rollout_scenarios as sc
from models import tiny_model
from numerics import assert_rows_agree

from shardgen.config import SamplingParams

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("backend", ["fsdp2", "deepspeed"])
def test_rollout_logprobs_match_teacher_forcing(ds_world2, backend):
    out = ds_world2.run(sc.logprobs_sharded, backend, timeout=180)
    for r, res in enumerate(out):
        assert all(d < 1e-5 for d in res["diffs"].values()), f"rank {r}: {res['diffs']}"
    reasons = out[0]["reasons"] + out[1]["reasons"]
    assert "eos" in reasons and "length" in reasons  # ranks stopped at different steps
    assert out[1]["empty"] == 0 and out[1]["empty_s"] < 1.0


@pytest.mark.parametrize("mode", ["fsdp2-user", "fsdp2", "deepspeed"])
def test_training_between_rollouts(ds_world2, mode):
    """The losses equal those of the same steps without an engine; the user's setup is in place
    inside each pause and shardgen's after it; each rollout after a step sees the new weights."""
    out = ds_world2.run(sc.train_between, mode, timeout=240)
    for r, res in enumerate(out):
        assert res["losses"] == res["base"], f"rank {r}: {res['losses']} != {res['base']}"
        assert all(res["changed"]) and len(res["changed"]) == 2, f"rank {r}: {res['changed']}"
        assert all(res["restored"]), f"rank {r}: {res['restored']}"


# Each backend and gather mode in `make test`; DeepSpeed per layer and FSDP2 stationary in `make fuzz`.
@pytest.mark.parametrize(
    "backend, gather, max_prefill_tokens",
    [
        ("fsdp2", "per-layer", None),
        pytest.param("deepspeed", "per-layer", None, marks=pytest.mark.long),
        ("fsdp2", "once", None),
        pytest.param("fsdp2", "stationary", None, marks=pytest.mark.long),
        ("deepspeed", "stationary", 7),
    ],
)
def test_shared_prefill_on_and_off_keep_the_numeric_promise(ds_world2, backend, gather, max_prefill_tokens):
    """n = 1, 3, 8; ranks holding 3 and 1 prompts, then 2 and none; batches of 5 (refills). The
    sharded heads compute in chunks whose GEMMs depend on their input's strides: caught here.
    Stationary: the exchanges sized from the tick's (tokens, head rows) of forked and chunked
    prefills (7 tokens a forward: a rank's chunk beside another's decode step). A prompt
    prefilled once has other rows than n copies of it: the rows agree as tests/helpers/numerics.py
    promises, not bit for bit."""
    out = ds_world2.run(sc.share_on_off, backend, gather, max_prefill_tokens, timeout=300)
    assert all(res["policy"] == gather for res in out)
    model = tiny_model("llama", seed=7)  # share_on_off's weights, for the near-tie checks
    params = SamplingParams(do_sample=True, temperature=0.9)
    for r, res in enumerate(out):
        (on, on_tokens), (off, off_tokens) = res[True], res[False]
        for k, (a, b) in enumerate(zip(on, off, strict=True)):
            assert_rows_agree(a, b, model=model, params=params, what=f"rank {r}, rollout {k}")
        assert on_tokens < off_tokens, f"rank {r}: {on_tokens} prefill tokens shared, {off_tokens} not"
    assert any(len(rows) == 24 for rows in out[0][True][0])  # rank 0: 3 prompts x 8 samples


@pytest.mark.parametrize("mode", ["fsdp2-user", "deepspeed"])
def test_engines_opened_and_closed_on_a_user_model_leave_nothing_on_it(ds_world2, mode):
    """An engine per rollout on the user's own sharded model: after close the model keeps none of
    the engine's hooks (each would keep the closed engine, its groups and their gloo threads
    alive, and run on every later forward, training steps included), and the threads come back."""
    out = ds_world2.run(sc.engines_leave_the_model, mode, timeout=240)
    for r, res in enumerate(out):
        before, after = res["hooks"]
        assert after == before, f"rank {r}: {after - before} hooks left on the model by closed engines"
        assert not any(res["alive"]), f"rank {r}: closed engines' backends still alive: {res['alive']}"
        assert res["threads"][1] == res["threads"][0], f"rank {r}: native threads {res['threads']}"


def _served_once(out: list[dict], stale: str) -> int:
    """Every prompt's group served once at most, whole (the scenario checks each batch), with
    tokens of versions within max_staleness (1) of its step; ``finish``: every group served,
    those held past max_staleness with their unfinished rows cut as ``stale``; ``drop``: a group
    served within max_staleness of its step, or never. -> rows spanning two versions, all ranks."""
    for r, res in enumerate(out):
        got = [s[0] for s in res["served"]]
        assert len(got) == len(set(got)), f"rank {r}: a group served twice: {got}"
        assert res["left"] == 0, f"rank {r}: {res['left']} groups still held"
        if stale == "finish":
            assert sorted(got) == sorted(tuple(p) for p in res["born"]), f"rank {r}: served {got}"
        for prompt, born, step, _ in res["served"]:
            assert step >= born, f"rank {r}: {prompt} served at step {step}, before step {born}"
            assert stale == "finish" or step - born <= 1, f"rank {r}: {prompt} of step {born} at {step}"
    return sum(res["spans"] for res in out)


@pytest.mark.parametrize(
    "backend, gather, greedy, stale",
    [
        ("fsdp2", "per-layer", True, "finish"),
        ("deepspeed", "per-layer", False, "drop"),
        ("fsdp2", "once", False, "drop"),
        ("deepspeed", "stationary", True, "finish"),
    ],
)
def test_partial_rollouts_serve_every_group_once_and_resume_under_new_weights(
    ds_world2, backend, gather, greedy, stale
):
    """Quota calls over 3 training steps, uneven prompts and held rows: every group served once,
    whole; every token's logprob (and greedy, its argmax) that of the weights of its version, so
    a row resumed after a step equals its prefix fed to the new weights; some rows span a step."""
    out = ds_world2.run(sc.partial_steps, backend, gather, greedy, stale, timeout=240)
    assert _served_once(out, stale) > 0, "no row was parked mid-answer and resumed"


def test_close_with_held_rows_resolves_them(ds_world2):
    """Ranks close with held rows (rank 0 a generate row cut at its budget, rank 1 groups still
    decoding): close() returns, every held row resolves as "held" with the tokens it had."""
    out = ds_world2.run(sc.close_with_held_rows, "fsdp2", timeout=60)
    assert out[0]["ends"] == [("held", 4)], out[0]
    assert len(out[1]["ends"]) == 4 and all(r == "held" and t < 48 for r, t in out[1]["ends"]), out[1]


@pytest.mark.parametrize("backend, greedy, speculate", [("fsdp2", False, 4), ("deepspeed", True, 0)])
def test_partial_rollouts_at_3_ranks(ds_world3, backend, greedy, speculate):
    """The same at 3 ranks: 4, 3 and 2 new prompts a step for a quota of 2, so held groups pile
    up unevenly (the last rank's quota takes every group it can: it holds fewer). On FSDP2 with
    speculative decoding: verify forwards commit tokens of held rows and of rank 0's
    ``tokens_per_call`` row, each token still its version's."""
    out = ds_world3.run(sc.partial_steps, backend, "per-layer", greedy, "finish", speculate, timeout=240)
    assert _served_once(out, "finish") > 0, "no row was parked mid-answer and resumed"
    if speculate:
        got = [r["verified"] for r in out]  # (verify forwards, draft tokens accepted) per rank
        assert all(v > 0 for v, _ in got) and sum(a for _, a in got) > 0, got
