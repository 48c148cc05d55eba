"""Tier 1 (no processes): ``engine.rollout()`` on the local backend with the shipped toy model.

Masks around EOS ids, stop ids and stop strings; logprobs against a teacher-forced forward;
seeds per sample. The same checks on sharded backends run in tests/multirank/test_rollout_multirank.py.
"""

from __future__ import annotations

import pytest
import torch
from models import batch, tiny_model
from numerics import assert_rows_agree, rollout_rows
from rollout_scenarios import check_layout, teacher_forced_logprobs
from transformers import AutoModelForCausalLM, AutoTokenizer

import shardgen
from shardgen import toy
from shardgen.config import SamplingParams
from shardgen.generation.rollout import sample_seed

PROMPTS = ["count from 3 to 9 :", "count down from 20 to 18 :", "count from 40 to 41 :"]


@pytest.fixture(scope="module")
def toy_engine():
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(toy.toy_model_path())
    model = AutoModelForCausalLM.from_pretrained(toy.toy_model_path()).eval()
    eng = shardgen.Engine(model, tok, backend="local")
    yield eng
    eng.close()


def test_masks_around_eos_stop_ids_and_stop_strings(toy_engine):
    tok = toy_engine.tokenizer
    eos = tok.eos_token_id
    # greedy: the toy model answers exactly, then EOS (kept, the rest masked)
    b = toy_engine.rollout(PROMPTS, do_sample=False, max_new_tokens=12)
    check_layout(b, pad_id=0)
    assert b.finish_reasons == ["eos", "eos", "eos"]
    for i, prompt in enumerate(PROMPTS):
        g = int(b.response_lengths[i])
        assert b.response_ids[i, g - 1].item() == eos
        assert tok.decode(b.response_ids[i, : g - 1].tolist()) == toy.expected_answer(prompt)
    assert b.texts is not None and b.texts[0] == toy.expected_answer(PROMPTS[0])
    # several EOS ids: the id of "5" also stops; "length" when max_new_tokens comes first
    five = tok.convert_tokens_to_ids("5")
    b = toy_engine.rollout(PROMPTS, do_sample=False, max_new_tokens=12, eos_token_id=[eos, five])
    check_layout(b, pad_id=0)
    assert b.finish_reasons == ["eos", "eos", "eos"]
    assert tok.decode(b.response_ids[0, : int(b.response_lengths[0])].tolist()) == "3 4 5"
    b = toy_engine.rollout(PROMPTS, do_sample=False, max_new_tokens=3)
    check_layout(b, pad_id=0)
    assert b.finish_reasons == ["length", "length", "eos"] and b.response_lengths.tolist() == [3, 3, 3]
    # stop strings on decoded text: the token completing "5 6" is the last one kept
    b = toy_engine.rollout(PROMPTS, do_sample=False, max_new_tokens=12, stop=["5 6", "19 18"])
    check_layout(b, pad_id=0)
    assert b.finish_reasons == ["stop", "stop", "eos"]
    assert tok.decode(b.response_ids[0, : int(b.response_lengths[0])].tolist()) == "3 4 5 6"
    assert tok.decode(b.response_ids[1, : int(b.response_lengths[1])].tolist()) == "20 19 18"
    # per request: a stop string in one call does not leak into the next
    assert toy_engine.rollout(PROMPTS[:1], do_sample=False, max_new_tokens=12).finish_reasons == ["eos"]


def id_prompts() -> list[list[int]]:
    ids, mask = batch([5, 9, 3], seed=3)
    return [row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True)]


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_logprobs_match_teacher_forcing(temperature):
    """A random tiny model (a spread-out distribution, unlike the trained toy), EOS at some step."""
    model = tiny_model("llama", seed=7)
    eos = list(range(2, 10))
    kw = dict(n=3, temperature=temperature, top_k=40, seed=5, max_new_tokens=12, eos_token_id=eos)
    with shardgen.Engine(model, backend="local") as eng:
        b = eng.rollout(id_prompts(), **kw)
        raw = eng.rollout(id_prompts(), raw_logprobs=True, **kw)
    check_layout(b, pad_id=0)
    assert "eos" in b.finish_reasons and "length" in b.finish_reasons
    ref = teacher_forced_logprobs(model, b, temperature)
    assert (b.logprobs - ref).abs().max().item() < 1e-5
    assert b.logprobs.sum() < -1.0  # not a trivially confident model
    # the untempered option: the same tokens, logprobs under T = 1
    assert torch.equal(raw.input_ids, b.input_ids)
    assert (raw.logprobs - teacher_forced_logprobs(model, raw, 1.0)).abs().max() < 1e-5
    if temperature != 1.0:
        assert (raw.logprobs - b.logprobs).abs().max() > 1e-3


def test_seeds_per_sample_reproducible_in_any_batch():
    prompts = id_prompts()
    kw = dict(max_new_tokens=10, eos_token_id=list(range(2, 10)))
    model = tiny_model("llama", seed=7)
    with shardgen.Engine(model, backend="local", max_batch_size=5) as eng:
        b = eng.rollout(prompts, n=4, seed=11, **kw)
        # prompt 1 again, at another position of another batch, with the same seed
        other = eng.rollout([prompts[1], prompts[2], [9, 10, 11]], n=4, seed=[11, 3, 4], **kw)
    assert b.seeds == [sample_seed(11, j, p) for p in prompts for j in range(4)]
    assert len(set(b.seeds)) == len(b.seeds)  # one scalar seed, distinct draws for every row
    assert len(set(b.seeds[:4])) == 4
    rows = [tuple(b.response_ids[j, : int(b.response_lengths[j])].tolist()) for j in range(4)]
    assert len(set(rows)) > 1, "the n samples of one prompt should differ"
    # another batch computes other shapes: the same draws but at near-ties (tests/helpers/numerics.py)
    assert_rows_agree(
        rollout_rows(other)[:4], rollout_rows(b)[4:8], model=model, params=SamplingParams(do_sample=True)
    )


def test_empty_and_bad_calls(toy_engine):
    b = toy_engine.rollout([], n=4)
    assert len(b) == 0 and b.input_ids.shape == (0, 0) and b.finish_reasons == []
    ids = toy_engine.tokenizer(PROMPTS[0])["input_ids"]
    b = toy_engine.rollout([ids], do_sample=False, max_new_tokens=12)
    assert b.input_ids[0, : len(ids)].tolist() == ids and b.finish_reasons == ["eos"]
    with pytest.raises(ValueError, match="n must be"):
        toy_engine.rollout(PROMPTS, n=0)
    with pytest.raises(ValueError, match="2 seeds for 3 prompts"):
        toy_engine.rollout(PROMPTS, seed=[1, 2])
    with pytest.raises(ValueError, match="stop must be"):
        toy_engine.rollout(PROMPTS, stop="5")
    with pytest.raises(ValueError, match="not one prompt"):
        toy_engine.rollout(PROMPTS[0])


def test_pack_lays_out_rows_of_any_length():
    """``pack``'s tensors, value by value: prompts left-padded, responses right-padded, a row
    with no response, a multi-turn row's mask, versions where a row carries them (else -1), and
    zero rows as ``[0, 0]`` tensors."""
    from shardgen.generation.requests import Completion
    from shardgen.generation.rollout import pack

    done = [
        Completion([7, 8, 2], "eos", [5], logprobs=[-0.5, -0.25, -1.0], versions=[0, 1, 1]),
        Completion([], "length", [4, 5, 6], logprobs=None),
        Completion([9], "length", [3, 3], logprobs=[-2.0]),
    ]
    b = pack(done, pad_id=0, n=1, seeds=[None] * 3, masks=[[1, 0, 1], [], [1]], turns=[2, 1, 1])
    assert b.input_ids.tolist() == [[0, 0, 5, 7, 8, 2], [4, 5, 6, 0, 0, 0], [0, 3, 3, 9, 0, 0]]
    assert b.attention_mask.tolist() == [[0, 0, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [0, 1, 1, 1, 0, 0]]
    assert b.response_mask.tolist() == [[1, 0, 1], [0, 0, 0], [1, 0, 0]]
    assert b.logprobs.tolist() == [[-0.5, -0.25, -1.0], [0.0, 0.0, 0.0], [-2.0, 0.0, 0.0]]
    assert b.logprobs.dtype == torch.float32 and b.input_ids.dtype == torch.long
    assert b.versions.tolist() == [[0, 1, 1], [-1, -1, -1], [-1, -1, -1]]
    assert b.prompt_lengths.tolist() == [1, 3, 2] and b.turns == [2, 1, 1]
    empty = pack([], pad_id=0, n=1, seeds=[])
    assert empty.input_ids.shape == empty.logprobs.shape == empty.versions.shape == (0, 0)
