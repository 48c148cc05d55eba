"""Tier 1 (no processes): partial rollouts (``rollout(groups=K)``, ``generation/partial.py``) on
the local backend. The same on sharded backends, 2 and 3 ranks: tests/multirank/test_rollout_multirank.py."""

from __future__ import annotations

import contextlib

import pytest
import torch
from models import tiny_model
from numerics import assert_rows_agree, rollout_rows
from rollout_scenarios import EOS, check_versions, id_prompts, shrink_weights

import shardgen
from shardgen.config import SamplingParams
from shardgen.generation.partial import held_groups

KW = dict(n=2, max_new_tokens=12, eos_token_id=[2], temperature=0.9, seed=5)


def test_rows_cut_at_their_budget_resume_where_they_were(engine):
    """tokens_per_call=4: a call returns no group until its rows are whole; each call gives the
    rows 4 more tokens, re-prefilled from their prefix with their own generator's draws going on:
    the rows equal a plain rollout's with the same seeds (near-ties aside), served exactly once."""
    eng, model, _ = engine
    prompts = id_prompts([4, 6, 5], seed=2)
    plain = eng.rollout(prompts, **KW)
    got, calls = [], 0
    todo = prompts
    while len(got) < 3:
        calls += 1
        assert calls < 6, f"{held_groups(eng)} groups still held after {calls} calls"
        got += [g for _, g in eng.rollout_iter(todo, groups=3 - len(got), tokens_per_call=4, **KW)]
        todo = []
    assert calls == 3 and held_groups(eng) == 0  # 12 tokens: 4 a call
    by_prompt = {tuple(g.prompts[0]): g for g in got}
    assert sorted(by_prompt) == sorted(tuple(p) for p in prompts)
    again = [by_prompt[tuple(p)] for p in prompts]
    params = SamplingParams(do_sample=True, temperature=0.9)
    from shardgen.generation.rollout import concat

    assert_rows_agree(rollout_rows(concat(again)), rollout_rows(plain), model=model, params=params)
    assert eng.stats()["prefills"] > 3  # the cut rows were prefilled again


def test_a_held_row_resumes_after_a_step_under_the_new_weights(engine):
    """Greedy rows cut at 4 tokens a call, the weights shrunk inside ``paused()``, then resumed: their
    first 4 tokens are version 0 with version 0's logprobs, the rest version 1's, each the
    argmax of its version given the prefix (a row fed its prefix under the new weights)."""
    eng, model, ref = engine
    prompts = id_prompts([5, 3], seed=4)
    kw = {**KW, "do_sample": False, "eos_token_id": EOS[-1:]}
    b = eng.rollout(prompts, groups=2, tokens_per_call=4, **kw)
    assert len(b) == 0 and held_groups(eng) == 2
    with eng.paused():
        shrink_weights(model)
    assert eng.version == 1
    got = []
    for _ in range(3):  # 8 tokens left, 4 a call (or 8 in one, where the pause gave them 4 first)
        got += [g for _, g in eng.rollout_iter([], groups=2 - len(got), tokens_per_call=4, **kw)]
        if len(got) == 2:
            break
    from shardgen.generation.rollout import concat

    b = concat(got)
    assert len(b) == 4 and sorted(map(tuple, b.prompts)) == sorted(map(tuple, prompts))
    assert check_versions(b, ref, 0.9, greedy=True) == 4  # every row spans the step
    assert all(b.versions[i, :4].tolist() == [0] * 4 for i in range(4))
    assert torch.equal(b.behaviour_logprobs, b.logprobs)


def test_a_group_past_max_staleness_is_dropped_or_finished_stale(engine):
    """max_staleness=0: held rows cut at their budget are past it after one step: ``drop`` never
    serves them, ``finish`` serves them whole with their rows cut as ``stale``."""
    eng, model, _ = engine
    kw = {**KW, "do_sample": False, "eos_token_id": EOS[-1:], "max_staleness": 0}
    prompts = id_prompts([5, 3], seed=6)
    for stale, prompt in (("drop", prompts[0]), ("finish", prompts[1])):
        assert len(eng.rollout([prompt], groups=1, tokens_per_call=3, stale=stale, **kw)) == 0
        with eng.paused():
            shrink_weights(model)
        b = eng.rollout([], groups=0 if stale == "drop" else 1, stale=stale, **kw)
        assert held_groups(eng) == 0
        if stale == "drop":
            assert len(b) == 0
            continue
        assert b.prompts == [prompt] and b.finish_reasons == ["stale", "stale"], b.finish_reasons
        assert b.versions.tolist() == [[eng.version - 1] * 3] * 2  # cut where the step found them


def test_rollout_iter_serves_held_groups_first(engine):
    eng, _, _ = engine
    prompts = id_prompts([4, 6, 5], seed=8)
    first = list(eng.rollout_iter(prompts, groups=1, **KW))
    assert len(first) == 1 and first[0][0] is not None
    assert held_groups(eng) == 2
    nxt = list(eng.rollout_iter(id_prompts([3], seed=9), groups=3, **KW))
    assert [i for i, _ in nxt].count(None) == 2 and held_groups(eng) == 0


@pytest.mark.parametrize(
    "kw, said",
    [
        (dict(groups=3), "groups=3, but this rank holds 0 groups and was given 2 prompts"),
        (dict(groups=-1), "groups must be an integer >= 0"),
        (dict(groups=1, tokens_per_call=0), "tokens_per_call must be an integer >= 1"),
        (dict(groups=1, stale="keep"), "stale must be one of"),
        (dict(max_staleness=2), "max_staleness=2 go with groups=K"),
        (dict(groups=1, max_turns=2), "max_turns goes with env= (a multi-turn rollout)"),
        (dict(groups=1, env=lambda r, c: None, inputs=[None, None]), "rollout) does not take inputs="),
    ],
)
def test_partial_arguments_are_checked(engine, kw, said):
    eng, _, _ = engine
    with pytest.raises(ValueError, match=said.replace("(", r"\(").replace(")", r"\)")):
        eng.rollout(id_prompts([4, 5], seed=1), n=2, **kw)
    assert held_groups(eng) == 0


# ----------------------------------------------------------------- generate(tokens_per_call=B)
GEN = dict(max_new_tokens=12, eos_token_id=[2], do_sample=True, temperature=0.9)


def _row(c):
    from numerics import Row

    return Row(list(c.prompt_token_ids), list(c.token_ids), list(c.logprobs), c.seed, c.finish_reason)


def test_generate_cuts_rows_at_their_budget_and_resume_goes_on(engine):
    """tokens_per_call=4: each call gives every row at most 4 more tokens; a cut row comes back
    "held" with its tokens so far, and ``resume`` of it goes on from there with its own draws:
    the rows equal plain ``generate``'s with the same seeds (near-ties aside)."""
    eng, model, _ = engine
    prompts = id_prompts([4, 6, 5], seed=12)
    seeds = [31, 32, 33]
    plain = eng.generate(prompts, seed=seeds, logprobs=True, **GEN)
    done = eng.generate(prompts, seed=seeds, logprobs=True, tokens_per_call=4, **GEN)
    final, calls = {}, 1
    while True:
        for c in done:
            assert c.finish_reason != "held" or len(c.token_ids) == 4 * calls, (calls, c.token_ids)
            if c.finish_reason != "held":
                final.setdefault(tuple(c.prompt_token_ids), c)
        held = [c for c in done if c.finish_reason == "held"]
        if not held:
            break
        assert all(c.handle is not None for c in held)
        calls += 1
        assert calls <= 3, f"rows still held after {calls} calls of 4 tokens (max_new_tokens 12)"
        done = eng.resume(held)
    assert sum(1 for c in plain if len(c.token_ids) > 4) > 0, "no row was cut: the test proves nothing"
    got = [final[tuple(p)] for p in prompts]
    params = SamplingParams(do_sample=True, temperature=0.9)
    assert_rows_agree([_row(c) for c in got], [_row(c) for c in plain], model=model, params=params)


def test_a_quota_call_begun_during_a_burst_cuts_its_rows_in_that_call(engine):
    """Local forwards run in bursts, each planned with the requests submitted since the tick: a
    ``tokens_per_call`` call that begins while the driver is inside a burst (a long row decoding)
    has its rows taken in that burst, cut at 4 tokens and held, not parked under the call before
    it and sent back, past their budget, at the next tick."""
    import threading

    from shardgen.generation.plan import Work

    eng, _, _ = engine
    work, sh = eng._driver.work, eng._shared
    busy = eng.submit(id_prompts([5], seed=13)[0], max_new_tokens=40, eos_token_id=[], do_sample=False)
    in_step, submitted = threading.Event(), threading.Event()
    step, enqueue = work.step, sh.enqueue

    def held_step(plan):  # driver thread: a forward of the burst, after the tick read the quota calls
        if plan.kind is Work.DECODE and not in_step.is_set():
            in_step.set()
            submitted.wait(10)  # the quota call begins and submits while this forward runs
        return step(plan)

    def noting_enqueue(reqs):
        ok = enqueue(reqs)
        submitted.set()
        return ok

    work.step, sh.enqueue = held_step, noting_enqueue
    try:
        assert in_step.wait(10), "the long row never decoded"
        done = eng.generate(id_prompts([4, 6], seed=14), seed=[1, 2], tokens_per_call=4, **GEN)
    finally:
        del work.step, sh.enqueue
    assert len(busy.result(timeout=60).token_ids) == 40
    assert [c.finish_reason for c in done] == ["held", "held"], [c.finish_reason for c in done]
    assert [len(c.token_ids) for c in done] == [4, 4], [c.token_ids for c in done]
    while held := [c for c in done if c.finish_reason == "held"]:
        done = eng.resume(held)


def test_a_held_generate_row_resumes_under_the_new_weights(engine):
    """Greedy rows cut at 4 tokens, the weights shrunk inside ``paused()`` (which does not wait
    for them), then resumed: their first 4 tokens keep version 0 and its logprobs, the rest are
    version 1's, each the argmax of the new weights given the prefix."""
    from shardgen.generation.rollout import pack

    eng, model, ref = engine
    kw = {**GEN, "do_sample": False, "eos_token_id": EOS[-1:], "logprobs": True}
    held = eng.generate(id_prompts([5, 3], seed=14), tokens_per_call=4, **kw)
    assert [c.finish_reason for c in held] == ["held", "held"]
    with eng.paused():
        shrink_weights(model)
    done = eng.resume(held)
    while any(c.finish_reason == "held" for c in done):
        done = eng.resume(done)
    b = pack(done, pad_id=0, n=1, seeds=[None, None])
    assert check_versions(b, ref, 0.9, greedy=True) == 2  # both rows span the step
    assert all(c.versions[:4] == [0] * 4 and set(c.versions[4:]) == {1} for c in done)
    assert [c.token_ids[:4] for c in done] == [c.token_ids for c in held]


def test_generate_budget_arguments_are_checked(engine):
    import dataclasses

    from shardgen.generation.per_call import Handle

    eng, _, _ = engine
    prompts = id_prompts([4], seed=3)
    with pytest.raises(ValueError, match="tokens_per_call must be an integer >= 1, got 0"):
        eng.generate(prompts, tokens_per_call=0, **GEN)
    with pytest.raises(ValueError, match=r"\(rows cut at a budget per call\) does not take inputs="):
        eng.generate(prompts, tokens_per_call=2, inputs=[None], **GEN)
    finished = eng.generate(prompts, **GEN)
    with pytest.raises(ValueError, match="completion 0 is not a held row"):
        eng.resume(finished)
    # no EOS: a sampled row may otherwise end within its budget of 2 and not be held
    held = eng.generate(prompts, tokens_per_call=2, **{**GEN, "eos_token_id": []})
    assert held[0].finish_reason == "held", held[0]
    other = dataclasses.replace(held[0], handle=Handle(object(), held[0].handle.request))
    with pytest.raises(ValueError, match="completion 0 is held by another engine"):
        eng.resume([other])


# ----------------------------------------------------------------- held rows at close(); the drain idiom
@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["close", "with"])
def test_close_ends_held_rows_where_they_stand(how):
    """Rows cut at their budget (generate and rollout) and held groups still decoding when the
    engine closes: close() returns at once, every future resolves as "held" with the tokens so
    far (not the 240 each may draw), resume() then raises by name."""
    torch.set_num_threads(1)
    eng = shardgen.Engine(tiny_model("llama", seed=11), backend="local", max_batch_size=8)
    long = dict(max_new_tokens=240, eos_token_id=[], temperature=0.9)
    with eng if how == "with" else contextlib.nullcontext():
        done = eng.generate(id_prompts([4, 6], seed=2), tokens_per_call=3, seed=1, **long)
        assert [c.finish_reason for c in done] == ["held", "held"]
        served = eng.rollout(id_prompts([4, 6, 5], seed=3), n=2, groups=0, seed=2, **long)
        assert len(served) == 0 and held_groups(eng) == 3  # three groups go on decoding
        held = [g for g in eng._held.groups()]
    if how == "close":
        eng.close()
    rows = [c.handle.request.future for c in done] + [g.call.futures[r] for g in held for r in g.rows]
    ends = [f.result(timeout=10) for f in rows]  # none left unresolved
    assert [c.finish_reason for c in ends] == ["held"] * 8
    assert all(len(c.token_ids) < 240 for c in ends), [len(c.token_ids) for c in ends]
    assert all(3 <= len(c.token_ids) <= 6 for c in ends[:2])  # 3, and at most 3 more (the rollout call)
    with pytest.raises(shardgen.EngineClosedError, match="engine is closed"):
        eng.resume(done)


def test_held_groups_leaves_out_groups_about_to_be_dropped(engine):
    """Groups past their call's max_staleness with stale="drop" are not counted: draining with
    groups=held_groups(engine) serves the others and raises nothing."""
    eng, model, _ = engine
    kw = {**KW, "do_sample": False, "eos_token_id": EOS[-1:], "tokens_per_call": 3}
    old = eng.rollout(id_prompts([5, 3], seed=6), groups=0, max_staleness=0, **kw)  # both held, cut at 3
    young = eng.rollout(id_prompts([4], seed=7), groups=0, max_staleness=3, **kw)
    assert len(old) == len(young) == 0 and held_groups(eng) == 3
    with eng.paused():
        shrink_weights(model)
    assert held_groups(eng) == 1 and len(eng._held) == 3  # the two old ones are past max_staleness=0
    drained = []
    while held_groups(eng):
        drained.append(eng.rollout([], groups=held_groups(eng), max_staleness=3, **kw))
        assert len(drained) < 6
    assert [b.prompts for b in drained if len(b)] == [id_prompts([4], seed=7)]
    assert len(eng._held) == 0
