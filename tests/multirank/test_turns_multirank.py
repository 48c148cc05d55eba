"""Multi-turn rollouts and the prefix cache on 2 and 3 gloo ranks, FSDP2 and DeepSpeed, every
gather mode: conversations with uneven turns per rank and row (a rank with none), the cache on
against off (the same rows), and no stale KV after a ``paused()`` that changed the weights.

One World of 2 ranks for the module, one of 3 for the 3-rank tests; every run under a hard timeout.
Held conversations (partial rollouts with ``env=``) at 2 and 3 ranks, both backends, across a step.
"""

from __future__ import annotations

import pytest
import turns_scenarios as ts
from turns_scenarios import assert_conversations

pytestmark = pytest.mark.multirank


# Every gather mode and both backends in `make test` (prefills chunked and whole); DeepSpeed once
# and FSDP2 stationary in `make fuzz`.
@pytest.mark.parametrize(
    "backend, gather, max_prefill_tokens",
    [
        ("fsdp2", "per-layer", None),
        ("deepspeed", "per-layer", 7),
        ("fsdp2", "once", 7),
        pytest.param("deepspeed", "once", None, marks=pytest.mark.long),
        pytest.param("fsdp2", "stationary", None, marks=pytest.mark.long),
        ("deepspeed", "stationary", 7),
    ],
)
def test_conversations_uneven_turns_2_ranks(ds_world2, backend, gather, max_prefill_tokens):
    out = ds_world2.run(ts.conversations, backend, gather, max_prefill_tokens, timeout=240)
    for res in out:
        assert res["on"]["policy"] == gather
        assert_conversations(res)
    turns = [[row["turns"] for row in res["on"]["greedy"]] for res in out]
    assert turns[0] != turns[1], turns  # ranks took different numbers of turns


# DeepSpeed stationary in `make test`, FSDP2 per layer in `make fuzz` (both gather modes of both
# backends also at 2 ranks above).
@pytest.mark.parametrize(
    "backend, gather",
    [("deepspeed", "stationary"), pytest.param("fsdp2", "per-layer", marks=pytest.mark.long)],
)
def test_conversations_3_ranks_both_backends(ds_world3, backend, gather):
    """Rank 2 has no prompt: it joins every tick, pause included, with no conversation."""
    out = ds_world3.run(ts.conversations, backend, gather, 7, timeout=240)
    for res in out[:2]:
        assert_conversations(res)
    assert out[2]["on"]["greedy"] == [] and out[2]["on"]["computed"] == 0


@pytest.mark.parametrize("backend", ["fsdp2", "deepspeed"])
def test_held_conversations_across_a_step_2_ranks(ds_world2, backend):
    """Partial rollouts of conversations (``env=`` with ``groups=``): rank 0 holds 2 groups,
    rank 1 one, through a ``paused()`` that changes the weights; the next call serves them whole,
    resumed at their turn under the new weights (each token its version's argmax and logprob)."""
    ts.assert_held_conversations(ds_world2.run(ts.held_conversations, backend, timeout=120))


def test_held_conversations_across_a_step_3_ranks(ds_world3):
    """The same at 3 ranks, both backends: rank 2 holds none."""
    for backend in ("fsdp2", "deepspeed"):
        ts.assert_held_conversations(ds_world3.run(ts.held_conversations, backend, timeout=120))


@pytest.mark.parametrize("backend", ["fsdp2", "deepspeed"])
def test_once_keeps_the_whole_weights_between_turns(ds_world2, backend):
    """``gather="once"``: a multi-turn call gathers the whole model once, not once per turn (each
    turn's environment step leaves every rank idle), a partial rollout's call too; the weights go
    back when the call returns, and after ``TURN_HOLD_TICKS`` idle ticks when its iterator is
    left open."""
    from shardgen.core.driver import SHALLOW_IDLE_SLEEP_S, TURN_HOLD_TICKS

    for r, res in enumerate(ds_world2.run(ts.turn_gaps, backend, timeout=120)):
        assert res["turns"] == [1, 3], (r, res)
        assert res["gathers"] == 1, f"rank {r}: the whole model gathered {res['gathers']} times in one call"
        assert res["after_call"], f"rank {r}: the weights stayed gathered after the call"
        assert res["first"] == 0 and res["open_calls"] == 1, (r, res)
        assert res["after_open"], f"rank {r}: an open multi-turn iterator held the weights for good"
        # not at the first idle tick: held for a turn that could come, TURN_HOLD_TICKS idle ticks
        # (all but the first few sleep SHALLOW_IDLE_SLEEP_S: about a second)
        assert res["held_s"] > TURN_HOLD_TICKS * SHALLOW_IDLE_SLEEP_S / 2, (r, res)
        assert sorted(res["quota_turns"]) == [1, 3] and res["quota_gathers"] == 1, (r, res)
