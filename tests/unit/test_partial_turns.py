"""Tier 1 (no processes): held conversations, partial rollouts of multi-turn rows
(``rollout(..., env=, groups=K)``, ``generation/partial.py`` and ``turns.Talk``) on the local
backend. The same on sharded backends, 2 and 3 ranks: tests/multirank/test_turns_multirank.py."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from models import tiny_model
from numerics import LOGPROB_ATOL
from rollout_scenarios import check_versions, id_prompts, shrink_weights
from turns_scenarios import rows_of

import shardgen
from shardgen.generation.partial import held_groups

# Turns of exactly max_new_tokens (no EOS), greedy: which turn a call cuts where is known.
KW = dict(n=2, max_new_tokens=4, eos_token_id=[], do_sample=False, temperature=0.9)
REPLY = [5, 6, 7]


def recording_env(turns_of) -> tuple:
    """An env that ends row ``r`` after ``turns_of(r)`` model turns, replying ``REPLY``; and its
    log of ``(row, model turns so far, thread, the conversation's length before the turn)``."""
    log: list[tuple[int, int, int, int]] = []

    def env(row, c):
        seen = 1 + sum(1 for x in log if x[0] == row)
        log.append((row, seen, threading.get_ident(), len(c.prompt_token_ids)))
        return None if seen >= turns_of(row) else list(REPLY)

    return env, log


def _wait_turns_ended(eng, limit: float = 20.0) -> None:
    """Until every held conversation's turn in flight has ended (it then waits at its boundary)."""
    t0 = time.monotonic()
    while any(f is not None and not f.done() for g in eng._held.groups() for f in g.talk.turn):
        assert time.monotonic() - t0 < limit, "held turns still decoding"
        time.sleep(0.01)


def test_held_conversations_are_served_once_whole_and_resume_at_their_turn(engine):
    """groups=1 of 3 prompts whose conversations take 2, 3 and 4 turns: the call returns the
    first whole group; the others' turns end in the background and wait at their boundary (no
    step_fn runs between calls); the next call, without env=, steps them in its thread with the
    first call's step_fn and row numbers, at the turn where they stood. Every group comes back
    once, whole, as the same conversations without a quota."""
    eng, _, _ = engine
    prompts = id_prompts([4, 6, 5], seed=2)
    turns_of = lambda r: 2 + r // 2  # noqa: E731 (prompt i's rows take i + 2 turns)
    plain_env, _ = recording_env(turns_of)
    plain = eng.rollout(prompts, env=plain_env, max_turns=4, **KW)
    env, log = recording_env(turns_of)
    first = list(eng.rollout_iter(prompts, env=env, groups=1, max_turns=4, **KW))
    assert [i for i, _ in first] == [0] and first[0][1].turns == [2, 2]
    assert held_groups(eng) == 2
    _wait_turns_ended(eng)
    stepped = len(log)
    time.sleep(0.05)
    assert len(log) == stepped, "a held conversation was stepped with no call running"
    rest = eng.rollout([], groups=2, **KW)
    assert held_groups(eng) == 0 and len(eng._held) == 0
    before, later = {x[0] for x in log[:stepped]}, log[stepped:]
    assert {2, 3, 4, 5} <= before, log  # their first turns were stepped by the first call
    assert {x[0] for x in later} == {2, 3, 4, 5}, later  # the first call's row numbers
    assert all(x[1] >= 2 for x in later)  # resumed at their turn, not from the start
    assert all(x[2] == threading.get_ident() for x in log)  # the callers' thread, each time
    for row, turn, _, length in log:  # the whole conversation so far before each turn
        assert length == len(prompts[row // 2]) + (turn - 1) * (KW["max_new_tokens"] + len(REPLY))
    served = [first[0][1].prompts[0], *rest.prompts]
    assert sorted(map(tuple, served)) == sorted(map(tuple, prompts))  # each once
    by_prompt = {}
    for b in (first[0][1], rest):
        for k, p in enumerate(b.prompts):
            by_prompt[tuple(p)] = rows_of(b)[k * 2 : k * 2 + 2]
    want = rows_of(plain)
    for i, p in enumerate(prompts):
        for a, b in zip(by_prompt[tuple(p)], want[i * 2 : i * 2 + 2], strict=True):
            for key in ("prompt", "tokens", "mask", "turns", "finish"):
                assert a[key] == b[key], (i, key, a[key], b[key])
            assert max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"], strict=True)) <= LOGPROB_ATOL


def test_a_held_conversation_resumes_after_a_step_under_the_new_weights(engine):
    """tokens_per_call counts per call over a conversation's turns. A (budget 4: its first turn
    spends it, so it waits at its turn boundary through the step) and B (budget 6: its second
    turn is cut at 2 tokens, mid-turn at the step). After the step both go on under the new
    weights: every model token is its version's argmax with its version's logprob (the
    conversation fed in as a prompt to the new weights; no KV of the old ones from the prefix
    cache, which the step dropped)."""
    eng, model, ref = engine
    a, b = id_prompts([20, 22], seed=4)  # over a block: the prefix cache serves
    env, log = recording_env(lambda r: 3)
    assert len(eng.rollout([a], env=env, groups=1, tokens_per_call=4, max_turns=3, **KW)) == 0
    assert log == [] and held_groups(eng) == 1  # A: 4 tokens, its budget spent: not stepped
    env_b, log_b = recording_env(lambda r: 3)
    assert len(eng.rollout([b], env=env_b, groups=1, tokens_per_call=6, max_turns=3, **KW)) == 0
    talk_b = eng._held.groups()[1].talk
    assert [len(s.tokens) for s in talk_b.seqs] == [2, 2]  # 6 - 4 left for its second turn
    assert [x[0] for x in log] == [0, 1]  # A stepped once more by that call (a whole budget)
    cached = eng.stats()["cached_prompt_tokens"]
    assert cached > 0  # A's second turn was served its first turn's KV
    with eng.paused():
        shrink_weights(model)
    got = eng.rollout([], groups=2, **KW)
    assert held_groups(eng) == 0 and got.turns == [3] * 4
    assert eng.stats()["prefix_cache_drops"] > 0
    assert check_versions(got, ref, 0.9, greedy=True) == 4  # every row spans the step
    drawn = [[v for v in row if v >= 0] for row in got.versions.tolist()]
    by = {tuple(p): drawn[k * 2 : k * 2 + 2] for k, p in enumerate(got.prompts)}
    assert by[tuple(a)] == [[0] * 8 + [1] * 4] * 2  # stepped at the boundary after the step
    assert by[tuple(b)] == [[0] * 6 + [1] * 6] * 2  # its second turn parked mid-answer


@pytest.mark.parametrize("stale", ["finish", "drop"])
def test_held_conversations_past_max_staleness(engine, stale):
    """max_staleness=0: after one step, a conversation waiting at its boundary (A) and one cut
    mid-turn (B) are past it: ``finish`` serves both cut where they stood (finish "stale", no
    turn under the new weights, step_fn not run again); ``drop`` never serves them."""
    eng, model, _ = engine
    a, b = id_prompts([5, 7], seed=6)
    env, log = recording_env(lambda r: 3)
    kw = dict(KW, max_staleness=0, stale=stale)
    eng.rollout([a], env=env, max_turns=3, groups=1, tokens_per_call=4, **kw)
    eng.rollout([b], env=env, max_turns=3, groups=1, tokens_per_call=6, **kw)
    assert held_groups(eng) == 2
    with eng.paused():
        shrink_weights(model)
    stepped = len(log)
    if stale == "drop":
        assert held_groups(eng) == 0
        assert len(eng.rollout([], groups=0, **kw)) == 0 and len(eng._held) == 0
        return
    got = eng.rollout([], groups=2, **kw)
    assert got.finish_reasons == ["stale"] * 4 and len(log) == stepped
    assert sorted(map(tuple, got.prompts)) == sorted([tuple(a), tuple(b)])
    assert set(got.versions.flatten().tolist()) <= {-1, 0}  # nothing drawn after the step
    assert sorted(got.turns) == [2, 2, 2, 2]  # A waited after its 2nd turn, B was cut in its 2nd


@pytest.mark.timeout(60)
def test_close_ends_held_conversations_without_hanging():
    """Held conversations at close(): one waiting at its turn boundary, one mid-turn (240 tokens
    to go): close returns at once, the turn in flight resolves as "held" where it stood, no
    step_fn runs, and the engine refuses calls after."""
    torch.set_num_threads(1)
    eng = shardgen.Engine(tiny_model("llama", seed=11), backend="local", max_batch_size=8)
    env, log = recording_env(lambda r: 5)
    a, b = id_prompts([5, 7], seed=8)
    eng.rollout([a], env=env, groups=1, tokens_per_call=4, max_turns=5, **KW)
    eng.rollout([b], env=env, groups=0, max_turns=5, **{**KW, "max_new_tokens": 240})
    talks = [g.talk for g in eng._held.groups()]
    t0 = time.monotonic()
    eng.close()
    assert time.monotonic() - t0 < 10
    ends = [f.result(timeout=10) for f in talks[1].turn]
    assert [c.finish_reason for c in ends] == ["held", "held"]
    assert all(len(c.token_ids) < 240 for c in ends)
    assert log == []  # a groups=0 call steps nothing; nothing after close
    with pytest.raises(shardgen.EngineClosedError, match="engine is closed"):
        eng.rollout([], groups=0, **KW)


def test_held_conversations_refused_with_an_encoder_decoder():
    from encdec_models import tiny_t5

    torch.set_num_threads(1)
    with shardgen.Engine(tiny_t5(), backend="local", max_batch_size=4) as eng:
        with pytest.raises(ValueError, match=r"groups= \(a partial rollout\) needs a decoder-only model"):
            eng.rollout([[5, 6, 7]], n=2, env=lambda r, c: None, groups=1, max_new_tokens=3)
