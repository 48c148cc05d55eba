"""``shardgen.integrations.deepspeed.ShardgenRollout`` against DeepSpeed 0.19.8's own
``HybridEngineRollout``, on ``deepspeed.initialize`` ZeRO-3 engines at 2 and 3 gloo ranks
(DS_ACCELERATOR=cpu), every run under a hard timeout.

One World per size for the module (DeepSpeed leaves process-wide state in its ranks); each
size's hang test runs last on it, expects the World to hang and kill its ranks (by pid).
"""

from __future__ import annotations

import contextlib
import importlib
import sys

import pytest

pytest.importorskip("deepspeed.runtime.rollout")

import dsroll_scenarios as sc  # noqa: E402
import torch  # noqa: E402
from world import World, WorldHang  # noqa: E402

pytestmark = pytest.mark.multirank

ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
HANG_S = 10.0  # the same step through ShardgenRollout returns in about a second


# ----------------------------------------------------------------------------- in-process
def test_missing_deepspeed_gives_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed.runtime.rollout", None)
    monkeypatch.delitem(sys.modules, "shardgen.integrations.deepspeed", raising=False)
    with pytest.raises(ImportError, match=r"pip install 'shardgen\[deepspeed\]'"):
        importlib.import_module("shardgen.integrations.deepspeed")


def test_layout_of_the_default_path_is_hybrid_engine_rollouts():
    """The batch built from completions equals HybridEngineRollout's post-processing of the same
    tokens decoded to max_new_tokens: the first EOS kept, what follows and a generated pad id
    masked, the response as wide as max_new_tokens; the continuous path marks every token and is
    as wide as the longest row."""
    from deepspeed.runtime.rollout import HybridEngineRollout, RolloutRequest, SamplingConfig

    from shardgen.generation.requests import Completion
    from shardgen.integrations.deepspeed import ShardgenRollout

    ours = object.__new__(ShardgenRollout)
    ours.pad, ours.eos = 0, [2]
    req = RolloutRequest(torch.tensor([[0, 5, 6], [7, 8, 9]]), torch.tensor([[0, 1, 1], [1, 1, 1]]))
    # Both rows stop at an EOS (2) before max_new_tokens = 6, row 1 with a pad id (0) among its
    # tokens. HF, EOS off, decodes 6 tokens in every row (its later tokens: 7, 9).
    done = [Completion([11, 12, 2], "eos", [5, 6]), Completion([13, 0, 14, 2], "eos", [7, 8, 9])]
    decoded = torch.tensor([[0, 5, 6, 11, 12, 2, 2, 7, 7], [7, 8, 9, 13, 0, 14, 2, 9, 9]])
    ids, resp_attn = HybridEngineRollout._pad_after_eos(decoded, 3, 2, 0)
    got = ours._layout(req, done, 1, SamplingConfig(max_new_tokens=6))
    assert (
        got.input_ids.tolist()
        == ids.tolist()
        == [[0, 5, 6, 11, 12, 2, 0, 0, 0], [7, 8, 9, 13, 0, 14, 2, 0, 0]]
    )
    assert got.attention_mask.tolist() == torch.cat([req.prompt_attention_mask, resp_attn], 1).tolist()
    assert got.response_start_idx.tolist() == [3, 3]
    cont = ours._layout(req, done, 1, SamplingConfig(max_new_tokens=6, continuous_batch_size=2))
    assert cont.input_ids.tolist() == [row[:7] for row in ids.tolist()]  # as wide as the longest
    assert cont.attention_mask.tolist() == [[0, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1]]


class _FakeEngine:
    """Completes each submitted row after a moment, on a timer thread; counts rows in flight."""

    def __init__(self) -> None:
        import threading

        self.lock, self.live, self.most, self.calls = threading.Lock(), 0, 0, []

    def submit_many(self, prompts, params, *, seed, **options):
        import threading
        from concurrent.futures import Future

        from shardgen.generation.requests import Completion

        self.calls.append((len(prompts), list(seed)))
        futures, timers = [], []
        for p in prompts:
            f: Future = Future()
            with self.lock:
                self.live += 1
                self.most = max(self.most, self.live)

            def done(f=f, p=p):
                with self.lock:
                    self.live -= 1
                f.set_result(Completion([7], "length", p))

            timers.append(threading.Timer(0.01 * (1 + len(futures) % 3), done))
            futures.append(f)
        # The call's rows are all in flight before any finishes (a timer started in the loop could
        # fire, under load, before the last row was counted).
        for t in timers:
            t.start()
        return futures


@pytest.mark.parametrize("window, most", [(None, 7), (3, 3), (1, 1)])
def test_continuous_batch_size_bounds_the_rows_in_flight(window, most):
    from shardgen.integrations.deepspeed import ShardgenRollout

    ours = object.__new__(ShardgenRollout)
    ours.shardgen_engine = _FakeEngine()
    prompts = [[3 + i] for i in range(7)]
    done = ours._serve(prompts, list(range(7)), {}, window)
    assert [c.prompt_token_ids for c in done] == prompts  # in order
    assert ours.shardgen_engine.most == most
    assert [s for _, seeds in ours.shardgen_engine.calls for s in seeds] == list(range(7))


def test_bad_sampling_settings_raise_with_the_numbers():
    from deepspeed.runtime.rollout import SamplingConfig

    from shardgen.integrations.deepspeed import ShardgenRollout

    for cfg, words in [
        (SamplingConfig(max_new_tokens=0), "max_new_tokens must be an integer >= 1, got 0"),
        (SamplingConfig(max_new_tokens=4, n_samples_per_prompt=0), "got 0"),
        (SamplingConfig(max_new_tokens=4, continuous_batch_size=0), "continuous_batch_size"),
        (SamplingConfig(max_new_tokens=4, top_p=1.5), "top_p must be in (0, 1], got 1.5"),
    ]:
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
            ShardgenRollout._check(cfg)


class _StubEngine:
    """Stands for shardgen.Engine in the constructor tests: records how it was built."""

    made: list = []

    def __init__(self, model, tokenizer, **options) -> None:
        self.model, self.tokenizer, self.options = model, tokenizer, options
        _StubEngine.made.append(self)

    @contextlib.contextmanager
    def paused(self):
        yield

    def close(self) -> None:
        pass


@pytest.fixture
def stub_engine(monkeypatch):
    import shardgen

    monkeypatch.setattr(shardgen, "Engine", _StubEngine)
    monkeypatch.setattr(_StubEngine, "made", [])
    return _StubEngine


def test_constructed_as_build_rollout_constructs_hybrid_engine_rollout(monkeypatch, stub_engine):
    """DeepSpeed's own build_rollout, its HybridEngineRollout name pointed at ours: the keywords
    engine=, tokenizer=, cfg=; the same three by position; .engine is the DeepSpeed engine."""
    import deepspeed.runtime.rollout as dsr
    from deepspeed.runtime.rollout import RolloutConfig

    from shardgen.integrations.deepspeed import ShardgenRollout

    ds, tok, cfg = object(), sc.IdsOnly(eos=2), RolloutConfig()
    monkeypatch.setattr(dsr, "HybridEngineRollout", ShardgenRollout)
    built = dsr.build_rollout(cfg, student_engine=ds, tokenizer=tok)
    by_position = ShardgenRollout(ds, tok, cfg, seed=3, max_batch_size=4)
    for r in (built, by_position):
        assert isinstance(r, ShardgenRollout) and r.engine is ds and r.tokenizer is tok and r.cfg is cfg
        assert isinstance(r.shardgen_engine, _StubEngine) and r.shardgen_engine.model is ds
        assert r.sync_weights(7) is None and r.get_last_profile() is None
    assert built.shardgen_engine.options == {"backend": "deepspeed"}
    assert by_position.shardgen_engine.options == {"backend": "deepspeed", "max_batch_size": 4}


def test_rollout_config_fields_map_or_are_refused_by_name(stub_engine):
    from deepspeed.runtime.rollout import RolloutConfig
    from deepspeed.runtime.rollout.hybrid_engine_rollout import HybridEngineRolloutConfig

    from shardgen.integrations.deepspeed import ShardgenRollout

    tok = sc.IdsOnly(eos=2)
    decode_only = HybridEngineRolloutConfig(
        use_graph_capture=True, use_shared_prefill=True, align_decode_fronts=True,
        enable_cache_trimming=True, continuous_cache_capacity=64,
    )  # fmt: skip
    assert ShardgenRollout(None, tok, decode_only).shardgen_engine.options == {
        "backend": "deepspeed", "share_prefill": True,
    }  # fmt: skip
    ours_first = ShardgenRollout(None, tok, cfg=decode_only, share_prefill=False)
    assert ours_first.shardgen_engine.options["share_prefill"] is False  # engine options over cfg's
    assert ShardgenRollout(None, tok, RolloutConfig(engine="shardgen")).engine is None
    built = len(stub_engine.made)
    with pytest.raises(ValueError, match=r"cfg.engine='vllm'"):
        ShardgenRollout(None, tok, RolloutConfig(engine="vllm"))
    with pytest.raises(ValueError, match=r"cfg.enable_profiling=True"):
        ShardgenRollout(None, tok, HybridEngineRolloutConfig(enable_profiling=True))
    assert len(stub_engine.made) == built  # refused before the (collective) engine


def test_pad_id_zero_is_kept_and_a_missing_pad_is_the_eos(stub_engine):
    from shardgen.integrations.deepspeed import ShardgenRollout

    assert ShardgenRollout(None, sc.IdsOnly(eos=[5, 6], pad=0)).pad == 0  # 0 is a pad id, not unset
    assert ShardgenRollout(None, sc.IdsOnly(eos=[5, 6], pad=None)).pad == 5
    with pytest.raises(ValueError, match="pad_token_id or eos_token_id"):
        ShardgenRollout(None, sc.IdsOnly(eos=None, pad=None))


# ----------------------------------------------------------------------------- 2 ranks
def test_greedy_rows_equal_hybrid_engine_rollouts(worlds):
    """Same engine, the default path at n = 1 and 2: tensor for tensor; DeepSpeed's own type, and
    its ResponseTokenBatch takes it. The continuous path (HybridEngineRollout's own does not run
    with transformers 5): the same rows, as wide as the longest."""
    for r, res in enumerate(worlds.get(2).run(sc.greedy_vs_hybrid, timeout=180)):
        assert res["type"] == "deepspeed.runtime.rollout.base.RolloutBatch"
        for k, (theirs, ours) in enumerate(zip(res["theirs"], res["ours"][:2], strict=True)):
            assert ours == theirs, f"rank {r}, config {k}: {ours} != HybridEngineRollout's {theirs}"
        (ids, attn, start), (cont_ids, cont_attn, cont_start) = res["ours"][0], res["ours"][2]
        assert res["ours"][0] == res["single"]  # = HybridEngineRollout's on one process
        p = start[0]
        stopped = [row for row in ids if any(t in res["eos"] for t in row[p:])]
        assert stopped and any(0 in row[p:] for row in attn), (ids, attn)  # cut after an EOS
        width = len(cont_ids[0])
        assert cont_start == start and cont_ids == [row[:width] for row in ids]
        assert all(t == sc.PAD for row in ids for t in row[width:])
        assert all(m[p:] == [1] * sum(m[p:]) + [0] * (width - p - sum(m[p:])) for m in cont_attn)
        for masked, attended in res["targets"]:
            assert masked == attended


def test_partial_rollouts_through_shardgen_rollout(worlds):
    """groups=1 a call, 2 and 3 prompts a step per rank, a training step between calls: every
    prompt's group is served once, whole, held groups first; the rows' prompt columns are their
    groups'; its tokens drawn within max_staleness (1) steps of its call; nothing left held."""
    for r, res in enumerate(worlds.get(2).run(sc.quota_steps, timeout=240)):
        served = [p for call in res["served"] for p in call]
        assert sorted(served) == sorted(res["sent"]), f"rank {r}: served {res['served']}, sent {res['sent']}"
        assert [len(c) for c in res["served"][:-1]] == [1, 1], f"rank {r}: {res['served']}"
        assert all(res["laid_out"]), f"rank {r}: {res['laid_out']}"
        spans = res["spans"]  # per group: version at its call, its tokens' lowest and highest, served at
        assert all(born <= lo <= hi <= min(born + 1, at) for born, lo, hi, at in spans), f"rank {r}: {spans}"
        assert any(at > born for born, *_, at in spans), f"rank {r}: no group held past a step: {spans}"
        assert res["left"] == 0, f"rank {r}: {res['left']} groups still held"


def test_uneven_rows_per_rank_2(worlds):
    """3, 1 and 0 prompts per rank, a different rank empty each step, greedy and sampled, with
    speculative decoding (``speculate=4``: the 3-rank test runs without): every step returns,
    greedy rows equal the single-process layout, ``last_stats`` counts drafts kept."""
    results = worlds.get(2).run(sc.shardgen_uneven, 3, 4, timeout=180)
    for r, res in enumerate(results):
        assert res["mismatches"] == [], f"rank {r}: {res}"
        assert any(s[0][0] == 0 for s in res["shapes"]), res["shapes"]
        assert all("tokens_per_forward" in s for s in res["stats"]), res["stats"]
        assert sum(s["drafted"] for s in res["stats"]) > 0, f"rank {r}: {res['stats']}"
    stats = [s for res in results for s in res["stats"]]
    assert sum(s["accepted"] for s in stats) > 0 and max(s["tokens_per_forward"] for s in stats) > 1.0, stats


def test_training_step_between_rollouts(worlds):
    for r, res in enumerate(worlds.get(2).run(sc.train_between, timeout=240)):
        assert res["losses"] == res["base"], f"rank {r}: training changed by the rollout engine: {res}"
        assert all(res["equal"]), f"rank {r}: {res['equal']}"
        assert all(res["restored"]), f"rank {r}: not paused between calls: {res['restored']}"
        assert all(res["modes"]), f"rank {r}: not back in training mode: {res['modes']}"
        assert res["changed"][0] is False and all(res["changed"][1:]), f"rank {r}: {res['changed']}"


@pytest.mark.parametrize("n", [2, 3])
def test_score_teacher_rows_uneven(worlds, n):
    """``ShardgenRollout.score``: a rollout's own rows give back its logprobs, its responses under
    teacher prompts equal HF teacher forcing on the gathered weights (top-k too), with a rank
    that has no rows each step, across a training step."""
    results = worlds.get(n).run(sc.rollout_score, timeout=240)
    rows = [step[0] for res in results for step in res["rows"]]
    assert 0 in rows and max(rows) > 0, rows  # a rank with none, and rows elsewhere
    for r, res in enumerate(results):
        assert all(rows[0] == rows[1] == rows[2] for rows in res["rows"]), f"rank {r}: {res['rows']}"
        assert max(res["self"]) < 1e-5, f"rank {r}: score(last_batch) != its logprobs: {res['self']}"
        assert max(res["teacher"]) < 2e-5, f"rank {r}: teacher scores off HF's: {res['teacher']}"
        assert all(res["modes"]), f"rank {r}: the module left out of training mode"


def test_hybrid_engine_rollout_hangs_on_uneven_rows_and_shardgen_does_not_2(worlds):
    world = worlds.get(2)
    for res in world.run(sc.hybrid_uneven, "shardgen", timeout=120):
        assert res["error"] is None and res["elapsed"] < HANG_S, res
    _assert_hybrid_hangs(world)


# ----------------------------------------------------------------------------- 3 ranks
def test_uneven_rows_per_rank_3(worlds):
    for r, res in enumerate(worlds.get(3).run(sc.shardgen_uneven, timeout=240)):
        assert res["mismatches"] == [], f"rank {r}: {res}"


def test_hybrid_engine_rollout_hangs_on_uneven_rows_and_shardgen_does_not_3(worlds):
    world = worlds.get(3)
    for res in world.run(sc.hybrid_uneven, "shardgen", timeout=120):
        assert res["error"] is None and res["elapsed"] < HANG_S, res
    _assert_hybrid_hangs(world)


def _assert_hybrid_hangs(world: World) -> None:
    """The rank with no prompt cannot decode (HF's forward raises on 0 rows) and moves on to the
    barrier; the ranks with prompts wait in ZeRO-3's gathers of their next decode step."""
    with pytest.raises(WorldHang) as info:
        world.run(sc.hybrid_uneven, "hybrid", timeout=HANG_S)
    assert world.broken
    stacks = info.value.stacks
    empty = [r for r in stacks if "in barrier" in stacks[r]]
    assert len(empty) == 1, stacks
    for r, stack in stacks.items():
        if r not in empty:
            assert "in generate" in stack and "in barrier" not in stack, stack


def test_deepspeed_rollout_contract_2(worlds):
    """DeepSpeed's RolloutEngine contract at 2 ranks on a real ZeRO-3 engine, a tokenizer of two
    ids: build_rollout's call, .engine, sync_weights, EOS cut, zero-row requests on either rank
    (empty batches of the right layout while the peer decodes), the continuous path, n = 2."""
    for r, res in enumerate(worlds.get(2).run(sc.contract, timeout=240)):
        assert res["type"] == "ShardgenRollout" and res["engine"] and res["shardgen_engine"], res
        assert res["sync"] is None
        assert res["cut"] == [] and res["stopped"], f"rank {r}: {res['cut']}"
        empty = [[]] * 3  # the calls with no row: every field empty (a list, not None)
        rows = [None] * 3  # no decode: no texts
        assert res["texts"] == (empty + rows if r == 0 else rows + empty), res["texts"]
        rows = [0, 0, 0, 3, 3, 6] if r == 0 else [3, 3, 6, 0, 0, 0]
        assert res["rows"] == rows, f"rank {r}: {res['rows']}"
        width = res["width"]
        assert res["empty"] == [
            ((0, width + sc.MAX_NEW), torch.long, torch.long, (0,), torch.long),
            ((0, width), torch.long, torch.long, (0,), torch.long),  # continuous: the longest row's
            ((0, width + sc.MAX_NEW), torch.long, torch.long, (0,), torch.long),
        ], f"rank {r}: {res['empty']}"
