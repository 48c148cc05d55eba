"""Tier 1 (no processes): the decoder on the local backend against single-process HF generate()."""

from __future__ import annotations

import pytest
import torch
from models import batch, eos_after, hf_generate, tiny_model
from numerics import Row, assert_rows_agree

import shardgen
from shardgen.config import SamplingParams


@pytest.fixture(scope="module", params=["llama", "qwen2", "gpt2", "opt", "mixtral"])
def arch_model(request):
    return request.param, tiny_model(request.param, seed=1)


def test_greedy_matches_hf_with_padding_and_early_eos(arch_model):
    arch, model = arch_model
    ids, mask = batch([5, 9, 3, 7], seed=2)
    eos = eos_after(model, ids, mask, row=1, step=3)
    expected = hf_generate(model, ids, mask, max_new_tokens=12, eos_token_id=eos, pad_token_id=0)
    with shardgen.Engine(model, backend="local") as eng:
        got = eng.generate_ids(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(got, expected), f"{arch}: engine {got.tolist()} != HF {expected.tolist()}"
    # the EOS row stopped early and was padded after its first EOS
    row = got[1, ids.shape[1] :].tolist()
    assert eos in row and all(t == 0 for t in row[row.index(eos) + 1 :])


def test_no_padding_batch_and_single_row_match_hf():
    model = tiny_model("llama", seed=3)
    for lengths in ([6, 6, 6], [4]):
        ids, mask = batch(lengths, seed=len(lengths))
        expected = hf_generate(model, ids, mask, max_new_tokens=9)
        with shardgen.Engine(model, backend="local") as eng:
            got = eng.generate_ids(ids, attention_mask=mask, max_new_tokens=9)
        assert torch.equal(got, expected)


def test_finish_reason_logprobs_and_eos_list():
    model = tiny_model("llama", seed=4)
    ids, mask = batch([4, 6], seed=5)
    eos = eos_after(model, ids, mask, row=0, step=2)
    with shardgen.Engine(model, backend="local") as eng:
        out = eng.generate(
            [ids[0][mask[0].bool()], ids[1][mask[1].bool()]],
            max_new_tokens=8,
            eos_token_id=[eos, 95],
            logprobs=True,
        )
    assert out[0].finish_reason == "eos" and out[0].token_ids[-1] == eos and len(out[0].token_ids) == 3
    for c in out:
        assert len(c.logprobs) == len(c.token_ids) and all(lp <= 0.0 for lp in c.logprobs)
    if eos not in out[1].token_ids and 95 not in out[1].token_ids:
        assert out[1].finish_reason == "length" and len(out[1].token_ids) == 8
    # logprobs are the model's own: recompute the first one directly
    with torch.no_grad():
        logits = model(ids[0:1, 2:]).logits[0, -1]
    ref = torch.log_softmax(logits.float(), -1)[out[0].token_ids[0]].item()
    assert abs(ref - out[0].logprobs[0]) < 1e-5


def test_eos_none_takes_the_models_and_an_empty_list_turns_eos_off():
    """As in HF, ``eos_token_id=None`` means the model's EOS, not none; ``[]`` means none at all
    (every row runs to ``max_new_tokens``), in ``generate`` and in a multi-turn ``rollout``."""
    model = tiny_model("llama", seed=4)
    ids, mask = batch([6], seed=5)
    model.generation_config.eos_token_id = eos_after(model, ids, mask, row=0, step=1)
    prompt = [ids[0][mask[0].bool()].tolist()]
    with shardgen.Engine(model, backend="local") as eng:
        model_eos = eng.generate(prompt, max_new_tokens=6, eos_token_id=None)[0]
        off = eng.generate(prompt, max_new_tokens=6, eos_token_id=[])[0]
        turns = eng.rollout(prompt, env=lambda r, c: [5] * 2, max_turns=2, max_new_tokens=6, eos_token_id=[])
    assert model_eos.finish_reason == "eos" and len(model_eos.token_ids) == 2
    assert off.finish_reason == "length" and len(off.token_ids) == 6
    assert turns.turns == [2] and int(turns.response_lengths[0]) == 6 + 2 + 6


def test_sampling_seed_is_per_request_not_per_batch():
    model = tiny_model("llama", seed=5)
    ids, mask = batch([4, 7, 5], seed=6)
    prompts = [ids[i][mask[i].bool()] for i in range(3)]
    opts = dict(max_new_tokens=10, do_sample=True, temperature=0.9, top_k=20, top_p=0.9)
    with shardgen.Engine(model, backend="local", max_batch_size=8) as eng:
        together = eng.generate(prompts, seed=[11, 12, 13], **opts)
        alone = [eng.generate([p], seed=s, **opts)[0] for p, s in zip(prompts, [11, 12, 13], strict=True)]
        other_seed = eng.generate([prompts[0]], seed=99, **opts)[0]
    params = SamplingParams(do_sample=True, temperature=0.9, top_k=20, top_p=0.9)
    a, b = (
        [Row(p.tolist(), c.token_ids, c.logprobs, c.seed) for p, c in zip(prompts, cs, strict=True)]
        for cs in (together, alone)
    )
    assert_rows_agree(a, b, model=model, params=params, what="together vs alone")
    assert all(c.seed == s for c, s in zip(together, [11, 12, 13], strict=True))
    assert other_seed.token_ids != together[0].token_ids


def test_invalid_requests_raise_for_that_call_only():
    model = tiny_model("gpt2", seed=7)
    with shardgen.Engine(model, backend="local") as eng:
        good = eng.submit([5, 6, 7], max_new_tokens=4)
        with pytest.raises(ValueError, match="max_new_tokens"):
            eng.generate([[5, 6]], max_new_tokens=0)
        with pytest.raises(ValueError, match="top_p"):
            eng.generate([[5, 6]], do_sample=True, top_p=1.5)
        with pytest.raises(ValueError, match="top_p"):
            eng.generate([[5, 6]], do_sample=True, top_p=0.0)
        with pytest.raises(ValueError, match="empty prompt"):
            eng.generate([[]])
        with pytest.raises(ValueError, match="250 tokens.*context of 256"):
            eng.generate([[5] * 250], max_new_tokens=10)
        with pytest.raises(ValueError, match="unknown generation option"):
            eng.generate([[5, 6]], max_tokens=3)
        assert len(good.result(timeout=30).token_ids) == 4
        assert len(eng.generate([[5, 6]], max_new_tokens=3)[0].token_ids) == 3
    with pytest.raises(RuntimeError, match="closed"):
        eng.generate([[5, 6]])
    with pytest.raises(RuntimeError, match="closed"):
        eng.submit([5, 6])


def test_stats_count_ticks_forwards_and_tokens():
    model = tiny_model("llama", seed=8)
    with shardgen.Engine(model, backend="local") as eng:
        out = eng.generate([[5, 6, 7], [8, 9]], max_new_tokens=5, eos_token_id=[])
    st = eng.stats()  # after close: the driver finished its last tick
    assert sum(len(c.token_ids) for c in out) == st["generated_tokens"] == 10
    assert st["prefills"] == 1 and st["decode_steps"] == 4 and st["forwards"] == 5
    # local forwards need no lockstep: a burst of forwards per tick
    assert 1 <= st["forward_ticks"] < st["forwards"] and st["shadow_forwards"] == 0 and st["forward_s"] > 0
    assert st["ticks"] >= st["forward_ticks"] + st["idle_ticks"]


def test_an_idle_engine_slows_its_ticks_after_a_second_and_a_request_still_wakes_it():
    """Idle ticks sleep under 5 ms for the first second of idleness, then up to idle_sleep_max
    (each costs CPU in the control plane's collective): about 20 ticks a second, not 200. A
    request submitted to a deeply idle engine still starts at once (its own rank's wake)."""
    import time

    from shardgen.core.driver import DEEP_IDLE_AFTER_S

    with shardgen.Engine(tiny_model("llama", seed=8), backend="local") as eng:
        eng.generate([[5, 6, 7]], max_new_tokens=2)
        time.sleep(DEEP_IDLE_AFTER_S + 0.2)
        before = eng.stats()["idle_ticks"]
        time.sleep(1.0)
        ticks = eng.stats()["idle_ticks"] - before
        t0 = time.monotonic()
        eng.generate([[5, 6, 7]], max_new_tokens=2)
        took = time.monotonic() - t0
    assert 5 <= ticks <= 40, ticks  # idle_sleep_max 50 ms; 5 ms sleeps would give about 200
    assert took < eng.config.idle_sleep_max + 1.0, took


def test_text_prompts_with_a_tokenizer():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardgen.toy import toy_model_path

    path = toy_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    with shardgen.Engine(model, tok, backend="local") as eng:
        out = eng.generate(["count from 3 to 7 :", "count from 10 to 12 :"], max_new_tokens=24)
    assert out[0].text.strip() == "3 4 5 6 7" and out[1].text.strip() == "10 11 12"
    assert all(c.finish_reason == "eos" for c in out)


def _buffers_per_layer(monkeypatch) -> dict[int, set[int]]:
    """Record, per cache layer, the K buffers its updates wrote into (by address; each buffer is
    kept alive here, so that a freed one's memory cannot come back as the next one's address)."""
    from shardgen.generation import cache as decode

    seen: dict[int, set[int]] = {}
    kept: list[torch.Tensor] = []
    orig = decode.ReservedLayer.update

    def update(self, k, v, *a, **kw):
        out = orig(self, k, v, *a, **kw)
        kept.append(self._kb)
        seen.setdefault(id(self), set()).add(self._kb.data_ptr())
        return out

    monkeypatch.setattr(decode.ReservedLayer, "update", update)
    return seen


def test_cache_layers_write_each_step_in_place(monkeypatch):
    """A plain cache layer allocates its keys/values once for a batch whose rows' budget fits the
    reserve; every step writes its column in place (DynamicLayer concatenates a new copy one
    column longer per step, which the CPU heap keeps: docs/PERFORMANCE.md section 8)."""
    model = tiny_model("llama", seed=6)
    seen = _buffers_per_layer(monkeypatch)
    ids, mask = batch([5, 9, 3], seed=7)
    with shardgen.Engine(model, backend="local") as eng:
        got = eng.generate_ids(ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0)
    assert torch.equal(got, hf_generate(model, ids, mask, max_new_tokens=12, pad_token_id=0))
    assert len(seen) == model.config.num_hidden_layers and all(len(b) == 1 for b in seen.values()), seen


def test_cache_reserve_grows_in_steps_and_matches_hf(monkeypatch, arch_model):
    """Past the reserve the buffer is copied into a larger one, RESERVE_COLUMNS at a time: with a
    reserve of 4 columns, 12 new tokens after the prompt take three buffers, outputs equal HF's."""
    from shardgen.generation import cache as decode

    arch, model = arch_model
    monkeypatch.setattr(decode, "RESERVE_COLUMNS", 4)
    seen = _buffers_per_layer(monkeypatch)
    ids, mask = batch([5, 9, 3, 7], seed=8)
    expected = hf_generate(model, ids, mask, max_new_tokens=12, pad_token_id=0)
    with shardgen.Engine(model, backend="local") as eng:
        got = eng.generate_ids(ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0)
    assert torch.equal(got, expected), f"{arch}: engine {got.tolist()} != HF {expected.tolist()}"
    # prefill: width 9 + 4; then 9 + 12 - 1 = 20 columns at the last step: 13 -> 17 -> 20
    assert seen and all(len(b) == 3 for b in seen.values()), (arch, seen)


def test_reserved_layer_holds_what_dynamic_layer_holds():
    """Random updates, row selections and leading-column cuts (what a fork, dropped rows and a
    merge do to a layer) applied to a ReservedLayer and a DynamicLayer give equal keys/values."""
    from transformers.cache_utils import DynamicLayer

    from shardgen.generation.cache import ReservedLayer

    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        res, dyn = ReservedLayer(), DynamicLayer()
        res.reserve = int(torch.randint(0, 40, (1,), generator=g))
        rows = 3
        for _ in range(15):
            op = int(torch.randint(0, 5, (1,), generator=g))
            if op == 0 and dyn.is_initialized and rows > 1:  # drop rows / fork
                idx = torch.randint(0, rows, (rows - 1,), generator=g)
                for layer in (res, dyn):
                    layer.keys = layer.keys.index_select(0, idx)
                    layer.values = layer.values.index_select(0, idx)
                rows -= 1
            elif op == 1 and dyn.is_initialized and dyn.keys.shape[-2] > 1:  # leading columns cut
                for layer in (res, dyn):
                    layer.keys, layer.values = layer.keys[..., 1:, :], layer.values[..., 1:, :]
            else:
                n = int(torch.randint(1, 4, (1,), generator=g))
                k, v = torch.randn(rows, 2, n, 4, generator=g), torch.randn(rows, 2, n, 4, generator=g)
                a, b = res.update(k, v), dyn.update(k.clone(), v.clone())
                assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), trial
        assert torch.equal(res.keys, dyn.keys) and torch.equal(res.values, dyn.values), trial
