"""Tier 1: the model's generation_config gives the defaults (as HF generate() does); explicit values win."""

from __future__ import annotations

import pytest
import torch
from models import batch, tiny_model

import shardgen
from shardgen.config import LIBRARY_DEFAULTS, SamplingParams, model_defaults
from shardgen.generation.requests import build_request

MODEL_SET = {"max_new_tokens": 6, "do_sample": True, "temperature": 0.7, "top_k": 1, "top_p": 0.9}


def _model(**gen):
    model = tiny_model("llama", seed=41)
    for k, v in gen.items():
        setattr(model.generation_config, k, v)
    return model


def _params(model, params=None, **over):
    p = (params or SamplingParams()).replace(**over)
    req = build_request([5, 6, 7], p, model_config=model.config, generation_config=model.generation_config)
    return req.seq.params


def test_model_generation_config_fills_unset_fields_only():
    model = _model(**MODEL_SET)
    got = _params(model)
    assert {k: getattr(got, k) for k in MODEL_SET} == MODEL_SET
    explicit = {"max_new_tokens": 3, "do_sample": False, "temperature": 1.5, "top_k": 0, "top_p": 1.0}
    got = _params(model, SamplingParams(**explicit))
    assert {k: getattr(got, k) for k in explicit} == explicit  # params the user set win, defaults or not
    got = _params(model, SamplingParams(top_k=4), top_p=0.5)  # overrides on top of params
    assert (got.top_k, got.top_p, got.temperature, got.max_new_tokens) == (4, 0.5, 0.7, 6)


def test_unset_in_the_model_means_library_defaults():
    model = tiny_model("llama", seed=41)  # its generation_config sets none of the five
    assert model_defaults(model.generation_config) == {}
    got = _params(model)
    assert {k: getattr(got, k) for k in LIBRARY_DEFAULTS} == LIBRARY_DEFAULTS
    assert _params(_model(temperature=0.5)).temperature == 0.5
    # A value equal to a bare GenerationConfig()'s (None in transformers 5) does not count as set.
    assert model_defaults(_model(top_k=None).generation_config) == {}


def test_no_arguments_is_valid_and_the_models_values_are_checked():
    SamplingParams().validate()
    # A bad value from the model's generation_config fails the request, not silently.
    try:
        _params(_model(max_new_tokens=10_000))
    except ValueError as e:
        assert "exceeds the model's context" in str(e)
    else:
        raise AssertionError("max_new_tokens from the model was not checked")


def test_engine_uses_the_models_defaults_like_hf_generate():
    model = _model(**MODEL_SET)  # sampling with top_k=1: HF and we both take the argmax
    ids, mask = batch([3, 5, 4], seed=42)
    with torch.no_grad():
        want = model.generate(ids, attention_mask=mask, synced_gpus=False)  # HF, model's defaults
    assert want.shape[1] == ids.shape[1] + MODEL_SET["max_new_tokens"]
    with shardgen.Engine(model, backend="local") as eng:
        got = eng.generate_ids(ids, mask)
        assert torch.equal(got, want)
        prompt = ids[0][mask[0].bool()]
        (c,) = eng.generate([prompt.tolist()], eos_token_id=[])
        assert len(c.token_ids) == 6 and c.seed is not None  # the model's max_new_tokens and do_sample
        (short,) = eng.generate([prompt.tolist()], max_new_tokens=2, eos_token_id=[])
        assert short.token_ids == c.token_ids[:2]
        (greedy,) = eng.generate([prompt.tolist()], SamplingParams(do_sample=False), eos_token_id=[])
        assert greedy.seed is None and greedy.token_ids == c.token_ids
        # top_k=0 explicitly: the model's top_k=1 no longer applies (a tiny random model's
        # distribution is nearly flat, so 12 sampled tokens equal to the argmax's never happen)
        (wide,) = eng.generate(
            [prompt.tolist()], max_new_tokens=12, top_k=0, top_p=1.0, seed=3, eos_token_id=[]
        )
        (narrow,) = eng.generate([prompt.tolist()], max_new_tokens=12, seed=3, eos_token_id=[])
        assert wide.token_ids != narrow.token_ids


def test_greedy_model_defaults_match_hf():
    model = _model(max_new_tokens=5)
    ids, mask = batch([2, 6], seed=43)
    with torch.no_grad():
        want = model.generate(ids, attention_mask=mask, synced_gpus=False)
    with shardgen.Engine(model, backend="local") as eng:
        assert torch.equal(eng.generate_ids(ids, mask), want)
        assert eng.generate_ids(ids, mask, max_new_tokens=2).shape[1] <= ids.shape[1] + 2


def test_special_ids_outside_the_vocabulary_are_refused():
    """An EOS id the model cannot produce would never end the request: it would silently run to
    max_new_tokens. Refused when the request is built (the API's ValueError), with the numbers."""
    model = tiny_model("llama", seed=41)
    vocab = model.config.vocab_size
    for bad, said in (
        ({"eos_token_id": vocab + 5}, f"{vocab + 5} is outside the model's vocabulary [0, {vocab})"),
        ({"eos_token_id": [1, -1]}, "eos_token_id must be a token id (an integer >= 0) or a list of them"),
        ({"pad_token_id": vocab}, f"pad_token_id {vocab} is outside"),
    ):
        with pytest.raises(ValueError) as info:
            _params(model, **bad)
        assert said in str(info.value), (bad, str(info.value))
    assert _params(model, eos_token_id=vocab - 1, pad_token_id=0).eos_token_id == vocab - 1


def test_a_bad_request_names_every_setting_at_fault():
    """One ValueError for the whole request, every fault in it with its numbers (not the first
    only); a request with one fault keeps its single message."""
    model = tiny_model("llama", seed=41)
    vocab, n_ctx = model.config.vocab_size, model.config.max_position_embeddings
    p = SamplingParams(top_k=-1, eos_token_id=vocab + 3, max_new_tokens=n_ctx, stop=["x"])
    with pytest.raises(ValueError) as info:
        build_request([5, vocab, 7], p, model_config=model.config, generation_config=model.generation_config)
    said = str(info.value)
    for part in (
        "top_k must be an integer >= 0, got -1",
        f"prompt token id {vocab} is outside the model's vocabulary [0, {vocab})",
        f"eos_token_id {vocab + 3} is outside",
        f"prompt of 3 tokens + max_new_tokens {n_ctx} exceeds the model's context of {n_ctx} tokens",
        "stop strings need a tokenizer",
    ):
        assert part in said, (part, said)
    assert said.startswith("top_k must be")  # the sampling settings first, as before
    with pytest.raises(ValueError) as info:
        build_request(
            [], SamplingParams(), model_config=model.config, generation_config=model.generation_config
        )
    assert str(info.value) == "empty prompt: a request needs at least one prompt token"


def test_generate_names_which_prompt_is_too_long_for_the_context():
    """generate() of a list: the length error says which prompt (its index in the list)."""
    model = tiny_model("llama", seed=41)
    n_ctx = model.config.max_position_embeddings
    with shardgen.Engine(model, backend="local") as eng:
        with pytest.raises(ValueError) as info:
            eng.generate([[5, 6], [5] * 3, [5] * n_ctx, [7]], max_new_tokens=2)
        assert str(info.value) == (
            f"prompt 2 of 4: prompt of {n_ctx} tokens + max_new_tokens 2 exceeds the model's context of "
            f"{n_ctx} tokens"
        )
        with pytest.raises(ValueError, match=r"^prompt of \d+ tokens \+ max_new_tokens 2 exceeds"):
            eng.generate([[5] * n_ctx], max_new_tokens=2)  # one prompt: nothing to tell apart
