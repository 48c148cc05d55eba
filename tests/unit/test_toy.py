"""The shipped toy-counter model, its tokenizer and the task helpers of ``shardgen.toy``."""

from __future__ import annotations

import random

import pytest

from shardgen import toy

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tokenizer():
    tok = transformers.AutoTokenizer.from_pretrained(toy.toy_model_path(), local_files_only=True)
    return tok


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    m = transformers.AutoModelForCausalLM.from_pretrained(toy.toy_model_path(), local_files_only=True)
    m.eval()
    return m


def _batch_prompts() -> list[str]:
    """16 prompts whose answers hold 1..25 numbers, both directions (prompt lengths differ too)."""
    rng = random.Random(7)
    out = []
    for i in range(16):
        length = 1 + (i * (toy.MAX_ANSWER_NUMBERS - 1)) // 15
        start, end = toy.sample_task(rng, length, down=bool(i % 2))
        out.append(toy.format_prompt(start, end))
    return out


# ---------------------------------------------------------------- task helpers


def test_expected_answer_up_and_down() -> None:
    assert toy.expected_answer("count from 7 to 19 :") == "7 8 9 10 11 12 13 14 15 16 17 18 19"
    assert toy.expected_answer("count down from 19 to 7 :") == "19 18 17 16 15 14 13 12 11 10 9 8 7"
    assert toy.expected_answer("count from 5 to 5 :") == "5"
    assert toy.expected_answer("  count from 0 to 2 :  ") == "0 1 2"
    assert toy.answer_length("count down from 30 to 6 :") == 25


@pytest.mark.parametrize(
    "bad",
    ["", "count from 7 to :", "count from 19 to 7 :", "count down from 7 to 19 :", "count from 7 to 99 :"],
)
def test_expected_answer_rejects_bad_prompts(bad: str) -> None:
    with pytest.raises(ValueError):
        toy.expected_answer(bad)


def test_answer_reward_partial_credit() -> None:
    p = toy.format_prompt(7, 10)
    assert toy.answer_reward(p, "7 8 9 10") == 1.0
    assert toy.answer_reward(p, "7 8") == 0.5
    assert toy.answer_reward(p, "7 8 9 10 11 12 13 14") == 0.5  # too long: over the longer
    assert toy.answer_reward(p, "8 9 10") == 0.0 and toy.answer_reward(p, "") == 0.0


def test_check_answer() -> None:
    p = "count from 7 to 9 :"
    assert toy.check_answer(p, "7 8 9")
    assert toy.check_answer(p, " 7 8 9 \n")
    assert not toy.check_answer(p, "7 8")
    assert not toy.check_answer(p, "7 8 9 10")
    assert not toy.check_answer(p, "7 8 9 </s>")
    assert not toy.check_answer(p, "")
    assert toy.check_answer("count down from 3 to 0 :", "3 2 1 0")


def test_format_prompt_roundtrip() -> None:
    assert toy.format_prompt(7, 19) == "count from 7 to 19 :"
    assert toy.format_prompt(19, 7) == "count down from 19 to 7 :"
    with pytest.raises(ValueError):
        toy.format_prompt(0, toy.MAX_ANSWER_NUMBERS)  # one number too many
    with pytest.raises(ValueError):
        toy.format_prompt(toy.MAX_NUMBER + 1, toy.MAX_NUMBER)


def test_make_prompts_deterministic() -> None:
    a = toy.make_prompts(50, seed=3)
    assert a == toy.make_prompts(50, seed=3)
    assert a != toy.make_prompts(50, seed=4)
    assert toy.make_prompts(50, seed=3, skew=True) == toy.make_prompts(50, seed=3, skew=True)
    assert len({p["id"] for p in a}) == 50
    assert all(set(p) == {"id", "prompt"} and isinstance(p["id"], str) for p in a)
    assert toy.make_prompts(0) == []
    for p in a:
        n = toy.answer_length(p["prompt"])  # also checks the prompt parses
        assert 1 <= n <= toy.MAX_ANSWER_NUMBERS
    assert len({toy.answer_length(p["prompt"]) for p in a}) > 10


def test_make_prompts_skew() -> None:
    lengths = [toy.answer_length(p["prompt"]) for p in toy.make_prompts(100, seed=0, skew=True)]
    short = sum(n <= 4 for n in lengths)
    long = sum(n >= 20 for n in lengths)
    assert short + long == 100
    assert short >= 75 and long >= 5
    for n in (2, 3, 8, 16):  # small sets still hold at least one short and one long prompt
        ls = [toy.answer_length(p["prompt"]) for p in toy.make_prompts(n, seed=1, skew=True)]
        assert min(ls) <= 4 and max(ls) >= 20


# ---------------------------------------------------------------- shipped model


def test_assets_present_and_small() -> None:
    path = toy.TOY_MODEL_PATH
    assert toy.toy_model_path() == str(path)
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert (path / name).is_file(), name
    total = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    assert total <= 5 * 1024 * 1024


def test_tokenizer(tokenizer) -> None:
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token, tokenizer.unk_token) == (
        "<s>",
        "</s>",
        "<pad>",
        "<unk>",
    )
    assert tokenizer.padding_side == "left"
    ids = tokenizer("7 8 9")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and len(ids) == 4
    assert tokenizer.decode(ids, skip_special_tokens=True) == "7 8 9"
    with_eos = ids + [tokenizer.eos_token_id, tokenizer.pad_token_id]
    assert tokenizer.decode(with_eos, skip_special_tokens=True) == "7 8 9"
    enc = tokenizer(["count from 1 to 2 :", "count down from 2 to 1 :"], padding=True)
    assert enc["input_ids"][0][0] == tokenizer.pad_token_id and enc["attention_mask"][0][0] == 0
    assert enc["input_ids"][0][1] == tokenizer.bos_token_id
    # every word the task uses is in the vocabulary
    vocab = tokenizer.get_vocab()
    assert all(w in vocab for w in toy.VOCAB_WORDS)


def test_model_config(model, tokenizer) -> None:
    cfg = model.config
    assert cfg.model_type == "llama"
    assert cfg.vocab_size == len(tokenizer)
    gen = model.generation_config
    assert gen.eos_token_id == tokenizer.eos_token_id
    assert gen.pad_token_id == tokenizer.pad_token_id
    assert gen.bos_token_id == tokenizer.bos_token_id
    assert gen.do_sample is False


def _generate(model, tokenizer, prompts: list[str]) -> tuple[list[str], list[int]]:
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(
            **enc,
            do_sample=False,
            max_new_tokens=toy.MAX_ANSWER_NUMBERS + 1,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    new = out[:, enc["input_ids"].shape[1] :]
    eos_steps = []
    for row in new.tolist():
        eos_steps.append(row.index(tokenizer.eos_token_id) if tokenizer.eos_token_id in row else -1)
    return tokenizer.batch_decode(new, skip_special_tokens=True), eos_steps


def test_greedy_generate_left_padded_batch(model, tokenizer) -> None:
    prompts = _batch_prompts()
    assert len({len(p.split()) for p in prompts}) == 2  # up and down prompts: left padding is exercised
    answers, eos_steps = _generate(model, tokenizer, prompts)
    correct = [toy.check_answer(p, a) for p, a in zip(prompts, answers, strict=True)]
    assert sum(correct) >= 15, list(zip(prompts, answers, strict=True))
    # EOS came at different steps: right after the last number of each answer
    assert len(set(eos_steps)) >= 10, eos_steps
    for p, ok, step in zip(prompts, correct, eos_steps, strict=True):
        if ok:
            assert step == toy.answer_length(p)


def test_greedy_generate_skewed_batch(model, tokenizer) -> None:
    prompts = [p["prompt"] for p in toy.make_prompts(16, seed=5, skew=True)]
    answers, eos_steps = _generate(model, tokenizer, prompts)
    assert sum(toy.check_answer(p, a) for p, a in zip(prompts, answers, strict=True)) >= 15, list(
        zip(prompts, answers, strict=True)
    )
    assert min(eos_steps) <= 4 and max(eos_steps) >= 20


def _doc(name: str) -> str:
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    return " ".join((root / name).read_text(encoding="utf-8").split())  # one line: prose wraps


def test_the_docs_state_the_toy_models_limits_as_its_assets_have_them(model) -> None:
    """Issue 33: a multi-turn example met "prompt of 221 tokens ... exceeds the model's context of
    128 tokens" with no word of that limit where the toy model is introduced."""
    readme = _doc("README.md")
    toy_intro = readme[readme.index("shardgen ships a tiny model") :][:600]
    assert f"a context of {model.config.max_position_embeddings} tokens" in toy_intro, toy_intro
    assert f"answers of at most {toy.MAX_ANSWER_NUMBERS} numbers" in toy_intro, toy_intro


def test_the_docs_say_what_rollout_iters_i_is_and_which_install_to_use() -> None:
    readme, usage = _doc("README.md"), _doc("docs/USAGE.md")
    for text in (readme, usage):
        at = text.index("rollout_iter(prompts")
        assert "`i` is the prompt's index" in text[at : at + 400], text[at : at + 400]
    setup = readme[readme.index("## Set up") : readme.index("## Quick start")]
    for command in ("pip install -e .", "make install"):
        assert f"Use `{command}`" in setup, setup
