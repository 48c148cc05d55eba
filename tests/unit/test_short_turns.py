"""The prefix cache serves a conversation's next turn however short its first turn was (an entry
shorter than a block, ``generation/prefix_cache.py``), while a prefix shared with an unrelated
entry is still served only from a whole block on. One process, the local backend, the toy model."""

from __future__ import annotations

import pytest
import torch
from numerics import LOGPROB_ATOL
from transformers import AutoModelForCausalLM, AutoTokenizer
from turns_scenarios import rows_of

import shardgen
from shardgen import toy
from shardgen.generation.prefix_cache import BLOCK, PrefixCache


def _kv(tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    t = torch.tensor(tokens, dtype=torch.float32)[None, :, None]
    return [(t.clone(), -t.clone())]


def test_a_short_entry_serves_the_prompts_that_extend_it():
    cache = PrefixCache(1000)
    short = list(range(10, 21))  # 11 tokens: a 7-token prompt and 5 tokens answered, but the last
    assert len(short) < BLOCK and cache.keeps(len(short))
    cache.add(short, _kv(short))
    assert cache.match(short + [3, 4]) == (cache._lru[tuple(short)], 11)  # the next turn
    assert cache.match(short) == (None, 0)  # the whole entry is more than the prompt's all-but-last
    assert cache.match(short[:6] + [3, 4, 5]) == (None, 0)  # a shared part: not worth a lookup
    nxt = short + [3, 4] + list(range(30, 40))  # the next turn's entry (23 tokens)
    cache.add(nxt, _kv(nxt))
    assert cache.match(nxt + [5])[1] == len(nxt)
    assert cache.match(nxt[:20] + [9])[1] == 20  # a block or more shared: served
    # the short one stays: a sibling turn (another reply) shares only 12 tokens with the longer one
    assert len(cache) == 2 and cache.match(short + [3, 9]) == (cache._lru[tuple(short)], 11)
    tiny = [5, 6, 7]
    cache.add(tiny, _kv(tiny))
    cache.add([8], _kv([8]))
    assert cache.match(tiny + [1]) == (cache._lru[tuple(tiny)], 3) and cache.match([8, 1])[1] == 1
    assert cache.clear() == 4 and cache.match(tiny + [1]) == (None, 0)


@pytest.fixture(scope="module")
def toy_model():
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(toy.toy_model_path())
    return tok, AutoModelForCausalLM.from_pretrained(toy.toy_model_path()).eval()


def test_a_short_first_turns_next_turn_is_served_from_the_cache(toy_model):
    """Two conversations whose first turn is 7 prompt tokens and 5 answered ("7 8 9 10" and EOS):
    the second turn's prompt takes those 11 columns from the cache (the answer's last token is
    never fed, so the next turn computes it), and every row equals the uncached engine's."""
    tok, model = toy_model
    prompts = [tok(p)["input_ids"] for p in ("count from 7 to 10 :", "count from 30 to 33 :")]
    assert [len(p) for p in prompts] == [7, 7]
    reply = tok("count from 3 to 5 :", add_special_tokens=False)["input_ids"]

    def env(row, c):  # one reply, then the end: two model turns
        return reply if len(c.prompt_token_ids) == len(prompts[row]) else None

    rows, stats = {}, {}
    for cap in (None, 0):
        with shardgen.Engine(model, backend="local", prefix_cache_tokens=cap) as eng:
            b = eng.rollout(prompts, env=env, do_sample=False, max_new_tokens=8, logprobs=True)
            rows[cap], stats[cap] = rows_of(b), eng.stats()
    first = [toy.expected_answer("count from 7 to 10 :"), toy.expected_answer("count from 30 to 33 :")]
    for r, want in zip(rows[None], first, strict=True):
        assert r["turns"] == 2 and tok.decode(r["tokens"][:4]) == want and r["tokens"][4] == tok.eos_token_id
    for a, b in zip(rows[None], rows[0], strict=True):
        for key in ("prompt", "tokens", "mask", "turns"):
            assert a[key] == b[key], (key, a[key], b[key])
        assert max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"], strict=True)) <= LOGPROB_ATOL
    on, off = stats[None], stats[0]
    assert off["cached_prompt_tokens"] == 0
    assert on["cached_prompt_tokens"] == 2 * (7 + 5 - 1), on  # each second turn: its first turn's columns
    assert on["prefill_tokens"] + on["cached_prompt_tokens"] == off["prefill_tokens"], (on, off)
