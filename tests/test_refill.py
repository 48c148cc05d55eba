"""Tier 1: continuous refill merges new requests into a running batch without changing anyone's tokens."""

from __future__ import annotations

import pytest
import torch
from models import batch, hf_generate, tiny_model

import shardgen


def _alone(model, prompt, n, eos):
    ids = prompt[None]
    out = hf_generate(model, ids, torch.ones_like(ids), max_new_tokens=n, eos_token_id=eos, pad_token_id=0)
    toks = out[0, prompt.numel() :].tolist()
    return toks[: toks.index(eos) + 1] if eos in toks else toks


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2"])
def test_refilled_requests_match_single_request_hf(arch):
    model = tiny_model(arch, seed=31)
    ids, mask = batch([3, 9, 5, 2, 7, 4, 6, 8, 3, 5], seed=32)
    prompts = [ids[i][mask[i].bool()] for i in range(ids.shape[0])]
    # skewed lengths: short and long requests interleaved, so slots free up at different steps
    lens = [2, 30, 3, 4, 25, 2, 3, 20, 5, 2]
    with shardgen.Engine(model, backend="local", max_batch_size=4) as eng:
        futs = [eng.submit(p, max_new_tokens=n, eos_token_id=[]) for p, n in zip(prompts, lens, strict=True)]
        got = [f.result(timeout=60).token_ids for f in futs]
    st = eng.stats()
    assert st["refills"] > 0, st
    for p, n, g in zip(prompts, lens, got, strict=True):
        assert g == _alone(model, p, n, eos=-1)[:n] and len(g) == n


def test_refill_keeps_the_cache_compact():
    model = tiny_model("llama", seed=33)
    with shardgen.Engine(model, backend="local", max_batch_size=2) as eng:
        long = eng.submit([5, 6, 7], max_new_tokens=60, eos_token_id=[])
        shorts = [eng.submit([8 + i, 9], max_new_tokens=3, eos_token_id=[]) for i in range(15)]
        for f in shorts:
            f.result(timeout=60)
        batch = eng._driver.work.batch
        width = batch.input_ids.shape[1] if batch is not None else 0
        long.result(timeout=60)
    # the long row's history bounds the width: 3 prompt + at most 60 generated (+1 pending column)
    assert width <= 3 + 60 + 1


def test_waves_when_refill_is_off():
    model = tiny_model("llama", seed=34)
    with shardgen.Engine(model, backend="local", max_batch_size=2, refill=False) as eng:
        futs = [eng.submit([5 + i, 6], max_new_tokens=2 + 5 * (i % 2), eos_token_id=[]) for i in range(6)]
        [f.result(timeout=60) for f in futs]
    assert eng.stats()["refills"] == 0 and eng.stats()["prefills"] == 3
