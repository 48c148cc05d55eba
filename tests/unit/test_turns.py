"""Tier 1 (one process): the prefix cache (``generation/prefix_cache.py``) and multi-turn rollouts
(``engine.rollout(..., env=, max_turns=)``) on the local backend: tokens equal to the engine with
the cache off, no stale KV after ``paused()`` or a ``train()``/``eval()`` switch, eviction under a
small bound, sliding-window models falling back, and the multi-turn batch's layout."""

from __future__ import annotations

import time

import pytest
import torch
import turns_scenarios as ts
from models import VOCAB, tiny_model
from numerics import LOGPROB_ATOL
from turns_scenarios import assert_conversations

import shardgen
from shardgen.generation.prefix_cache import BLOCK, PrefixCache


# ----------------------------------------------------------------------------- the cache alone
def _kv(tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    t = torch.tensor(tokens, dtype=torch.float32)[None, :, None]  # [H=1, L, D=1]: the ids themselves
    return [(t.clone(), -t.clone())]


def test_match_is_the_longest_prefix_but_the_last_token():
    cache = PrefixCache(1000)
    a = list(range(10, 50))  # 40 tokens
    cache.add(a, _kv(a))
    assert cache.match(a + [7, 8]) == (cache._lru[tuple(a)], 40)  # extends it
    assert cache.match(a)[1] == 39  # the last prompt token is always computed
    assert cache.match(a[:35] + [3, 3, 3])[1] == 35  # shares a prefix, not on a block boundary
    assert cache.match([9] + a) == (None, 0)
    assert cache.match(a[:BLOCK]) == (None, 0)  # a block or less: not worth a lookup
    b = a[:20] + list(range(60, 90))
    cache.add(b, _kv(b))
    assert cache.match(b + [1])[1] == len(b) and cache.match(a + [1])[1] == 40


def test_an_entry_extending_another_replaces_it_and_lru_evicts_within_the_bound():
    cache = PrefixCache(100)
    a = list(range(3, 43))
    cache.add(a, _kv(a))
    longer = a + list(range(50, 70))
    cache.add(longer, _kv(longer))  # the next turn: the previous one goes
    assert len(cache) == 1 and cache.tokens == 60
    c = list(range(100, 130))
    cache.add(c, _kv(c))
    assert cache.tokens == 90
    cache.touch(cache.match(longer + [1])[0])  # longer is now the most recent
    d = list(range(200, 230))
    cache.add(d, _kv(d))  # 120 > 100: c (least recent) goes
    assert cache.evictions == 1 and cache.tokens == 90
    assert cache.match(c + [1]) == (None, 0) and cache.match(longer + [1])[1] == 60
    cache.add(list(range(300, 420)), _kv(list(range(300, 420))))  # longer than the bound: not kept
    assert cache.tokens == 90
    assert cache.clear() == 2 and cache.tokens == 0 and cache.match(d + [1]) == (None, 0)


def test_a_shared_block_survives_the_eviction_of_its_latest_holder():
    cache = PrefixCache(80)
    header = list(range(3, 35))  # 32 tokens: two blocks every entry starts with
    a, b = header + [40] * 4, header + [50] * 4
    cache.add(a, _kv(a))
    cache.add(b, _kv(b))  # the index's blocks now point at b
    cache.touch(cache._lru[tuple(a)])
    c = list(range(100, 130))
    cache.add(c, _kv(c))  # b goes; a still holds the header
    entry, n = cache.match(header + [60, 61])
    assert n == 32 and entry is not None and entry.tokens == tuple(a)


# ----------------------------------------------------------------------------- on an engine
def test_conversations_equal_the_uncached_engine_and_no_stale_kv_after_a_pause():
    assert_conversations(ts.conversations("local", counts=(3,)))


@pytest.mark.parametrize("max_prefill_tokens, share", [(7, True), (None, False)])
def test_cache_with_chunks_and_without_shared_prefill(max_prefill_tokens, share):
    assert_conversations(ts.conversations("local", max_prefill_tokens=max_prefill_tokens, counts=(3,),
                                          share_prefill=share))  # fmt: skip


@pytest.mark.parametrize("arch", ["qwen2", "gpt2", "gemma"])
def test_cache_on_other_architectures(arch):
    """Biases and GQA (qwen2), learned absolute positions (gpt2), tied scaled embeddings (gemma)."""
    assert_conversations(ts.conversations("local", arch=arch, counts=(2,)))


def test_sliding_window_layers_fall_back_to_the_full_prefill():
    """Mistral with a window of 8: its cache layers forget columns, so nothing is kept."""
    assert_conversations(ts.conversations("local", arch="mistral", counts=(2,)), cached=False)


def _turn(eng, prompt, reply, max_new_tokens=6):
    c = eng.generate([prompt], max_new_tokens=max_new_tokens, eos_token_id=[], logprobs=True)[0]
    return c, prompt + c.token_ids + reply


def test_a_train_eval_switch_drops_the_cache():
    """model.train(), a weight change, model.eval(): the next turn is computed on the new weights
    (equal to a fresh engine's), not continued from the KV of the old ones."""
    model, fresh = tiny_model("llama", seed=4), tiny_model("llama", seed=4)
    start = ts.prompts_of(0, 1, length=30)[0]
    reply = [5] * 8
    with shardgen.Engine(model, backend="local") as eng:
        _, nxt = _turn(eng, start, reply)
        model.train()  # the driver looks at the mode every tick (at most idle_sleep_max apart)
        time.sleep(0.05)  # a training step's time
        ts._scale(model, 1.25)
        model.eval()
        got, _ = _turn(eng, nxt, reply)
        stats = eng.stats()
    ts._scale(fresh, 1.25)
    with shardgen.Engine(fresh, backend="local", prefix_cache_tokens=0) as eng:
        want, _ = _turn(eng, nxt, reply)
    assert stats["prefix_cache_drops"] >= 1 and stats["cached_prompt_tokens"] == 0, stats
    assert got.token_ids == want.token_ids
    assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs, strict=True)) <= LOGPROB_ATOL


BOUND = 70


def test_eviction_under_a_small_bound_keeps_the_tokens():
    """A bound of 70 tokens, conversations of 28 tokens after their first turn: A and B fit, C
    pushes A (the least recently used) out; B's next turn hits, A's misses; every turn's tokens
    equal the uncached engine's."""
    model = tiny_model("llama", seed=6)
    a, b, c = ts.prompts_of(1, 3, length=24)
    a, b, c = a[:24], b[:24], c[:24]
    out = {}
    for cap in (0, BOUND):
        with shardgen.Engine(model, backend="local", prefix_cache_tokens=cap) as eng:
            turns, nxt = [], {}
            for name, p in (("a", a), ("b", b), ("c", c)):
                done, nxt[name] = _turn(eng, p, [7] * 5, max_new_tokens=5)
                turns.append(done)
            before = eng.stats()["cached_prompt_tokens"]
            turns.append(_turn(eng, nxt["b"], [], max_new_tokens=5)[0])
            hit_b = eng.stats()["cached_prompt_tokens"] - before
            turns.append(_turn(eng, nxt["a"], [], max_new_tokens=5)[0])
            stats, held = eng.stats(), eng._driver.work.prefixes.tokens
            out[cap] = ([t.token_ids for t in turns], [t.logprobs for t in turns], stats, hit_b, held)
    assert out[BOUND][0] == out[0][0]
    for x, y in zip(out[BOUND][1], out[0][1], strict=True):
        assert max(abs(p - q) for p, q in zip(x, y, strict=True)) <= LOGPROB_ATOL
    stats, hit_b = out[BOUND][2], out[BOUND][3]
    assert stats["prefix_cache_evictions"] >= 1, stats
    assert hit_b == 24 + 5 - 1 and stats["cached_prompt_tokens"] == hit_b, stats  # A's was evicted
    assert 0 < out[BOUND][4] <= BOUND


def test_a_shared_system_prompt_is_prefilled_once():
    model = tiny_model("llama", seed=7)
    header = ts.prompts_of(2, 1, length=40)[0]
    with shardgen.Engine(model, backend="local") as eng:
        eng.generate([header + [5, 6, 7]], max_new_tokens=4, eos_token_id=[])
        eng.generate([header + [8, 9]], max_new_tokens=4, eos_token_id=[])
        stats = eng.stats()
    assert stats["cached_prompt_tokens"] == 40, stats  # the header, from the first request's KV


# ----------------------------------------------------------------------------- multi-turn layout
def test_multi_turn_batch_layout_token_in_token_out():
    model = tiny_model("llama", seed=8)
    prompts = ts.prompts_of(3, 2, length=18)
    seen: list[tuple[int, list[int], list[int]]] = []

    def env(row, c):
        seen.append((row, list(c.prompt_token_ids), list(c.token_ids)))
        return None if sum(1 for r, *_ in seen if r == row) >= 1 + row else [7] * (3 + row)

    with shardgen.Engine(model, backend="local") as eng:
        b = eng.rollout(prompts, n=2, env=env, max_new_tokens=4, eos_token_id=[], seed=1)
        again = eng.score(b)
    assert b.turns == [1, 2, 3, 4]
    for i in range(len(b)):
        p, g = int(b.prompt_lengths[i]), int(b.response_lengths[i])
        assert b.input_ids[i, b.prompt_width - p : b.prompt_width].tolist() == prompts[i // 2]
        mask = b.response_mask[i, :g].tolist()
        turns = [(pr, tk) for r, pr, tk in seen if r == i]
        want = sum(([1] * len(tk) + [0] * (3 + i) for _, tk in turns[:-1]), []) + [1] * len(turns[-1][1])
        assert mask == want, (i, mask)  # model, env, ..., model
        assert b.attention_mask[i, b.prompt_width - p :].tolist()[: p + g] == [1] * (p + g)
        lps = b.logprobs[i, :g]
        assert bool((lps[torch.tensor(mask) == 0] == 0).all()) and bool(
            (lps[torch.tensor(mask) == 1] < 0).all()
        )
        # token-in, token-out: each turn's prompt is the last one's, its answer, the reply: no re-encoding
        for (p0, t0), (p1, _) in zip(turns, turns[1:], strict=False):
            assert p1 == p0 + t0 + [7] * (3 + i)
        resp = b.response_ids[i, :g].tolist()
        assert prompts[i // 2] + resp == turns[-1][0] + turns[-1][1]
    model_lp = (again.logprobs - b.logprobs)[b.response_mask.bool()]
    assert model_lp.abs().max() <= LOGPROB_ATOL  # score(batch) scores the whole conversation


def test_multi_turn_ends_at_max_turns_and_at_the_context():
    model = tiny_model("llama", seed=9)  # context 256
    prompt = ts.prompts_of(4, 1, length=20)
    with shardgen.Engine(model, backend="local") as eng:
        b = eng.rollout(prompt, env=lambda r, c: [5] * 4, max_turns=3, max_new_tokens=3, eos_token_id=[])
        assert b.turns == [3] and int(b.response_lengths[0]) == 3 * 3 + 2 * 4
        long = eng.rollout(prompt, env=lambda r, c: [5] * 100, max_new_tokens=3, eos_token_id=[])
        assert long.turns == [3] and long.finish_reasons == ["length"]  # 20 + 3 * 103 >= 256
        assert int(long.prompt_lengths[0] + long.response_lengths[0]) < 256 + 100
        groups = dict(
            eng.rollout_iter(ts.prompts_of(4, 3), n=2, env=ts.env_for(0, 2), max_new_tokens=3, seed=2)
        )
        assert sorted(groups) == [0, 1, 2] and all(len(g) == 2 for g in groups.values())
        assert [g.turns for _, g in sorted(groups.items())] == [[1, 1], [2, 2], [3, 3]]
        assert len(eng.rollout([], env=lambda r, c: None)) == 0


def test_bad_multi_turn_arguments_raise_with_the_values():
    model = tiny_model("llama", seed=9)
    prompt = ts.prompts_of(4, 1)
    with shardgen.Engine(model, backend="local") as eng:
        with pytest.raises(ValueError, match="max_turns must be None or an integer >= 1, got 0"):
            eng.rollout(prompt, env=lambda r, c: None, max_turns=0)
        with pytest.raises(ValueError, match="max_turns goes with env="):
            eng.rollout(prompt, max_turns=2)
        with pytest.raises(ValueError, match="env must be a callable"):
            eng.rollout(prompt, env=[1, 2])
        with pytest.raises(ValueError, match="with text: reply with token ids"):
            eng.rollout(prompt, env=lambda r, c: "the tool says hi", max_new_tokens=2)
        with pytest.raises(ValueError, match=f"outside the vocabulary of {VOCAB}: \\[{VOCAB}\\]"):
            eng.rollout(prompt, env=lambda r, c: [5, VOCAB], max_new_tokens=2)
        assert len(eng.generate([[5, 6, 7]], max_new_tokens=2)) == 1  # the engine still works


def test_the_pool_stays_within_its_bound_over_1000_conversations(monkeypatch):
    """1,000 two-turn conversations (20 rollouts of 50, as 20 trainer steps would) through a pool of
    2,000 tokens: never above the bound, hits throughout, and nothing held after close."""
    from shardgen.generation import prefix_cache

    held: list[int] = []
    add = prefix_cache.PrefixCache.add

    def watched(self, tokens, kv):
        add(self, tokens, kv)
        held.append(self.tokens)

    monkeypatch.setattr(prefix_cache.PrefixCache, "add", watched)
    model = tiny_model("llama", seed=10)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (20,), generator=g).tolist() for _ in range(1000)]
    with shardgen.Engine(model, backend="local", prefix_cache_tokens=2000, max_batch_size=64) as eng:
        turns = []
        for k in range(0, 1000, 50):
            b = eng.rollout(prompts[k : k + 50], env=lambda r, c: [5] * 4, max_turns=2, max_new_tokens=3)
            turns += b.turns
        pool = eng._driver.work.prefixes
        stats = eng.stats()
    assert turns == [2] * 1000
    assert len(held) >= 1000 and max(held) <= 2000, max(held)
    assert stats["cached_prompt_tokens"] >= 1000 * 20, stats  # every second turn reused its first
    assert len(pool) == 0 and pool.tokens == 0 and pool.bytes == 0  # close dropped everything


def test_a_finished_row_held_already_is_not_copied_again(monkeypatch):
    """A greedy group's samples end alike, and so does the same rollout again: the cache keeps one
    entry per answer, and only the first of equal rows has its KV copied out (the copy is what a
    finished row costs the cache); the next turn still hits it."""
    from shardgen.generation.rows import BatchRows

    copies: list[int] = []
    row_kv = BatchRows.row_kv

    def counted(self, i, length):
        copies.append(length)
        return row_kv(self, i, length)

    monkeypatch.setattr(BatchRows, "row_kv", counted)
    model = tiny_model("llama", seed=11)
    prompts = ts.prompts_of(3, 2, length=20)
    with shardgen.Engine(model, backend="local") as eng:
        first = eng.rollout(prompts, n=4, do_sample=False, max_new_tokens=6, eos_token_id=[])
        assert len(copies) == 2, copies  # one per prompt: its 4 samples are the same tokens
        again = eng.rollout(prompts, n=4, do_sample=False, max_new_tokens=6, eos_token_id=[])
        assert len(copies) == 2, copies  # the same answers: held already
        pool = eng._driver.work.prefixes
        held = len(pool)
        before = eng.stats()["cached_prompt_tokens"]
        nxt = [p + first.response_ids[4 * k].tolist() + [5, 6] for k, p in enumerate(prompts)]
        eng.rollout(nxt, max_new_tokens=2, eos_token_id=[])
        hit = eng.stats()["cached_prompt_tokens"] - before
    assert held == 2 and torch.equal(first.response_ids, again.response_ids)
    assert hit == sum(len(p) + 6 - 1 for p in prompts), hit  # each next turn continues its kept first
