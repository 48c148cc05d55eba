"""Speculative decoding from history (``EngineConfig.speculate``) on the local backend: the rows are
the plain engine's (greedy; sampled bit for bit under ``numerics="invariant"``), drafts taken
from earlier rollouts are accepted, EOS / a stop string / ``max_new_tokens`` cut inside an
accepted draft, and the doors refuse bad settings. Multi-rank: tests/multirank/test_invariant_numerics.py.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from models import batch, tiny_model
from rollout_scenarios import cheap_columns
from test_doors import cli
from transformers import AutoModelForCausalLM, AutoTokenizer

import shardgen
from shardgen import toy
from shardgen.config import EngineConfig, SamplingParams
from shardgen.generation import scheduler as sch
from shardgen.generation import verify
from shardgen.generation.batch import Batch
from shardgen.generation.drafts import (
    ACROSS,
    HISTORY,
    LIVE,
    PIECE_MIN,
    PRIOR,
    PRIORS,
    SHARE_SLOT,
    SHARE_WORDS,
    STALE,
    TRUSTED,
    UNMEASURED_COLUMN_COST,
    DraftStore,
    NgramIndex,
    Pacer,
    last_row_weights,
    share_limit,
)


@pytest.fixture(scope="module")
def toy_pair():
    path = toy.toy_model_path()
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


@pytest.fixture(autouse=True)
def cheap(request):
    """A verify forward's columns priced as before any is measured (nearly free), so that which
    drafts run does not hang on this machine's timings (the rows never do); not in the Pacer's
    own tests."""
    with contextlib.nullcontext() if "pacer" in request.node.name else cheap_columns():
        yield


def _ids(tok, prompts: list[str], n: int) -> list[list[int]]:
    return [tok(p)["input_ids"] for p in prompts for _ in range(n)]


PROMPTS = ["count from 3 to 24 :", "count down from 40 to 22 :", "count from 7 to 9 :"]


def _epochs(model, tok, spec: int, calls: list[dict], **engine) -> tuple[list, dict]:
    """Each call's completions (tokens, logprobs, finish reason) and the engine's stats."""
    out = []
    with shardgen.Engine(model, tok, backend="local", speculate=spec, **engine) as eng:
        for kw in calls:
            ids = kw.pop("ids")
            got = eng.generate(ids, **kw)
            out.append([(c.token_ids, c.logprobs, c.finish_reason) for c in got])
        stats = eng.stats()
    return out, stats


def _same_as_plain(model, tok, calls: list[dict], **engine) -> dict:
    plain, _ = _epochs(model, tok, 0, [dict(c) for c in calls], **engine)
    spec, stats = _epochs(model, tok, 4, [dict(c) for c in calls], **engine)
    for e, (a, b) in enumerate(zip(plain, spec, strict=True)):
        for r, (x, y) in enumerate(zip(a, b, strict=True)):
            assert x == y, f"call {e} row {r}: speculative {y} != plain {x}"
    return stats


def test_greedy_rows_are_the_plain_engines_with_drafts_from_earlier_epochs(toy_pair):
    model, tok = toy_pair
    ids = _ids(tok, PROMPTS, 4)
    calls = [dict(ids=ids, max_new_tokens=32, logprobs=True) for _ in range(3)]
    stats = _same_as_plain(model, tok, calls)
    assert stats["accepted"] > 0 and stats["verify_forwards"] > 0, stats
    assert stats["tokens_per_forward"] > 1.5 and stats["forwards_saved"] > 0, stats


def test_eos_stop_string_and_length_cut_inside_an_accepted_draft(toy_pair, monkeypatch):
    model, tok = toy_pair
    ids = _ids(tok, ["count from 3 to 24 :"], 2)
    calls = [
        dict(ids=ids, max_new_tokens=40),  # the history: the whole answer, then EOS
        dict(ids=ids, max_new_tokens=40),  # EOS inside the draft
        dict(ids=ids, max_new_tokens=13),  # max_new_tokens inside it
        dict(ids=ids, max_new_tokens=40, stop=["15"]),  # a stop string inside it
    ]
    real, cut = verify._accept, set()

    def spy(seqs, logits, drafts):  # which finish reasons fell on an accepted draft token
        was = [s.finished for s in seqs]
        committed, accepted = real(seqs, logits, drafts)
        for s, w, c, a in zip(seqs, was, committed, accepted, strict=True):
            if s.finished and not w and c == a:
                cut.add(s.finish_reason)
        return committed, accepted

    monkeypatch.setattr(verify, "_accept", spy)
    stats = _same_as_plain(model, tok, calls)
    assert cut == {"eos", "stop", "length"}, cut
    spec, _ = _epochs(model, tok, 4, [dict(c) for c in calls])
    assert [r[2] for r in spec[1]] == ["eos", "eos"] and [r[2] for r in spec[2]] == ["length"] * 2
    assert [r[2] for r in spec[3]] == ["stop"] * 2 and tok.decode(spec[3][0][0]).split()[-1] == "15"
    assert stats["accepted"] >= 3 * 2 * 4, stats  # every later call took drafts


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_a_partial_rollouts_budget_falls_inside_an_accepted_draft(toy_pair, sampled):
    """``tokens_per_call=5`` with drafts of up to 4 from an earlier epoch: no call gives a row
    more than its budget (a verify forward stops committing there, and no draft reaches past it,
    as a plain step parks the row there, its generator's draws with it), and the resumed rows
    are the plain engine's."""
    model, tok = toy_pair
    ids = _ids(tok, ["count from 3 to 24 :", "count down from 40 to 22 :"], 2)
    kw = dict(max_new_tokens=40, logprobs=True)
    if sampled:
        kw.update(do_sample=True, temperature=0.7, seed=3)
    with shardgen.Engine(model, tok, backend="local", speculate=0, numerics="invariant") as eng:
        plain = eng.generate(ids, **kw)
    with shardgen.Engine(model, tok, backend="local", speculate=4, numerics="invariant") as eng:
        eng.generate(ids, **kw)  # the history
        before = eng.stats()["accepted"]
        rows, calls = eng.generate(ids, tokens_per_call=5, **kw), 1
        while True:
            for i, c in enumerate(rows):  # a held row drew its whole budget in every call
                want = 5 * calls if c.finish_reason == "held" else len(plain[i].token_ids)
                assert len(c.token_ids) == want, (calls, i, c.finish_reason, len(c.token_ids))
            held = [i for i, c in enumerate(rows) if c.finish_reason == "held"]
            if not held:
                break
            calls += 1
            assert calls <= 9, f"rows still held after {calls} calls"
            for i, c in zip(held, eng.resume([rows[i] for i in held]), strict=True):
                rows[i] = c
        assert eng.stats()["accepted"] - before >= 2 * 4 * 4, eng.stats()  # drafts crossed budgets
    assert calls >= 4, "no row was cut more than twice: the test proves little"
    for i, (a, b) in enumerate(zip(plain, rows, strict=True)):
        assert (a.token_ids, a.logprobs, a.finish_reason) == (b.token_ids, b.logprobs, b.finish_reason), i


def _corrupted(monkeypatch) -> None:
    """Every other draft's last token wrong: the verify forward must reject it."""
    real = DraftStore.draft
    calls = [0]

    def draft(self, seq, limit):
        d = real(self, seq, limit)
        calls[0] += 1
        if d and calls[0] % 2:
            d = [*d[:-1], (d[-1] + 5) % 72]
        return d

    monkeypatch.setattr(DraftStore, "draft", draft)


def test_sampled_rows_are_bit_for_bit_the_plain_engines_under_invariant_numerics(monkeypatch):
    """A random model (every draw matters), rejections included: a verification that accepted
    every draft, or a draw other than the plain step's per-position one (one draw per
    committed token, from the row's generator), would change these rows."""
    model = tiny_model("llama", seed=2)
    _corrupted(monkeypatch)
    ids, mask = batch([9, 6], seed=4)
    prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True) for _ in range(2)]
    kw = dict(ids=prompts, max_new_tokens=12, do_sample=True, temperature=0.8, logprobs=True, eos_token_id=[])
    calls = [dict(kw, seed=3), dict(kw, seed=3), dict(kw, seed=4)]
    stats = _same_as_plain(model, None, calls, numerics="invariant")
    assert 0 < stats["accepted"] < stats["drafted"], stats


def test_accept_all_verification_changes_the_rows(toy_pair, monkeypatch):
    """The control of the test above: with every draft accepted the rows differ."""
    model, tok = toy_pair
    _corrupted(monkeypatch)

    def accept_all(seqs, logits, drafts):
        committed, accepted = [], []
        for s, d in zip(seqs, drafts, strict=True):
            n = 0
            for t in d or [int(logits[0, 0].argmax())]:
                if s.finished:
                    break
                s.append(t, 0.0 if s.params.logprobs else None)
                n += 1
            committed.append(n)
            accepted.append(min(n, len(d)))
        return committed, accepted

    monkeypatch.setattr(verify, "_accept", accept_all)
    ids = _ids(tok, PROMPTS[:1], 2)
    calls = [dict(ids=ids, max_new_tokens=12) for _ in range(2)]
    with pytest.raises(AssertionError, match="speculative"):
        _same_as_plain(model, tok, calls)


def test_refill_and_prefix_cache_take_rows_with_holes(toy_pair, monkeypatch):
    """Rejected drafts leave mask holes in the cache: refills merge such rows, and a finished row's
    KV goes to the prefix cache without its holes (the next turn's prefill takes it)."""
    model, tok = toy_pair
    _corrupted(monkeypatch)
    ids = _ids(tok, PROMPTS, 2)
    first, _ = _epochs(model, tok, 0, [dict(ids=ids, max_new_tokens=30)])
    turns = [
        p + list(r[0]) + tok("count from 1 to 4 :")["input_ids"] for p, r in zip(ids, first[0], strict=True)
    ]
    calls = [
        dict(ids=ids, max_new_tokens=30),
        dict(ids=ids, max_new_tokens=30),
        dict(ids=turns, max_new_tokens=8),
    ]
    stats = _same_as_plain(model, tok, calls, max_batch_size=4)
    assert stats["refills"] > 0 and stats["cached_prompt_tokens"] > 0 and stats["accepted"] > 0, stats


def test_verify_forward_stays_within_max_prefill_tokens(toy_pair, monkeypatch):
    """A verify forward's tokens, and a prefill's that feeds drafts (its columns, and its head's
    positions), stay within the budget; the rows are the plain engine's."""
    model, tok = toy_pair
    real, widths = verify.verify_step, []

    def spy(batch, forward, drafts):
        widths.append(len(batch.seqs) * (1 + max(len(d) for d in drafts)))
        return real(batch, forward, drafts)

    real_prefill, prefills = Batch.prefill_step, []

    def prefill_spy(self, forward):
        def counted(**inputs):
            out = forward(**inputs)
            prefills.append((inputs["input_ids"].numel(), out.logits.shape[0] * out.logits.shape[1]))
            return out

        return real_prefill(self, counted)

    monkeypatch.setattr(sch, "verify_step", spy)
    monkeypatch.setattr(Batch, "prefill_step", prefill_spy)
    ids = _ids(tok, ["count from 3 to 24 :"], 4)
    calls = [dict(ids=ids, max_new_tokens=30) for _ in range(2)]
    stats = _same_as_plain(model, tok, calls, max_prefill_tokens=12)  # 4 rows: drafts of 2 at most
    assert widths and max(widths) <= 12, widths
    assert stats["folded_prefills"] > 0 and max(t for t, _ in prefills) <= 12, (stats, prefills)
    assert max(h for _, h in prefills) <= 12, prefills


def _without_folds(monkeypatch) -> None:
    """Prefills feed no drafts: the first verify forward comes after the prefill."""
    monkeypatch.setattr(sch.LocalWork, "_fold", lambda self, plan, seqs: plan)


def test_a_prefill_feeds_its_prompts_draft_and_saves_a_verify_forward(toy_pair, monkeypatch):
    """From the second epoch on, a prefill's last forward feeds each prompt's draft after it (the
    rows of a shared prompt one draft): it commits each row's first tokens as a verify forward
    would, so the rows are the plain engine's in fewer forwards than with the draft fed by the
    first verify forward after a plain prefill."""
    model, tok = toy_pair
    ids = _ids(tok, PROMPTS, 4)
    first, _ = _epochs(model, tok, 0, [dict(ids=ids, max_new_tokens=32)])
    # A next turn's prompt extends a finished row: it begins from the prefix cache.
    ask = tok("count from 1 to 4 :")["input_ids"]
    turns = [p + list(r[0]) + ask for p, r in zip(ids, first[0], strict=True)]
    calls = [dict(ids=ids, max_new_tokens=32, logprobs=True) for _ in range(2)]
    calls += [dict(ids=turns, max_new_tokens=8) for _ in range(2)]  # (logprobs' last bits move with shapes)
    # Invariant numerics: the logprobs are compared bit for bit across different forward shapes.
    cache = dict(prefix_cache_tokens=4096, numerics="invariant")
    folded = _same_as_plain(model, tok, calls, **cache)
    _without_folds(monkeypatch)
    plain = _same_as_plain(model, tok, calls, **cache)
    assert folded["folded_prefills"] == 2 and plain["folded_prefills"] == 0, (folded, plain)
    assert folded["forwards"] < plain["forwards"], (folded, plain)
    assert folded["cached_prompt_tokens"] > 0, folded
    assert folded["accepted"] > plain["accepted"] - plain["accepted"] // 4, (folded, plain)


def test_a_chunked_prefill_feeds_its_drafts_in_its_last_chunk(toy_pair):
    """Under ``max_prefill_tokens`` a prompt goes in chunks: the last one feeds the drafts, within
    the budget, and the rows are the plain engine's."""
    model, tok = toy_pair
    ids = _ids(tok, PROMPTS, 2)  # 3 prompts of 7-8 tokens, 6 rows: chunks of 4 columns (6 at most)
    calls = [dict(ids=ids, max_new_tokens=24, logprobs=True) for _ in range(2)]
    engine = dict(max_prefill_tokens=18, prefix_cache_tokens=0, numerics="invariant")  # (logprobs: bits)
    stats = _same_as_plain(model, tok, calls, **engine)
    assert stats["prefill_forwards"] > stats["prefills"] and stats["folded_prefills"] == 1, stats


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_eos_stop_string_and_length_cut_inside_a_prefills_draft(toy_pair, sampled):
    """A prompt's earlier answer is shorter than the draft: the prefill's forward commits it whole,
    EOS, a stop string or ``max_new_tokens`` ending each row where one token at a time would,
    and the call runs no decode step."""
    model, tok = toy_pair
    ids = _ids(tok, ["count from 7 to 9 :"], 2)
    kw = dict(do_sample=True, temperature=0.5, seed=1) if sampled else {}
    calls = [dict(max_new_tokens=12), dict(max_new_tokens=12), dict(max_new_tokens=2),
             dict(max_new_tokens=12, stop=["8"])]  # fmt: skip
    plain, _ = _epochs(model, tok, 0, [dict(c, ids=ids, **kw) for c in calls])
    with shardgen.Engine(model, tok, backend="local", speculate=8) as eng:
        eng.generate(ids, **calls[0], **kw)
        for c, want in zip(calls[1:], plain[1:], strict=True):
            before = eng.stats()
            got = eng.generate(ids, **c, **kw)
            after = eng.stats()
            assert [(g.token_ids, g.logprobs, g.finish_reason) for g in got] == want
            assert after["decode_steps"] == before["decode_steps"], (c, after)
            assert after["folded_prefills"] == before["folded_prefills"] + 1, (c, after)
    assert [[r[2] for r in call] for call in plain[1:]] == [["eos"] * 2, ["length"] * 2, ["stop"] * 2]


def test_no_draft_no_verify_forward(toy_pair):
    """Speculation on, nothing seen yet that matches: the same forwards as the plain engine."""
    model, tok = toy_pair
    calls = [dict(ids=_ids(tok, ["count from 30 to 33 :"], 1), max_new_tokens=6)]
    _, stats = _epochs(model, tok, 4, calls)
    assert stats["verify_forwards"] == 0 and stats["tokens_per_forward"] == 1.0, stats


def test_drafts_know_whether_requests_wait_for_a_slot(toy_pair, monkeypatch):
    """The scheduler tells ``DraftStore.drafts`` whether requests wait (throughput) or the batch's
    rows are all its call has (the last row's objective): more prompts than ``max_batch_size``
    wait at first, none once the last are admitted."""
    model, tok = toy_pair
    seen, real = [], DraftStore.drafts

    def spy(self, seqs, limits, waiting=True, computed=None):
        seen.append(waiting)
        return real(self, seqs, limits, waiting, computed)

    monkeypatch.setattr(DraftStore, "drafts", spy)
    prompts = ["count from 3 to 24 :", "count from 5 to 26 :", "count from 7 to 28 :", "count from 9 to 30 :"]
    calls = [dict(ids=_ids(tok, prompts, 1), max_new_tokens=8)]
    _epochs(model, tok, 4, calls, max_batch_size=2, refill=True)
    assert seen[0] is True and seen[-1] is False, seen


def test_pacer_verifies_only_what_pays():
    pacer = Pacer()
    good, bad = [[5, 6, 7, 8]] * 4, [[5, 6, 7, 8]] * 4
    assert pacer.width(good, [0.9] * 4, 4) == 4  # unmeasured: nearly free, every column tried
    for _ in range(TRUSTED):  # each width timed often enough to be priced on its own
        pacer.timed(1, rows=4, seconds=1.0)
        pacer.timed(5, rows=4, seconds=3.0)  # five columns cost three decode steps (weights at hand)
        pacer.timed(2, rows=4, seconds=1.2)
    assert pacer.cost(5) == 3.0 and pacer.width(bad, [0.1] * 4, 4) == 0  # a decode step pays more
    assert pacer.width(good, [0.95] * 4, 4) == 4
    assert pacer.width(good, [0.3] * 4, 4) == 1  # few drafts kept: one column pays, more do not
    assert pacer.width([[], []], [0.9] * 2, 2) == 0  # no draft: a decode step


def test_pacer_prices_a_verify_forward_against_a_decode_step_of_as_many_rows():
    """Per-layer: a forward's seconds are mostly its gathers, whatever its rows. A 9-wide forward
    timed when few rows were left costs about a decode step of as few rows, not the seconds per
    row of a full decode step's (which would price it at 3.5 steps and stop drafting)."""
    pacer = Pacer()
    for _ in range(TRUSTED):
        pacer.timed(1, rows=64, seconds=1.0)
        pacer.timed(1, rows=16, seconds=0.85)  # the fixed part: 0.8 s, then 1/320 s per row
        pacer.timed(9, rows=16, seconds=1.0)
    assert pacer.cost(9) == pytest.approx(1.0 / 0.85)
    assert pacer.width([list(range(8))] * 4, [0.9] * 4, 16) == 8


def test_pacer_prices_a_width_from_its_forwards_of_about_as_many_rows():
    """With the weights at hand a verify forward's own costs weigh little beside a small decode
    step's fixed part and much beside a full one: a width cheap at 4 rows is not cheap at 64."""
    pacer = Pacer()
    for _ in range(TRUSTED):
        pacer.timed(1, rows=64, seconds=4.0)
        pacer.timed(1, rows=4, seconds=2.5)
        pacer.timed(2, rows=4, seconds=2.6)  # about a decode step of 4 rows
        pacer.timed(2, rows=64, seconds=7.0)  # 1.75 decode steps of 64 rows
    assert pacer.cost(2, 4) == pytest.approx(2.6 / 2.5) and pacer.cost(2, 64) == pytest.approx(7.0 / 4.0)
    few = [[5]] * 8 + [[]] * 56  # 8 rows of 64 with a one-token draft
    assert pacer.width(few, [0.9] * 64, 64) == 0  # 7 tokens kept do not pay 0.75 of 64 rows' step
    assert pacer.width(few[:4], [0.9] * 4, 4) == 1


def test_pacer_prices_an_untried_width_from_the_decode_steps_line():
    """Before any width is timed enough, it is priced as a decode step of rows * width rows: with
    the weights at hand (seconds mostly per row) a 9-wide forward of 64 rows is not tried on
    middling drafts; where a forward's seconds are mostly fixed (per-layer gathers) it is."""
    drafts = [list(range(8))] * 64
    compute = Pacer()
    for _ in range(TRUSTED):
        compute.timed(1, rows=64, seconds=4.0)  # 2 s fixed, 1/32 s per row
        compute.timed(1, rows=16, seconds=2.5)
    assert compute.cost(9, 64) == pytest.approx((2.0 + 576 / 32) / 4.0)
    assert compute.width(drafts, [0.4] * 64, 64) == 0
    gathers = Pacer()
    for _ in range(TRUSTED):
        gathers.timed(1, rows=64, seconds=13.0)  # 12 s fixed, 1/64 s per row
        gathers.timed(1, rows=16, seconds=12.25)
    assert gathers.width(drafts, [0.4] * 64, 64) == 2  # a column costs 1/13 of a step


def test_pacer_prices_a_prefills_drafts_by_its_computed_rows():
    """A prefill's drafts add columns to its computed rows only (one per distinct prompt): priced as
    a verify forward of those rows beyond their decode step, scaled to a decode step of every row
    by the decode line: where a step's seconds go per row (compute), 16 computed rows of 64 pay a
    quarter; where they are mostly a fixed part (gathers), nearly all."""
    compute = Pacer()
    for _ in range(4):
        compute.timed(1, 64, 0.010)  # one row count seen: the line runs through the origin below it
        compute.timed(9, 16, 0.008)
    verify = compute.cost(9, 16)
    assert verify == pytest.approx(0.008 / (0.010 * 16 / 64))
    assert compute.fold_cost(9, 16, 64) == pytest.approx(1.0 + (verify - 1.0) * 0.25)
    assert compute.fold_cost(1, 16, 64) == 1.0
    gathers = Pacer()
    for _ in range(4):
        gathers.timed(1, 64, 0.010)
        gathers.timed(1, 16, 0.009)
        gathers.timed(9, 16, 0.012)
    verify = gathers.cost(9, 16)
    assert gathers.fold_cost(9, 16, 64) == pytest.approx(1.0 + (verify - 1.0) * 0.9)


def test_pacer_prices_untried_widths_from_every_verify_forward_timed():
    """A fresh engine's first call widens its forwards a column at a time (its rows' drafts grow
    as its groups decode): once two verify forwards are timed, whatever their widths, an untried
    width is priced at their least cost per extra column, not at the guess made before any."""
    pacer = Pacer()
    for _ in range(TRUSTED):
        pacer.timed(1, rows=64, seconds=1.0)  # one row count: no decode line to price from
    pacer.timed(2, rows=64, seconds=1.5)
    assert pacer.cost(9, 64) == pytest.approx(1.0 + UNMEASURED_COLUMN_COST * 8)  # one forward: a guess
    pacer.timed(3, rows=64, seconds=1.8)  # 0.4 a column (width 2's: 0.5)
    assert pacer.cost(9, 64) == pytest.approx(1.0 + 0.4 * 8)
    assert pacer.cost(5, 64) == pytest.approx(1.0 + 0.4 * 4)
    drafts = [list(range(8))] * 16 + [[]] * 48  # a quarter of the rows draft
    assert pacer.width(drafts, [0.7] * 64, 64) == 0  # at 0.4 a column, no width pays
    pacer.timed(2, rows=64, seconds=1.5)
    assert pacer.cost(2, 64) == pytest.approx(1.5)  # a width timed TRUSTED times: its own price


def test_pacer_prices_no_width_above_a_wider_one_nor_below_a_decode_step():
    """A narrower forward does less than a wider one: a width whose forwards all ran under load
    is priced at the wider width's cost, not its own, so it is tried again; a width timed below a
    decode step (a decode line read high) costs one."""
    pacer = Pacer()
    for _ in range(TRUSTED):
        pacer.timed(1, rows=8, seconds=1.0)
        pacer.timed(5, rows=8, seconds=4.0)  # slowed by load
        pacer.timed(9, rows=8, seconds=1.5)
        pacer.timed(3, rows=8, seconds=0.5)
    assert pacer.cost(9, 8) == pytest.approx(1.5)
    assert pacer.cost(5, 8) == pytest.approx(1.5)  # its own samples: 4.0
    assert pacer.cost(7, 8) <= 1.5  # untried, below a width timed
    assert pacer.cost(3, 8) == pytest.approx(1.0)
    assert pacer.width([list(range(4))] * 8, [0.9] * 8, 8) == 4  # width 5 pays at 1.5; at 4.0, width 3


def test_pacer_never_prices_a_verify_forward_cheap_past_the_decode_steps_seen():
    """A decode step of one row (the end of a call) is mostly its fixed part: scaled up as seconds
    per row, 16 rows would cost 16 of it and a 9-wide forward of 16 rows look cheap; below the
    counts seen, a step shrinks with its rows. And the decode step stays the measure while verify
    forwards run (where they pay, it is seldom run): not the guess made before any was timed."""
    pacer = Pacer()
    for _ in range(TRUSTED):
        pacer.timed(1, rows=1, seconds=2.4)
        pacer.timed(9, rows=16, seconds=11.0)
    assert pacer.cost(9, 16) == pytest.approx(11.0 / 2.4)
    assert pacer.width([list(range(8))] * 16, [0.4] * 16, 16) == 0
    for _ in range(2 * STALE):  # no decode step for longer than a width's samples last
        pacer.timed(9, rows=16, seconds=11.0)
    assert pacer.cost(9, 16) == pytest.approx(11.0 / 2.4)
    many = Pacer()
    for _ in range(TRUSTED):
        many.timed(1, rows=64, seconds=4.0)
        many.timed(9, rows=8, seconds=2.0)
    assert many.cost(9, 8) == pytest.approx(2.0 / (4.0 * 8 / 64))  # 4, not 0.5


def test_pacer_one_slow_forward_under_load_does_not_price_a_width_out():
    """A width's cost is the least of its latest forwards, trusted once timed a few times; a width
    priced out is tried again once its samples age out."""
    good = [list(range(8))] * 4
    pacer = Pacer()
    for _ in range(TRUSTED):
        pacer.timed(1, rows=4, seconds=1.0)
    pacer.timed(9, rows=4, seconds=20.0)  # the first 9-wide forward, slowed by load
    assert pacer.width(good, [0.9] * 4, 4) == 8  # still tried
    for _ in range(TRUSTED):
        pacer.timed(9, rows=4, seconds=1.2)
    pacer.timed(9, rows=4, seconds=30.0)  # another slow one among them
    assert pacer.cost(9) == pytest.approx(1.2) and pacer.width(good, [0.9] * 4, 4) == 8
    dear = Pacer()
    for _ in range(TRUSTED):
        dear.timed(1, rows=4, seconds=1.0)
        dear.timed(9, rows=4, seconds=20.0)  # truly dear: a decode step pays more
    assert dear.width(good, [0.9] * 4, 4) == 0
    for _ in range(STALE):
        dear.timed(1, rows=4, seconds=1.0)
    assert dear.width(good, [0.9] * 4, 4) == 8  # aged out: tried again


def test_ngram_index_and_history_budget():
    index = NgramIndex()
    index.add([1, 2, 3, 4, 5])
    assert index.lookup([9, 2, 3], 2) == [4, 5]
    assert index.lookup([4, 5], 3) == []  # nothing follows
    store = DraftStore(budget=6)
    Row = _Row
    a = Row([1, 2], [3, 4, 5, 6])
    store.row(a)
    store.finish(a)
    b = Row([1, 2], [])
    assert store.draft(b, 4) == [3, 4, 5, 6]  # the earlier rollout of its prompt
    c = Row([7, 8], [9, 9, 9])
    store.row(c)
    store.finish(b)
    store.finish(c)  # over the budget: the least recently used prompt out
    assert list(store.entries) == [(7, 8)] and store.evictions == 1


@dataclasses.dataclass
class _Row:
    prompt_ids: list[int]
    tokens: list[int]
    draft: object = None
    finished: bool = False
    finish_reason: str | None = "eos"
    params: object = dataclasses.field(default_factory=lambda: SamplingParams(max_new_tokens=16))
    holding: object = None
    admitted_at: int = 0


def test_a_row_ended_before_its_prefill_releases_its_prompts_index():
    """A prefill's plan drafts its rows before they are taken: a held row that then ends while
    waiting (closed, gone stale) leaves its prompt's index evictable again."""
    store = DraftStore(budget=8)
    row = _Row([5, 6, 7, 8], [])
    store.draft(row, 4)
    entry = store.entries[(5, 6, 7, 8)]
    assert entry.live == 1 and row.draft is not None
    store.release(row)
    store.release(row)  # once only
    assert entry.live == 0 and row.draft is None


def test_a_new_row_starts_from_the_acceptance_of_its_drafts_source():
    """Acceptance is kept per source of drafts: a new row of a prompt whose earlier rollouts'
    drafts were taken starts at that rate for its draft from them (the Pacer then widens its first
    verify forward), however its prompt's text drafted; a new prompt's row starts from every
    prompt's rate per source where that is above the prior (a source other prompts drafted badly
    from is still tried on a new one); a fresh store's at the prior."""
    store = DraftStore(budget=1000)
    answer = list(range(10, 19))
    _finished(store, [1, 2, 3], answer)  # an earlier rollout of the prompt
    first = _Row([1, 2, 3], [])
    assert store.draft(first, 8) == answer[:8] and store.row(first).source == HISTORY
    for _ in range(4):
        store.observe(first, 8, 8)
    text = _Row([1, 2, 3], [])
    store.row(text).source = LIVE  # a draft from the prompt's text or its live rows, never taken
    for _ in range(4):
        store.observe(text, 8, 0)
    again = _Row([1, 2, 3], [])
    assert store.draft(again, 8) == answer[:8] and store.row(again).rate > 0.9
    store.row(again).source = LIVE
    assert store.row(again).rate < 0.2
    other = store.row(_Row([4, 5, 6], [20]))  # a new prompt: every prompt's rates, the prior at least
    for source, low, high in ((HISTORY, 0.9, 1.0), (LIVE, PRIOR, PRIOR), (ACROSS, PRIOR, PRIOR)):
        other.source = source
        assert low <= other.rate <= high, (source, other.rate)
    fresh = DraftStore(budget=1000)
    assert fresh.row(_Row([1, 2, 3], [])).rate == PRIOR
    _finished(fresh, [1, 2, 3], answer)
    late = _Row([1, 2, 3], [])
    assert fresh.draft(late, 8) == answer[:8] and fresh.row(late).rate == PRIORS[HISTORY] > PRIOR
    drafts = [list(range(8))] * 4
    assert Pacer().width(drafts, [store.row(again).rate] * 4, 4) < 8  # its LIVE rate
    store.row(again).source = HISTORY
    assert Pacer().width(drafts, [store.row(again).rate] * 4, 4) == 8  # a fresh row would take less
    assert Pacer().width(drafts, [PRIOR] * 4, 4) < 8


def _finished(store: DraftStore, prompt: list[int], tokens: list[int], reason: str = "eos") -> None:
    row = _Row(prompt, [], finish_reason=reason)
    store.row(row)
    row.tokens.extend(tokens)
    store.finish(row)


def test_a_calls_last_row_weighs_alone_where_rows_run_to_their_limit():
    """Rows that all run to their limit: the one with the most forwards left (tokens left, fewer
    where its drafts are taken) ends the call and weighs alone; rows that end at EOS weigh alike;
    finished rows nothing; between, the chance spreads from the slowest row down."""
    left, rates = [10, 10, 4, 0], [0.9, 0.2, 0.2, 0.9]
    assert last_row_weights(left, rates, [1.0] * 4) == [0.0, 1.0, 0.0, 0.0]
    # forwards left alike: a row with no draft now (it gains nothing this forward) goes first
    assert last_row_weights([5, 5], [0.5, 0.5], [1.0] * 2, drafted=[True, False]) == [0.0, 1.0]
    assert last_row_weights(left, rates, [0.0] * 4) == pytest.approx([1 / 3, 1 / 3, 1 / 3, 0.0])
    half = last_row_weights(left, rates, [0.5] * 4)
    assert sum(half) == pytest.approx(1.0) and half[1] > half[2] > half[0] > 0.0 == half[3]


def test_pacer_widens_a_call_of_fixed_rows_only_where_its_last_row_gains():
    """Three rows draft well, the fourth has no draft and runs to its limit: the tokens the three
    gain pay a wider forward where requests wait for their slots (throughput), not where the rows
    are all the call has (it ends with the fourth, which the wider forward only slows)."""
    pacer = Pacer()
    for _ in range(TRUSTED):
        pacer.timed(1, rows=4, seconds=1.0)
        pacer.timed(5, rows=4, seconds=1.5)
    drafts, rates = [[5, 6, 7, 8]] * 3 + [[]], [0.9, 0.9, 0.9, 0.1]
    assert pacer.width(drafts, rates, 4) == 4
    assert pacer.width(drafts, rates, 4, last_row_weights([8] * 4, rates, [1.0] * 4)) == 0
    assert pacer.width(drafts, rates, 4, last_row_weights([8] * 4, rates, [0.0] * 4)) == 4
    assert pacer.width([[5, 6, 7, 8]] * 4, [0.9] * 4, 4, last_row_weights([8] * 4, [0.9] * 4, [1.0] * 4)) == 4


def test_drafts_weigh_the_last_row_once_rows_run_to_their_limit():
    """``DraftStore`` learns from finished rows how often they run to their limit (each prompt's
    and every prompt's), and weighs a call's last row by it when no request waits."""
    store = DraftStore(budget=1000)
    for i in range(4):
        _finished(store, [1, 2, 3], [10 + i, 11, 12, 13, 14], reason="length")
    assert store.limited == 1.0 and store.entries[(1, 2, 3)].limited == 1.0
    rows = [_Row([1, 2, 3], [10, 11]) for _ in range(3)] + [_Row([7, 7, 7], [40, 41])]
    assert store.drafts(rows, [3] * 4, waiting=True) is not None  # three rows draft: it pays
    assert store.drafts(rows, [3] * 4, waiting=False) is None  # the fourth, slowest, has none
    _finished(store, [4, 5, 6], [20, 21], reason="eos")
    assert 0.0 < store.limited < 1.0 and store.entries[(4, 5, 6)].limited == 0.0


def test_a_draft_that_reaches_where_its_prompts_answer_ended_is_not_run_on():
    """A draft from an earlier answer of the row's prompt that reaches its end stops there (its
    EOS is the likeliest end), not run on from another prompt's longer text; and another prompt's
    text drafted for a row whose prompt has answers counts in that prompt's rate only, not in
    every prompt's, where a new prompt's rows start."""
    store = DraftStore(budget=1000)
    _finished(store, [1, 2, 3], [10, 11, 12, 13, 2])  # 2: its EOS
    _finished(store, [4, 5, 6], [9, 10, 11, 12, 13, 14, 15, 16])
    row = _Row([1, 2, 3], [10, 11, 12, 13])
    assert store.draft(row, 8) == [2] and store.row(row).source == HISTORY
    row.tokens.append(2)
    store.row(row).source = ACROSS  # as if it had drafted another prompt's text
    store.observe(row, 4, 0)
    assert store.entries[(1, 2, 3)].rates[ACROSS] == 0.0 and store.rates[ACROSS] is None
    fresh = _Row([7, 8, 9], [10, 11])  # no answer of its own: other prompts' text, counted for all
    assert store.draft(fresh, 8) == [12, 13, 14, 15, 16] and store.row(fresh).source == ACROSS
    store.observe(fresh, 5, 5)
    assert store.rates[ACROSS] == 1.0


def test_a_rollout_shared_by_another_rank_drafts_its_prompt_here():
    """Rank A's finished rollout, carried as ``outgoing`` ints, drafts the same prompt's rows on
    rank B: one kept by its digest until a row of it starts on B, one straight into the index of
    a prompt B decodes now; and into B's index across prompts."""
    a, b = DraftStore(budget=1000), DraftStore(budget=1000)
    a.share = True
    _finished(a, [1, 2, 3], [10, 11, 12, 13, 14])
    live = _Row([4, 5, 6], [20])
    b.row(live)  # B decodes the second prompt now
    _finished(a, [4, 5, 6], [20, 21, 22, 23])
    words = a.outgoing()
    assert a.outgoing() == [] and len(words) == 2 * 4 + (3 + 5) + (3 + 4)
    assert list(b.entries) == [(4, 5, 6)]
    b.incoming(words)
    assert b.received == 2 and b.foreign  # the first prompt: by its digest, no row of it here yet
    assert b.draft(_Row([1, 2, 3], [10]), 4) == [11, 12, 13, 14]
    assert not b.foreign and b.kept == 7 + 8  # taken into the prompt's index when its row started
    assert b.draft(live, 3) == [21, 22, 23]
    assert b.draft(_Row([9, 9, 11], [12]), 2) == [13, 14]  # across prompts


def test_shared_rollouts_go_in_pieces_within_the_tick_limit_and_the_budget():
    """A rank shares at most its limit a tick (``share_limit``: a slot, the world's total over the ranks):
    rollouts in pieces, in order, put back together on each receiver per sender; other ranks'
    rollouts of prompts not seen there stay within the budget, the oldest out first."""
    assert (
        share_limit(2) == SHARE_SLOT
        and share_limit(64) == SHARE_WORDS // 64
        and share_limit(10_000) == PIECE_MIN
    )
    a = DraftStore(budget=1000)
    a.share = True
    for p in range(3):
        _finished(a, [p, p, p], list(range(100, 120)))  # 3 + 20 tokens
    ticks = []
    while piece := a.outgoing(20):
        assert len(piece) <= 20
        ticks.append(piece)
    assert len(ticks) == 5 and not a.outbox  # 69 tokens, a head per piece, 20 words a tick
    b = DraftStore(budget=1000)
    b.incoming([5, 23, 0, 4, 9, 9, 9, 9], sender=2)  # another sender's first piece of 23 tokens
    for words in ticks:
        b.incoming(words, sender=1)
    assert b.received == 3
    assert sorted(seq for seqs in b.foreign.values() for seq in seqs) == [
        [p, p, p, *range(100, 120)] for p in range(3)
    ]
    assert 2 in b._pieces and 5 not in b.foreign  # a sender's unfinished rollout waits for its pieces
    small = DraftStore(budget=30)
    for p in range(3):  # other ranks' rollouts of prompts not seen here: the oldest out first
        small.incoming([p, 23, 0, 23, *range(23)], sender=1)
    assert list(small.foreign) == [2] and small._foreign_tokens == 23
    quiet = DraftStore(budget=1000)  # share off (one rank): nothing waits to be sent
    _finished(quiet, [1, 2, 3], [4, 5, 6])
    assert not quiet.outbox and quiet.outgoing() == []


@pytest.mark.parametrize(
    ("field", "value", "said"),
    [("speculate", -1, "speculate must be an integer in 0..16, got -1"),
     ("speculate", 17, "speculate must be an integer in 0..16, got 17"),
     ("speculate_history_tokens", -5, "speculate_history_tokens must be an integer >= 0, got -5")],
)  # fmt: skip
def test_bad_settings_are_refused_with_the_numbers(field, value, said):
    """The API and ``shardgen run``'s flags (tests/unit/test_doors.py checks every door agrees)."""
    with pytest.raises(ValueError, match=said):
        EngineConfig(**{field: value}).validate()
    with pytest.raises(ValueError, match=said):
        shardgen.Engine(object(), backend="local", **{field: value})
    flag = "--" + field.replace("_", "-")
    said = cli([(flag, value)])
    assert said is not None and f"{flag} must be" in said and str(value) in said, said


def test_speculate_share_is_a_switch_at_every_door():
    """On by default; a bool at the API (the rule of every door), ``--no-speculate-share`` on
    ``shardgen run``."""
    from shardgen.cli.command import make_parser
    from shardgen.cli.run import RUN_FIELDS
    from shardgen.flags import build

    said = "speculate_share must be true or false, got 1"
    with pytest.raises(ValueError, match=said):
        EngineConfig(speculate_share=1).validate()
    with pytest.raises(ValueError, match=said):
        shardgen.Engine(object(), backend="local", speculate_share=1)
    names = dict(RUN_FIELDS)[EngineConfig]
    for extra, want in (([], True), (["--no-speculate-share"], False), (["--speculate-share"], True)):
        ns = make_parser().parse_args(["run", "--prompts", "p.jsonl", "--out", "o.jsonl", *extra])
        assert build(EngineConfig, ns, names).speculate_share is want, extra


def test_speculation_is_on_by_default_only_where_it_changes_no_bit(toy_pair):
    """Unset, ``speculate`` is ``DEFAULT_SPECULATE`` under ``numerics="invariant"`` (the rows are
    the plain engine's bit for bit: here sampled, logprobs compared exactly) and 0 on the fast
    path (a verify forward's logits may differ there in the last bits); set, it is what it says.
    ``shardgen run`` leaves it unset unless ``--speculate`` is given."""
    from shardgen.cli.command import make_parser
    from shardgen.cli.run import RUN_FIELDS
    from shardgen.config import DEFAULT_SPECULATE, resolved_speculate
    from shardgen.flags import build

    assert resolved_speculate(EngineConfig()).speculate == 0
    assert resolved_speculate(EngineConfig(numerics="invariant")).speculate == DEFAULT_SPECULATE
    assert resolved_speculate(EngineConfig(numerics="invariant", speculate=0)).speculate == 0
    assert resolved_speculate(EngineConfig(speculate=3)).speculate == 3
    model, tok = toy_pair
    ids = _ids(tok, PROMPTS, 3)
    kw = dict(max_new_tokens=32, do_sample=True, temperature=1.0, logprobs=True)
    rows, stats, chosen = {}, {}, {}
    for name, engine in (("default", {}), ("off", dict(speculate=0))):
        with shardgen.Engine(model, tok, backend="local", numerics="invariant", **engine) as eng:
            rows[name] = [
                [(c.token_ids, c.logprobs) for c in eng.generate(ids, seed=s, **kw)] for s in (1, 1, 2)
            ]
            stats[name], chosen[name] = eng.stats(), eng.config.speculate
    assert chosen == {"default": DEFAULT_SPECULATE, "off": 0}
    assert stats["default"]["accepted"] > 0 and stats["off"]["drafted"] == 0, stats
    assert rows["default"] == rows["off"]
    with shardgen.Engine(model, tok, backend="local") as eng:  # the fast path
        for _ in range(2):
            eng.generate(ids, seed=1, **kw)
        assert eng.config.speculate == 0 and eng.stats()["drafted"] == 0, eng.stats()
    names = dict(RUN_FIELDS)[EngineConfig]
    for extra, want in (([], None), (["--speculate", "0"], 0), (["--speculate", "5"], 5)):
        ns = make_parser().parse_args(["run", "--prompts", "p.jsonl", "--out", "o.jsonl", *extra])
        assert build(EngineConfig, ns, names).speculate == want, extra


def test_speculate_share_is_agreed_only_where_the_tick_carries_the_payload():
    """Ranks must agree on whether the tick carries shared rollouts, which is speculation on,
    sharing on and a history to keep them in: ranks that do not speculate may differ in
    ``speculate_share`` (the tick's size does not), ranks that do may not; a history of 0 tokens
    shares nothing, so its tick carries no payload (it did, empty, every tick)."""
    key = "speculate_share and speculate_history_tokens > 0"
    off = [EngineConfig(speculate=0, speculate_share=s).agreed() for s in (True, False)]
    on = [EngineConfig(speculate=4, speculate_share=s).agreed() for s in (True, False)]
    assert off[0] == off[1] and on[0] != on[1]
    assert {k for k in on[0] if on[0][k] != on[1][k]} == {key}
    none = EngineConfig(speculate=4, speculate_history_tokens=0)
    assert not none.shares_rollouts and none.agreed()[key] == on[1][key] != on[0][key]


def test_verify_step_refuses_no_draft():
    with pytest.raises(AssertionError, match="no draft"):
        verify.verify_step(type("B", (), {"seqs": [None], "device": torch.device("cpu")})(), None, ((),))


def test_encoder_decoder_and_sliding_window_rows_decode_plainly(monkeypatch):
    """Kinds a verify forward cannot serve (an encoder-decoder's rows; a sliding window's cache,
    which cannot hold holes) decode plainly with ``speculate`` on, though every row has a draft:
    the same rows, no verify forward (a plain Llama, the control, verifies)."""
    from encdec_models import tiny_t5

    monkeypatch.setattr(DraftStore, "draft", lambda self, seq, limit: (self.row(seq), [5, 6][:limit])[1])
    ids, _ = batch([7, 7], seed=3, vocab=40)
    prompts = [row.tolist() for row in ids]
    for model, verifies in ((tiny_t5(), False), (tiny_model("mistral", seed=1), False), (tiny_model(), True)):
        got = {}
        for spec in (0, 4):
            with shardgen.Engine(model, backend="local", speculate=spec) as eng:
                got[spec] = [c.token_ids for c in eng.generate(prompts, max_new_tokens=8, eos_token_id=[])]
                stats = eng.stats()
                assert (stats["verify_forwards"] > 0) == (verifies and spec > 0), type(model).__name__
                assert (stats["folded_prefills"] > 0) == (verifies and spec > 0), type(model).__name__
        assert got[0] == got[4]


def test_a_vlms_text_rows_feed_drafts_in_their_prefill_and_its_image_rows_after_it(monkeypatch):
    """A LLaVA (plain cache, plain positions): a prefill of text rows feeds their drafts; a prefill
    with image rows feeds none (where a draft's columns would sit beside the image's features is
    not planned) and its rows verify drafts from their first decode step; every row the plain
    engine's."""
    from vlm import EOS, PAD, llava_images, llava_prompt, tiny_llava

    monkeypatch.setattr(DraftStore, "draft", lambda self, seq, limit: (self.row(seq), [5, 6][:limit])[1])
    model = tiny_llava(4)
    text = [[9, 10, 11], [4, 4, 7]]
    xs = [llava_images(1, 1), llava_images(2, 3)]
    pictured = [llava_prompt([5, 6], xs[0]), llava_prompt([5], xs[1])]
    kw = dict(max_new_tokens=8, eos_token_id=EOS, pad_token_id=PAD)
    got, deltas = {}, {}
    for spec in (0, 4):
        with shardgen.Engine(model, backend="local", speculate=spec) as eng:
            a = [c.token_ids for c in eng.generate(text, **kw)]
            before = eng.stats()
            b = [c.token_ids for c in eng.generate(pictured, inputs=xs, **kw)]
            after = eng.stats()
            got[spec] = (a, b)
            deltas[spec] = {k: after[k] - before[k] for k in ("folded_prefills", "verify_forwards")}
            if spec:
                assert before["folded_prefills"] == 1, before
    assert got[0] == got[4]
    assert deltas[4]["folded_prefills"] == 0 and deltas[4]["verify_forwards"] > 0, deltas
