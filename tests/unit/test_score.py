"""Tier 1 (no processes): ``engine.score()`` (teacher forcing) on the local backend.

Against single-process HF ``model(input_ids).logits``: bit for bit for one row alone (the same
shapes), within 2e-5 otherwise (padding, chunks, shared prompts); the plan's chunks and the
logits a forward holds; the checks of the arguments. The sharded backends, every gather mode,
uneven rows per rank and two engines at once: tests/multirank/test_score_multirank.py.
"""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch
from models import VOCAB, tiny_model
from score_scenarios import HINT, reference, rows_for, worst
from transformers import AutoModelForCausalLM, AutoTokenizer

import shardgen
from shardgen import toy
from shardgen.generation.plan import ScorePlan

TOL = 2e-5


def _pair(arch="llama", seed=7):
    model, ref = tiny_model(arch, seed=seed), tiny_model(arch, seed=seed)
    ref.load_state_dict(model.state_dict())
    return model, ref


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)
    model, ref = _pair()
    eng = shardgen.Engine(model, backend="local", max_batch_size=4)
    eng.ref = ref
    yield eng
    eng.close()


def test_one_row_equals_hf_bit_for_bit(engine):
    p, r = [[5, 6, 7, 8, 9]], [[10, 11, 12, 13, 14, 15]]
    sb = engine.score(p, r, top_k=3, logits=True)
    want = reference(engine.ref, p, r, top_k=3)[0]
    assert isinstance(sb, shardgen.ScoreBatch)
    assert torch.equal(sb.logprobs[0], want["logprobs"])
    assert torch.equal(sb.logits[0], want["logits"]) and sb.logits.dtype == torch.float32
    assert torch.equal(sb.top_logprobs[0], want["top_logprobs"])
    assert torch.equal(sb.top_ids[0], want["all"].topk(3, -1).indices)
    assert (sb.entropy[0] - want["entropy"]).abs().max() < 1e-6


@pytest.mark.parametrize("max_prefill_tokens", [None, 1, 7])
@pytest.mark.parametrize("share", [True, False])
def test_padded_chunked_and_shared_rows_match_hf(max_prefill_tokens, share):
    model, ref = _pair()
    p, r = rows_for(0, 7, 1)  # pairs of rows with one prompt; 4 rows a run: groups split
    with shardgen.Engine(
        model, backend="local", max_batch_size=4, max_prefill_tokens=max_prefill_tokens, share_prefill=share
    ) as eng:
        sb = eng.score(p, r, temperature=0.8, top_k=5)
        stats = eng.stats()
    assert worst(sb, reference(ref, p, r, 0.8, 5), top_k=5) < TOL
    assert sb.logprobs.shape == (7, max(len(x) for x in r))
    # tokens computed, left padding excluded: runs of rows 0-3 and 4-6, each response padded to
    # its run's longest; with sharing, rows 1, 3 and 5 take their prompt from the row before
    real = sum(len(p[i]) + max(len(r[j]) for j in run) for run in (range(4), range(4, 7)) for i in run)
    if share:
        real -= sum(len(p[i]) for i in (1, 3, 5))
    assert stats["prefill_tokens"] == real, (stats["prefill_tokens"], real)
    if max_prefill_tokens == 1:  # one column a forward
        assert stats["prefill_forwards"] >= max(len(a) + len(b) for a, b in zip(p, r, strict=True))


def test_a_runs_rows_are_whole_groups_of_one_prompt():
    """Groups of 3 rows per prompt, runs of 4 rows: each run takes a whole group, so each prompt is
    computed once (a run of 4 would cut the second group in two and compute its prompt twice)."""
    model, ref = _pair()
    p = [[4, 5, 6, 7, 8]] * 3 + [[9, 10, 11, 12, 13]] * 3
    r = [[20 + i, 30, 31, 32] for i in range(6)]
    with shardgen.Engine(model, backend="local", max_batch_size=4) as eng:
        sb = eng.score(p, r)
        tokens = eng.stats()["prefill_tokens"]
    assert worst(sb, reference(ref, p, r)) < TOL
    assert tokens == 2 * (5 + 3 * 4), tokens


@pytest.mark.parametrize("arch", ["gpt2", "opt", "gemma", "mistral", "qwen2", "mixtral"])
def test_architectures_match_hf(arch):
    """Absolute positions (GPT-2, OPT), a tied and scaled embedding (Gemma), a sliding window
    shorter than the rows (Mistral): chunked, shared prompts."""
    model, ref = _pair(arch)
    p, r = rows_for(1, 5, 2)
    r[0] = r[0] + list(range(20, 30))  # longer than Mistral's window of 8
    with shardgen.Engine(model, backend="local", max_prefill_tokens=6) as eng:
        sb = eng.score(p, r)
    assert worst(sb, reference(ref, p, r)) < TOL


def test_plan_chunks_cover_every_column_once_and_keep_the_budget():
    prompts = [[1] * 5, [1] * 5, [2] * 3, [1] * 5]
    responses = [[3] * 4, [3] * 7, [3] * 1, []]
    for share in (True, False):
        for budget in (None, 1, 4, 9, 100):
            plan = ScorePlan.of(prompts, responses, share, budget)
            assert (plan.distinct is not None) == share
            kept = []
            for i, ch in enumerate(plan.chunks):
                tokens, head = plan.shape(i)
                assert 1 <= ch.keep <= ch.c1 - ch.c0 and head <= tokens
                if budget is not None and budget >= len(prompts):
                    assert tokens <= budget, (share, budget, i, tokens)
                first = max(ch.c1 - ch.keep, 4)  # P - 1 = 4
                if ch.every or i == len(plan.chunks) - 1 or plan.chunks[i + 1].every:
                    kept += range(first, min(ch.c1, 4 + 7))
            assert kept == list(range(4, 11)), (share, budget, kept)  # each response position once


def test_a_forward_holds_one_chunks_logits_at_most(engine, monkeypatch):
    """Without logits=True the head runs on the chunk's response columns only: the logits of a
    forward are never more rows than its tokens, under ``max_prefill_tokens``."""
    model, _ = _pair()
    seen = []
    with shardgen.Engine(model, backend="local", max_prefill_tokens=8, max_batch_size=4) as eng:
        real = eng.backend.forward

        def spy(plan, inputs):
            out = real(plan, inputs)
            seen.append((inputs["input_ids"].numel(), out.logits.shape[0] * out.logits.shape[1]))
            return out

        monkeypatch.setattr(eng.backend, "forward", spy)
        p, r = [[4, 5, 6]] * 4, [list(range(10, 40))] * 4  # 4 rows of 33 tokens, one prompt
        sb = eng.score(p, r)
        tokens = eng.stats()["prefill_tokens"]
    assert tokens == 3 + 4 * 30  # the prompt once, then every row's response columns
    assert sb.logits is None and len(seen) > 8
    assert all(rows <= 8 and tokens <= 8 for tokens, rows in seen), seen


def test_rollout_batch_and_teacher_prompts(engine):
    b = engine.rollout(
        [[5, 6, 7], [8, 9, 10, 11]], n=3, seed=1, max_new_tokens=8, eos_token_id=list(range(2, 8))
    )
    own = engine.score(b)
    assert (own.logprobs - b.logprobs).abs().max() < TOL and torch.equal(own.mask, b.response_mask)
    teacher = [HINT + p for p in ([5, 6, 7], [8, 9, 10, 11]) for _ in range(3)]
    responses = [b.response_ids[i, : int(g)].tolist() for i, g in enumerate(b.response_lengths)]
    sb = engine.score(b, prompts=teacher)
    assert worst(sb, reference(engine.ref, teacher, responses)) < TOL
    tensor = engine.score([[5, 6, 7], [8, 9, 10, 11]] * 3, b.response_ids[[0, 3, 1, 4, 2, 5]],
                          response_mask=b.response_mask[[0, 3, 1, 4, 2, 5]])  # fmt: skip
    assert (tensor.logprobs - own.logprobs[[0, 3, 1, 4, 2, 5]]).abs().max() < TOL  # other runs: other shapes


def test_zero_rows_return_at_once_without_a_forward(engine):
    before = engine.stats()["forwards"]
    t0 = time.monotonic()
    sb = engine.score([], [], top_k=2, logits=True)
    assert time.monotonic() - t0 < 0.5 and len(sb) == 0
    assert sb.top_ids.shape == (0, 0, 2) and sb.logits.shape == (0, 0, VOCAB)
    empty = engine.score([[4, 5]], [[]])
    assert empty.logprobs.shape == (1, 0) and engine.stats()["forwards"] == before


def test_from_threads_beside_generate(engine):
    p, r = rows_for(2, 6, 3)
    out = {}
    threads = [
        threading.Thread(target=lambda k=k: out.update({k: engine.score(p[k::2], r[k::2])})) for k in (0, 1)
    ]
    for t in threads:
        t.start()
    gen = engine.generate([[4, 5, 6]], max_new_tokens=10, eos_token_id=[])
    for t in threads:
        t.join(60)
    assert len(gen[0].token_ids) == 10
    for k in (0, 1):
        assert worst(out[k], reference(engine.ref, p[k::2], r[k::2])) < TOL


def test_text_prompts_with_the_tokenizer():
    tok = AutoTokenizer.from_pretrained(toy.toy_model_path())
    model = AutoModelForCausalLM.from_pretrained(toy.toy_model_path()).eval()
    with shardgen.Engine(model, tok, backend="local") as eng:
        done = eng.generate(["count from 3 to 7 :"], max_new_tokens=24)[0]
        sb = eng.score(["count from 3 to 7 :"], [done.token_ids])
    assert sb.logprobs[0].max() <= 0 and sb.logprobs[0].mean() > -0.5  # the toy model knows its task


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(prompts=[[4]], responses=[[5], [6]]), "1 prompts for 2 responses"),
        (dict(prompts=[[4]], responses=[[5]], temperature=0), "temperature must be > 0, got 0"),
        (dict(prompts=[[4]], responses=[[5]], top_k=-1), "top_k must be an integer >= 0, got -1"),
        (dict(prompts=[[4]], responses=[[5]], top_k=VOCAB + 1), f"top_k={VOCAB + 1}"),
        (
            dict(prompts=[[4]], responses=[[5, VOCAB]]),
            f"response id {VOCAB} is outside the vocabulary [0, {VOCAB})",
        ),
        (dict(prompts=[[-1]], responses=[[5]]), "prompt id -1"),
        (dict(prompts=[[]], responses=[[5]]), "row 0: the prompt is empty"),
        (dict(prompts=["text"], responses=[[5]]), "prompt 0: text prompts need a tokenizer"),
        (dict(prompts=[[4]], responses=[5]), "a list of rows"),
        (
            dict(prompts=[[4] * 200], responses=[[5] * 57]),
            "200 prompt + 57 response tokens exceed the context length 256",
        ),
    ],
)
def test_mistakes_raise_value_errors_with_the_numbers(engine, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        engine.score(**kwargs)


def test_stats_count_a_forward_before_its_rows_are_resolved(engine, monkeypatch):
    """A score run's last forward resolves its rows' futures: ``stats()`` read right after the
    call must count it (the suite once read one forward short under load)."""
    work = engine._driver.work
    at_resolve, forwards = [], []
    real_scored, real_forward = work.on_scored, engine.backend.forward

    def scored(req, row):
        at_resolve.append((work.stats.forwards, len(forwards)))
        real_scored(req, row)

    def forward(plan, inputs):
        forwards.append(1)
        return real_forward(plan, inputs)

    monkeypatch.setattr(work, "on_scored", scored)
    monkeypatch.setattr(engine.backend, "forward", forward)
    base = work.stats.forwards
    engine.score([[4, 5, 6]], [[7, 8]])
    assert at_resolve and all(n - base == k for n, k in at_resolve), at_resolve
