"""shardgen.integrations.trl.GRPOTrainer on 2 gloo ranks (FSDP2 and DeepSpeed ZeRO-3), with rank 1
making more generation calls per step than rank 0, where TRL's stock trainer fails."""

from __future__ import annotations

import importlib.util

import pytest
import trl_scenarios as sc
from world import World, WorldError, WorldHang

pytestmark = [
    pytest.mark.multirank,
    pytest.mark.skipif(
        importlib.util.find_spec("trl") is None, reason="needs trl (pip install 'shardgen[trl]')"
    ),
]

ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
STOCK_BOUND_S = 120.0  # the stock trainer aborts (gloo) or hangs (NCCL); either way it never finishes


@pytest.fixture(scope="module")
def trlworld():
    world = World(2, env=ENV, start_timeout=120.0)
    try:
        yield world
    finally:
        world.close()


def test_unsupported_trl_settings_raise():
    msgs = sc.unsupported_knobs()
    said = (
        ["min_p=0.1"],
        ["repetition_penalty=1.2"],
        ["use_vllm=True"],
        ["use_transformers_continuous_batching=True"],
        ["generation_kwargs={'no_repeat_ngram_size': 2}"],
        ["cache_implementation='static'"],
        ["min_p=0.2", "cache_implementation='static'"],
    )
    assert len(msgs) == len(said) == len(sc.UNSUPPORTED_KNOBS), msgs
    for msg, knobs in zip(msgs, said, strict=True):
        assert msg.startswith("shardgen's GRPOTrainer does not support these TRL settings: "), msg
        assert all(k in msg for k in knobs), (knobs, msg)


def _trained_with_uneven_calls(out: list[dict]) -> None:
    assert [r["steps"] for r in out] == [2, 2]
    assert out[1]["calls"] > out[0]["calls"] > 0  # rank 1 made more generation calls
    # sampling logprobs reached TRL's importance-sampling correction, and match training's
    assert len(out[0]["logp_diff"]) == 2 and all(d < 1e-4 for d in out[0]["logp_diff"])


def test_subclass_trains_with_uneven_generation_calls_deepspeed(trlworld):
    _trained_with_uneven_calls(trlworld.run(sc.grpo_two_steps, "deepspeed", timeout=300))


def test_subclass_with_speculation_keeps_the_rows_and_logs_its_stats(trlworld):
    """FSDP2, uneven generation calls, without and with ``shardgen_config={"speculate": 4}``: the
    same completions on every rank at every call (drafts change no row), and the speculation
    counters logged per step beside TRL's metrics (only with it on)."""
    plain, spec = (trlworld.run(sc.grpo_two_steps, "fsdp2", False, "fast", k, timeout=300) for k in (0, 4))
    for out in (plain, spec):
        _trained_with_uneven_calls(out)
    for r, (a, b) in enumerate(zip(plain, spec, strict=True)):
        assert b["completions"] == a["completions"], f"rank {r}: speculation changed the completions"
    keys = {"shardgen/prompt_tokens_computed", "shardgen/prompt_tokens_cached", "shardgen/generate_seconds"}
    assert all(set(h) == keys for h in plain[0]["shardgen"]), plain[0]["shardgen"]
    assert all(0.0 < h["shardgen/generate_seconds"] < 300.0 for o in (plain, spec) for h in o[0]["shardgen"])
    logged = spec[0]["shardgen"]
    assert len(logged) == 2 and all("shardgen/tokens_per_forward" in h for h in logged), logged
    assert sum(h["shardgen/drafted"] for h in logged) > 0, logged
    assert sum(h["shardgen/accepted"] for h in logged) > 0, logged
    assert max(h["shardgen/tokens_per_forward"] for h in logged) > 1.0, logged


@pytest.mark.long  # make fuzz: a third GRPO run of the world (the switch itself: test_invariant_numerics.py)
def test_subclass_under_invariant_numerics(trlworld):
    """``shardgen_config={"numerics": "invariant"}``: TRL's forwards run under the switch too. TRL
    counts a left-padded row's positions from its first column, the engine from its first token:
    RoPE is relative, so the two logprobs differ by rounding only (9.5e-7 measured), not bit for bit."""
    out = trlworld.run(sc.grpo_two_steps, "fsdp2", False, "invariant", timeout=300)
    assert [r["steps"] for r in out] == [2, 2]
    assert len(out[0]["logp_diff"]) == 2 and all(d < 1e-5 for d in out[0]["logp_diff"]), out[0]["logp_diff"]


def test_partial_rollouts_serve_whole_groups_once(trlworld):
    """max_staleness=1, groups_ahead=1: each rank gets 2 prompts a step (K=2 groups of 2); the first
    step trains on 1 group and holds 1, the second on 2 of its 3 (the held one first when whole).
    Every served group is whole (its 2 rows one prompt's), served once, and was given to that rank."""
    out = trlworld.run(sc.grpo_two_steps, "fsdp2", False, "fast", partial=True, timeout=300)
    assert [r["steps"] for r in out] == [2, 2]
    for r in out:
        assert [len(s) for s in r["served"]] == [2, 4] and r["held"] == [1, 1], r
        groups = [s[i] for s in r["served"] for i in range(0, len(s), 2)]
        assert all(s[i] == s[i + 1] for s in r["served"] for i in range(0, len(s), 2))
        assert len(set(groups)) == 3  # none served twice
        given = [p for g in r["given"] for p in g[::2]]
        assert set(groups) <= set(given) and len(given) == 4
        assert r["served"][0][0] in r["given"][0]
    assert len(out[0]["rewards"]) == 2


def test_partial_rollout_settings_are_refused_by_name():
    msgs = sc.partial_refusals()
    assert len(msgs) == 4, msgs
    assert "groups_ahead=2: the first step trains on 2 - 2 groups of 2 per rank" in msgs[0], msgs[0]
    assert "does not take rollout_func=: it generates the step itself" in msgs[1], msgs[1]
    assert "max_staleness must be an integer >= 0, got -1" in msgs[2], msgs[2]
    assert "does not take tools=: TRL's tool loop (_tool_call_loop) runs every tool turn" in msgs[3], msgs[3]
    assert "would be cut mid-loop" in msgs[3] and "rollout(env=)" in msgs[3], msgs[3]


def test_stock_trainer_fails_with_uneven_generation_calls(trlworld):
    with pytest.raises((WorldError, WorldHang)):
        trlworld.run(sc.grpo_two_steps, "fsdp2", True, timeout=STOCK_BOUND_S)
