"""Tier 1 (no processes): an unset ``max_batch_size`` is sized from the memory budget."""

from __future__ import annotations

import pytest
import torch
from numerics import Row, assert_rows_agree, ids_rows
from transformers import AutoModelForCausalLM, AutoTokenizer

import shardgen
from shardgen import toy
from shardgen.config import EngineConfig
from shardgen.loading.memory import MAX_SIZED_BATCH, batch_rows, kv_cache_bytes


@pytest.fixture(scope="module")
def toy_model():
    return AutoModelForCausalLM.from_pretrained(toy.toy_model_path()).eval()


def test_batch_rows_fit_the_budget_within_bounds():
    assert batch_rows(10 * 100 + 99, 100) == 10
    assert batch_rows(50, 100) == 1  # at least one row, however tight the budget
    assert batch_rows(-5, 100) == 1
    assert batch_rows(10**12, 100) == MAX_SIZED_BATCH
    assert batch_rows(10**12, 100, most=64) == 64


def test_unset_batch_size_is_sized_and_an_explicit_one_kept(toy_model):
    assert EngineConfig().max_batch_size is None
    EngineConfig().validate()
    row = kv_cache_bytes(toy_model.config, 1)
    with shardgen.Engine(toy_model, backend="local", memory_budget_gb=10.5 * row / 1e9) as eng:
        assert eng.config.max_batch_size == 10
    with shardgen.Engine(toy_model, backend="local", memory_budget_gb=1.0) as eng:
        assert eng.config.max_batch_size == MAX_SIZED_BATCH  # the toy's rows are 256 KB
    with shardgen.Engine(toy_model, backend="local", max_batch_size=5, memory_budget_gb=1e-9) as eng:
        assert eng.config.max_batch_size == 5


def test_a_default_engine_runs_a_rollout_of_64_rows_in_one_wave(toy_model):
    # 16 prompts x n = 4: DeepSpeed's rollout runs the 64 rows as one batch; at the old default
    # of 16 rows, shardgen prefilled them in several batches and decoded them in waves.
    prompts = [p["prompt"] for p in toy.make_prompts(16, seed=3, skew=True)]
    tok = AutoTokenizer.from_pretrained(toy.toy_model_path())
    with shardgen.Engine(toy_model, tok, backend="local", memory_budget_gb=1.0) as eng:
        b = eng.rollout(prompts, n=4, seed=0, max_new_tokens=26)
        st = eng.stats()
    assert len(b) == 64
    assert st["prefill_forwards"] == 1
    longest = int(b.response_mask.sum(1).max())
    assert st["forwards"] == longest  # one prefill, then one decode step per further token


def _toy_prompts() -> tuple:
    tok = AutoTokenizer.from_pretrained(toy.toy_model_path())
    return tok, [p["prompt"] for p in toy.make_prompts(8, seed=5, skew=True)]


def _rows_per_forward(model, tok, prompts: list[str], **options) -> tuple[list, list[int]]:
    """Generate on a local engine (a sized batch): the completions, and the rows of each forward."""
    rows: list[int] = []
    hook = model.register_forward_pre_hook(
        lambda _m, _a, kw: rows.append(int(kw["input_ids"].shape[0])), with_kwargs=True
    )
    try:
        with shardgen.Engine(model, tok, backend="local", memory_budget_gb=1.0, **options) as eng:
            got = eng.generate(prompts, max_new_tokens=26)
    finally:
        hook.remove()
    return got, rows


def test_finished_rows_leave_the_batch_and_the_rest_decode_unchanged(toy_model):
    # All rows in one batch, nothing waiting: a row that ended at EOS is no longer computed
    # (DeepSpeed's rollout computes every row for max_new_tokens). Tokens stay HF's.
    tok, prompts = _toy_prompts()
    got, rows = _rows_per_forward(toy_model, tok, prompts)
    lengths = sorted(len(c.token_ids) for c in got)
    assert lengths[0] < lengths[-1], lengths  # the skewed task: some rows end early
    decode = rows[1:]
    assert len(decode) == lengths[-1] - 1
    live = [sum(1 for n in lengths if n > step + 1) for step in range(len(decode))]
    assert all(r >= k for r, k in zip(decode, live, strict=True))  # every live row is computed
    assert sum(decode) < len(prompts) * len(decode)  # and finished ones are not
    enc = tok(prompts, return_tensors="pt", padding=True)
    ref = toy_model.generate(**enc, max_new_tokens=26, do_sample=False)[:, enc["input_ids"].shape[1] :]
    mask = enc["attention_mask"]  # rows leave the batch: other shapes than HF's (tests/helpers/numerics.py)
    mine = [
        Row(p.prompt, c.token_ids, None, None)
        for p, c in zip(ids_rows(enc["input_ids"], mask, mask.shape[1], []), got, strict=True)
    ]
    assert_rows_agree(
        mine, ids_rows(torch.cat([enc["input_ids"], ref], 1), mask, mask.shape[1], [2]), model=toy_model
    )


def test_waves_keep_their_finished_rows(toy_model):
    # refill=False: a batch is exactly the one HF would run, finished rows included.
    tok, prompts = _toy_prompts()
    got, rows = _rows_per_forward(toy_model, tok, prompts, refill=False)
    lengths = [len(c.token_ids) for c in got]
    assert min(lengths) < max(lengths), lengths
    assert rows and set(rows) == {len(prompts)}, rows
