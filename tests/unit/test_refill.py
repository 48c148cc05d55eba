"""Tier 1: continuous refill merges new requests into a running batch without changing anyone's tokens."""

from __future__ import annotations

import pytest
import torch
from models import batch, hf_generate, tiny_model
from numerics import Row, assert_rows_agree

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
    for i, (p, n, g) in enumerate(zip(prompts, lens, got, strict=True)):
        # A refilled batch has other shapes than one request alone: tests/helpers/numerics.py.
        assert len(g) == n
        alone = Row(p.tolist(), _alone(model, p, n, eos=-1)[:n], None, None)
        assert_rows_agree([Row(p.tolist(), g, None, None)], [alone], model=model, what=f"{arch}, request {i}")


def _record_kv_widths(model) -> list[tuple[int, int]]:
    """(input columns, KV cache length) of every forward the model runs, via a public forward hook."""
    seen: list[tuple[int, int]] = []

    def hook(_mod, _args, kwargs):
        cache = kwargs.get("past_key_values", kwargs.get("cache"))
        seen.append((kwargs["input_ids"].shape[1], 0 if cache is None else cache.get_seq_length()))

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def test_refill_keeps_the_cache_compact():
    """A long prompt that finishes at once leaves its slot to short requests: once refilled, its
    40 columns of history must leave the cache, which then spans only the longest live history."""
    model = tiny_model("llama", seed=33)
    seen = _record_kv_widths(model)
    long_prompt, live_prompt, live_new = list(range(3, 43)), [5, 6], 20
    with shardgen.Engine(model, backend="local", max_batch_size=2) as eng:
        with eng.paused():  # queue everything first: the long and the live request share the first wave
            first = eng.submit(long_prompt, max_new_tokens=1, eos_token_id=[])
            live = eng.submit(live_prompt, max_new_tokens=live_new, eos_token_id=[])
            shorts = [eng.submit([8 + i, 9], max_new_tokens=3, eos_token_id=[]) for i in range(10)]
        assert len(first.result(timeout=60).token_ids) == 1
        assert len(live.result(timeout=60).token_ids) == live_new
        assert all(len(f.result(timeout=60).token_ids) == 3 for f in shorts)
    assert eng.stats()["refills"] >= len(shorts) - 1, eng.stats()
    assert seen[0] == (len(long_prompt), 0), seen[0]  # the wave held the long prompt
    decode_widths = [cached + 1 for cols, cached in seen if cols == 1]
    # The widest history any row ever reaches: the live request's prompt and all its tokens
    # (its last token is fed while a refilled short row still decodes). Without compaction the
    # long prompt's columns would stay: every width >= 41.
    assert max(decode_widths) <= len(live_prompt) + live_new, decode_widths
    assert min(decode_widths) == len(live_prompt) + 1, decode_widths


def test_waves_when_refill_is_off():
    model = tiny_model("llama", seed=34)
    with shardgen.Engine(model, backend="local", max_batch_size=2, refill=False) as eng:
        with eng.paused():  # all six queued before the driver can start a wave with fewer
            futs = [eng.submit([5 + i, 6], max_new_tokens=2 + 5 * (i % 2), eos_token_id=[]) for i in range(6)]
        [f.result(timeout=60) for f in futs]
    assert eng.stats()["refills"] == 0 and eng.stats()["prefills"] == 3
