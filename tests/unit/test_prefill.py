"""Tier 1 (no processes): shared prefill of the n samples of a prompt, ``rollout_iter`` streaming,
and chunked prefill under ``max_prefill_tokens``, on the local backend.

The same on/off comparison on sharded backends runs in tests/multirank/test_rollout_multirank.py.
"""

from __future__ import annotations

import time

import pytest
import torch
from models import batch, hf_generate, tiny_model
from numerics import Row, assert_rows_agree, ids_rows
from rollout_scenarios import check_layout, id_prompts, rows
from transformers import AutoModelForCausalLM, AutoTokenizer

import shardgen
from shardgen import toy
from shardgen.config import SamplingParams
from shardgen.generation.batch import Batch
from shardgen.generation.plan import PrefillPlan
from shardgen.generation.sampling import make_generator
from shardgen.generation.sequence import SeqState
from shardgen.rollout import concat

EOS = list(range(2, 10))  # many EOS ids: a random tiny model stops at different steps
KW = dict(seed=3, max_new_tokens=10, eos_token_id=EOS, temperature=0.9)
PARAMS = SamplingParams(do_sample=True, temperature=0.9)  # KW's sampling, for the near-tie checks


def _rollouts(model, share: bool, cases, **engine_kw) -> tuple[list, dict]:
    with shardgen.Engine(model, backend="local", share_prefill=share, **engine_kw) as eng:
        out = [rows(eng.rollout(prompts, n=n, **KW)) for prompts, n in cases]
    return out, eng.stats()


CASES = [(id_prompts(lengths, seed=len(lengths)), n) for lengths in ([5, 9, 3], [7]) for n in (1, 3, 8)]


@pytest.mark.parametrize(
    "arch, batch_size",
    [("llama", 16), ("qwen2", 16), ("gpt2", 16), ("opt", 16), ("mistral", 16), ("llama", 5), ("gpt2", 5)],
)
def test_sharing_on_and_off_keep_the_numeric_promise(arch, batch_size):
    """n = 1, 3, 8; three prompts and a single one (one distinct prompt per prefill); batch 5:
    groups of 8 split in parts, groups of 3 waiting for free rows, refills of shared prompts
    (mistral: sliding-window cache layers, forked too). A prompt prefilled once has other rows
    than n copies of it, so the rows agree as tests/helpers/numerics.py promises, not bit for bit."""
    model = tiny_model(arch, seed=7)
    on, st_on = _rollouts(model, True, CASES, max_batch_size=batch_size)
    off, st_off = _rollouts(model, False, CASES, max_batch_size=batch_size)
    for k, (a, b) in enumerate(zip(on, off, strict=True)):
        assert_rows_agree(a, b, model=model, params=PARAMS, what=f"rollout {k}")
    prompt_tokens = sum(len(p) * n for prompts, n in CASES for p in prompts)
    assert st_off["prefill_tokens"] == prompt_tokens
    if batch_size == 16:  # every group fits in a batch: each prompt computed once per rollout
        assert st_on["prefill_tokens"] == sum(len(p) for prompts, _ in CASES for p in prompts)
    assert st_on["prefill_tokens"] < st_off["prefill_tokens"]
    assert st_on["forwards"] == st_off["forwards"]  # the same batches: only the prefill rows differ
    if batch_size == 5:
        assert st_on["refills"] > 0


def test_sharing_on_a_moe_model_keeps_the_numeric_promise():
    """Mixtral: the experts see n times fewer rows when the prompt is computed once."""
    model = tiny_model("mixtral", seed=7)
    on, _ = _rollouts(model, True, CASES, max_batch_size=5)
    off, _ = _rollouts(model, False, CASES, max_batch_size=5)
    for k, (a, b) in enumerate(zip(on, off, strict=True)):
        assert_rows_agree(a, b, model=model, params=PARAMS, what=f"rollout {k}")


def test_groups_join_a_batch_together():
    """Groups of 4 in batches of 6: a group never splits over two prefills (each prompt is
    computed once), it waits for 4 free rows instead."""
    prompts = id_prompts([5, 9, 3, 6, 4], seed=1)
    with shardgen.Engine(tiny_model("llama", seed=7), backend="local", max_batch_size=6) as eng:
        b = eng.rollout(prompts, n=4, **KW)
    check_layout(b, pad_id=0)
    st = eng.stats()
    assert st["prefill_tokens"] == sum(len(p) for p in prompts), st
    assert st["prefills"] == len(prompts), st


def test_generate_shares_repeated_prompts():
    """generate() with one prompt several times (different seeds) prefills it once; greedy
    duplicates in generate_ids still match HF generate() row for row."""
    model = tiny_model("llama", seed=7)
    p = id_prompts([9], seed=2)[0]
    with shardgen.Engine(model, backend="local") as eng:
        out = eng.generate([p, p, p, [5, 6]], seed=[1, 2, 3, 4], do_sample=True, max_new_tokens=6)
        assert eng.stats()["prefill_tokens"] == len(p) + 2
        alone = [eng.generate([p], seed=s, do_sample=True, max_new_tokens=6)[0] for s in (1, 2, 3)]
        ids, mask = batch([5, 9, 3], seed=2)
        dup = torch.tensor([0, 1, 1, 2, 1, 0])
        got = eng.generate_ids(ids[dup], attention_mask=mask[dup], max_new_tokens=8)
    sampled = SamplingParams(do_sample=True)
    mine = [Row(p, c.token_ids, c.logprobs, s) for c, s in zip(out[:3], (1, 2, 3), strict=True)]
    theirs = [Row(p, c.token_ids, c.logprobs, s) for c, s in zip(alone, (1, 2, 3), strict=True)]
    assert_rows_agree(mine, theirs, model=model, params=sampled, what="alone vs shared")
    assert len({tuple(c.token_ids) for c in out[:3]}) > 1
    expected = hf_generate(model, ids[dup], mask[dup], max_new_tokens=8)
    assert_rows_agree(ids_rows(got, mask[dup], 9, [2]), ids_rows(expected, mask[dup], 9, [2]), model=model)


def _seqs(prompt: list[int], k: int) -> list[SeqState]:
    params = SamplingParams(do_sample=True, max_new_tokens=8, temperature=1.0).resolved()
    return [
        SeqState(
            prompt_ids=list(prompt), params=params, eos_ids=frozenset(), pad_id=0, generator=make_generator(s)
        )
        for s in range(k)
    ]


def test_forked_cache_is_never_aliased():
    """Every row owns its copy of the prompt's cache: writing one sample's keys and values (as
    a refill writes a finished slot) changes no sibling, and the siblings decode apart."""
    model = tiny_model("llama", seed=7)
    with torch.no_grad():
        seqs = _seqs([5, 6, 7, 8, 9], 3)
        b = Batch(model, seqs, torch.device("cpu"), PrefillPlan.of([s.prompt_ids for s in seqs], True, None))
        assert b.fork is not None and b.fork.tolist() == [0, 0, 0]
        b.prefill(model.forward)
        for layer in b.cache.layers:
            for t in (layer.keys, layer.values):
                assert torch.equal(t[0], t[1]) and torch.equal(t[1], t[2])
                before = t[1:].clone()
                t[0].add_(1.0)  # one sample's rows change
                assert torch.equal(t[1:], before), "a sibling's cache changed with row 0's"
                t[0].sub_(1.0)
                assert t.stride(0) > 0 and t.is_contiguous()
        for _ in range(5):
            b.step(model.forward)
    assert len({tuple(s.tokens) for s in b.seqs}) > 1


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2", "opt", "mixtral", "mistral"])
def test_chunked_prefill_agrees_with_one_shot(arch):
    """Greedy, padded, duplicated rows, against HF generate() (one-shot prefill); budgets down
    to one column per forward; every prefill forward within the budget (rows allowing). Chunks
    are other shapes than one shot: the tokens agree but at near-ties (tests/helpers/numerics.py)."""
    model = tiny_model(arch, seed=1)
    ids, mask = batch([5, 30, 3, 17], seed=2)
    dup = torch.tensor([0, 1, 1, 2, 3, 3, 3])
    ids, mask = ids[dup], mask[dup]
    expected = hf_generate(model, ids, mask, max_new_tokens=10, pad_token_id=0)
    widths: list[int] = []
    hook = model.register_forward_pre_hook(
        lambda _m, _a, kw: widths.append(kw["input_ids"].numel()), with_kwargs=True
    )
    try:
        for budget in (None, 24, 5, 1):
            widths.clear()
            with shardgen.Engine(model, backend="local", max_prefill_tokens=budget) as eng:
                got = eng.generate_ids(ids, attention_mask=mask, max_new_tokens=10, pad_token_id=0)
            st = eng.stats()
            width = ids.shape[1]
            assert_rows_agree(
                ids_rows(got, mask, width, [2]), ids_rows(expected, mask, width, [2]), model=model,
                what=f"{arch}, budget {budget}",
            )  # fmt: skip
            prefill = widths[: st["prefill_forwards"]]
            assert sum(prefill) == 4 * ids.shape[1]  # 4 distinct prompts, every column once
            if budget is not None:  # columns per forward: the budget shared by the 4 rows, >= 1
                assert st["prefill_forwards"] == -(-ids.shape[1] // max(1, budget // 4))
                assert max(prefill) <= max(budget, 4)
            else:
                assert st["prefill_forwards"] == 1
    finally:
        hook.remove()


def test_chunked_prefill_on_the_toy_model(toy_engine):
    """The trained toy model reads every prompt position (a random tiny model barely does, so a
    chunk at the wrong positions can pass above): every budget gives the exact answers, as HF."""
    tok, model = AutoTokenizer.from_pretrained(toy.toy_model_path()), toy_engine.model
    prompts = [
        "count from 3 to 9 :",
        "count down from 20 to 18 :",
        "count from 40 to 41 :",
        "count from 5 to 12 :",
    ]
    tok.padding_side = "left"
    enc = tok(prompts, return_tensors="pt", padding=True)
    expected = hf_generate(model, enc["input_ids"], enc["attention_mask"], max_new_tokens=12)
    for budget in (9, 4, 1):
        with shardgen.Engine(model, tok, backend="local", max_prefill_tokens=budget) as eng:
            got = eng.generate_ids(enc["input_ids"], attention_mask=enc["attention_mask"], max_new_tokens=12)
            texts = [c.text for c in eng.generate(prompts, max_new_tokens=12)]
        width, eos = enc["input_ids"].shape[1], [tok.eos_token_id]
        rows_got, rows_expected = (
            ids_rows(got, enc["attention_mask"], width, eos),
            ids_rows(expected, enc["attention_mask"], width, eos),
        )
        assert_rows_agree(rows_got, rows_expected, model=model, what=f"budget {budget}")
        assert texts == [toy.expected_answer(p) for p in prompts]
        assert eng.stats()["prefill_forwards"] > 2 * eng.stats()["prefills"]


def test_chunked_refills_match_hf_alone():
    """Chunked refills of a running batch (the live rows wait out the chunks): each request as
    HF generates it alone."""
    model = tiny_model("llama", seed=31)
    ids, mask = batch([3, 40, 5, 2, 33, 4, 6, 8], seed=32)
    prompts = [ids[i][mask[i].bool()] for i in range(ids.shape[0])]
    lens = [2, 12, 3, 4, 9, 2, 3, 7]
    with shardgen.Engine(model, backend="local", max_batch_size=3, max_prefill_tokens=8) as eng:
        futs = [eng.submit(p, max_new_tokens=n, eos_token_id=[]) for p, n in zip(prompts, lens, strict=True)]
        got = [f.result(timeout=60).token_ids for f in futs]
    st = eng.stats()
    assert st["refills"] > 0 and st["prefill_forwards"] > st["prefills"], st
    for i, (p, n, g) in enumerate(zip(prompts, lens, got, strict=True)):
        exp = hf_generate(model, p[None], torch.ones_like(p[None]), max_new_tokens=n, eos_token_id=-1)
        mine, hf = Row(p.tolist(), g, None, None), Row(p.tolist(), exp[0, p.numel() :].tolist(), None, None)
        assert_rows_agree([mine], [hf], model=model, what=f"request {i}")


@pytest.fixture(scope="module")
def toy_engine():
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(toy.toy_model_path())
    model = AutoModelForCausalLM.from_pretrained(toy.toy_model_path()).eval()
    eng = shardgen.Engine(model, tok, backend="local")
    yield eng
    eng.close()


def test_rollout_iter_yields_short_groups_before_the_long_one_ends(toy_engine):
    """One prompt with a 25-number answer and three with 1-2 numbers: the short groups come
    first, while the long one still decodes; in prompt order they are rollout()'s batch."""
    prompts = [
        "count from 3 to 4 :",
        "count from 30 to 54 :",
        "count down from 9 to 8 :",
        "count from 7 to 7 :",
    ]
    kw = dict(n=3, temperature=0.3, max_new_tokens=30, seed=5)
    slow = toy_engine.model.register_forward_pre_hook(lambda *_: time.sleep(0.01))  # every step >= 10 ms
    try:
        arrivals = []
        for i, group in toy_engine.rollout_iter(prompts, **kw):
            arrivals.append((i, toy_engine.stats()["decode_steps"], group))
        final_steps = toy_engine.stats()["decode_steps"]
    finally:
        slow.remove()
    order = [i for i, _, _ in arrivals]
    assert sorted(order) == [0, 1, 2, 3] and order[-1] == 1, order
    first_i, first_steps, _ = arrivals[0]
    assert first_i != 1 and first_steps < final_steps - 15, (first_steps, final_steps)
    for i, _, group in arrivals:
        check_layout(group, pad_id=0)
        assert len(group) == 3 and group.n == 3 and all(r == "eos" for r in group.finish_reasons)
        assert group.texts is not None and all(t == toy.expected_answer(prompts[i]) for t in group.texts)
    groups = {i: g for i, _, g in arrivals}
    whole = toy_engine.rollout(prompts, **kw)
    joined = concat([groups[i] for i in range(len(prompts))])
    assert rows(joined) == rows(whole)
    assert torch.equal(joined.prompt_lengths, whole.prompt_lengths) and joined.texts == whole.texts


def test_leaving_rollout_iter_early_does_not_cancel_the_rest(toy_engine):
    """USAGE: leaving the loop early does not cancel the rest: the engine still decodes them
    (their results are dropped). After a break on the first group, every other row still
    finishes (the engine's finished-token count reaches the whole rollout's), and the engine
    answers later calls as before."""
    prompts = ["count from 3 to 4 :", "count from 30 to 54 :", "count from 7 to 7 :"]
    kw = dict(n=2, temperature=0.3, max_new_tokens=30, seed=9)
    before = toy_engine.stats()["generated_tokens"]
    whole = toy_engine.rollout(prompts, **kw)
    total = toy_engine.stats()["generated_tokens"] - before
    assert total == int(whole.response_lengths.sum()) > 0
    start = toy_engine.stats()["generated_tokens"]
    stream = toy_engine.rollout_iter(prompts, **kw)
    i, group = next(stream)
    stream.close()  # what leaving the loop does once the generator goes: the long group still decodes
    assert (
        i != 1
        and group.texts == whole.texts[2 * i : 2 * i + 2]
        and group.seeds == whole.seeds[2 * i : 2 * i + 2]
    )
    deadline = time.monotonic() + 60
    while toy_engine.stats()["generated_tokens"] - start < total and time.monotonic() < deadline:
        time.sleep(0.01)
    assert toy_engine.stats()["generated_tokens"] - start == total  # every row ran to its end
    assert rows(toy_engine.rollout(prompts, **kw)) == rows(whole)  # and the engine serves on


def test_rollout_iter_checks_at_the_call_and_streams_nothing_for_no_prompts(toy_engine):
    with pytest.raises(ValueError, match="n must be"):
        toy_engine.rollout_iter(["count from 3 to 4 :"], n=0)  # raised by the call, not by next()
    assert list(toy_engine.rollout_iter([], n=4)) == []
    assert len(concat([])) == 0
