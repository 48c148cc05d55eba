"""Tier 1: the small-row rounding switch (tests/helpers/rounding.py) and the numeric-promise helper
(tests/helpers/numerics.py) that the shape-comparing tests assert with."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import rounding
import torch
import torch.nn.functional as F
from models import tiny_model
from numerics import NEAR_TIE, Row, assert_rows_agree
from world import World

from shardgen.config import SamplingParams
from shardgen.generation.sampling import draw_tokens, draw_uniforms, make_generator, warp_scores


@pytest.fixture
def small_rows():
    """The switch on for this test, as it was after it."""
    was = rounding.installed()
    rounding.install()
    yield
    if not was:
        rounding.uninstall()


def test_the_switch_changes_linears_of_at_most_3_rows_only(small_rows):
    torch.manual_seed(0)
    w, bias, x = torch.randn(64, 96), torch.randn(64), torch.randn(16, 96)
    linear, addmm = rounding._original["linear"], rounding._original["addmm"]
    full = linear(x, w, bias)
    for m in (1, 2, 3):  # flattened leading dims count: [1, m, 96] has m rows
        small = (F.linear(x[:m], w, bias), F.linear(x[None, :m], w, bias)[0], torch.addmm(bias, x[:m], w.T))
        own = (linear(x[:m], w, bias), linear(x[None, :m], w, bias)[0], addmm(bias, x[:m], w.T))
        for got, theirs in zip(small, own, strict=True):
            assert not torch.equal(got, full[:m]), f"{m} rows: the same bits as the 4+-row kernel"
            assert not torch.equal(got, theirs), (
                f"{m} rows: torch's own kernel (some CPUs switch at 3 rows too)"
            )
            assert torch.allclose(got, full[:m], atol=1e-4) and got.dtype == full.dtype
    for m in (4, 5, 16):
        assert torch.equal(F.linear(x[:m], w, bias), linear(x[:m], w, bias)), f"{m} rows changed"
        assert torch.equal(torch.addmm(bias, x[:m], w.T), addmm(bias, x[:m], w.T)), f"{m} rows changed"
    grad = torch.randn(3, 96, requires_grad=True)
    F.linear(grad, w, bias).sum().backward()  # still differentiable (training tests run under it)
    assert grad.grad is not None


def test_shardgen_computes_its_row_block_products_through_f_linear():
    """The stationary exchange and the chunked head multiply row blocks with ``F.linear`` looked
    up at call time, so the switch (which replaces ``torch.nn.functional.linear``) reaches them."""
    from shardgen.backends import chunked
    from shardgen.backends.stationary import runner as mode

    assert mode.F is torch.nn.functional and chunked.F is torch.nn.functional


def _installed() -> bool:
    return rounding.installed()


def test_the_switch_reaches_rank_processes_and_launched_ones():
    for value, expected in (("1", True), ("0", False)):
        world = World(1, env={rounding.ENV: value})
        try:
            assert world.run(_installed, timeout=60) == [expected], f"{rounding.ENV}={value}"
        finally:
            world.close()
    env = dict(os.environ, **{rounding.ENV: "1"})
    env["PYTHONPATH"] = os.pathsep.join([rounding.SITE_DIR, env.get("PYTHONPATH", "")])
    code = "import torch.nn.functional as F; print(getattr(F.linear, '_small_rows', False))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "True", out.stderr


# ------------------------------------------------------------------------------- the helper
def _row(tokens, logprobs, seed=None, prompt=(5, 6, 7)):
    return Row(list(prompt), list(tokens), None if logprobs is None else list(logprobs), seed)


def test_equal_rows_and_logprobs_within_the_tolerance_agree():
    a = [_row([3, 4, 5], [-1.0, -2.0, -0.5])]
    b = [_row([3, 4, 5], [-1.0 + 4e-6, -2.0, -0.5 - 2e-6])]
    found = assert_rows_agree(a, b)
    assert found.diverged == [] and found.max_logprob_diff == pytest.approx(4e-6, rel=1e-3)
    with pytest.raises(AssertionError, match="logprobs"):
        assert_rows_agree(a, [_row([3, 4, 5], [-1.0, -2.0 + 1e-3, -0.5])])
    with pytest.raises(AssertionError, match="stopped after 2"):
        assert_rows_agree(a, [_row([3, 4], [-1.0, -2.0])])
    with pytest.raises(AssertionError, match="prompts differ"):
        assert_rows_agree(a, [_row([3, 4, 5], [-1.0, -2.0, -0.5], prompt=(5, 6))])


def test_a_greedy_difference_must_be_a_near_tie():
    a = [_row([3, 4, 5], [-1.0, -0.6931, -0.5])]
    tie = [_row([3, 9, 1, 1], [-1.0, -0.6931 - 3e-7, -3.0, -3.0])]  # after the step nothing is compared
    assert assert_rows_agree(a, tie).diverged == [(0, 1, pytest.approx(3e-7, rel=0.1))]
    with pytest.raises(AssertionError, match="no near-tie"):
        assert_rows_agree(a, [_row([3, 9, 5], [-1.0, -1.5, -0.5])])


def _step0(seed_range, want_tie: bool):
    """A seed whose first draw on the test model's logits sits within 1e-6 of a CDF boundary (or
    further than 1e-3 from every one) -> (model, prompt, params, seed, lo, hi, drawn)."""
    model = tiny_model("llama", seed=7)
    prompt = [5, 17, 33, 8, 60]
    params = SamplingParams(do_sample=True, temperature=0.9).resolved(model.generation_config)
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt])).logits[0, -1].float()
    cdf = torch.cumsum(torch.softmax(warp_scores(logits[None], [params])[0].double(), -1), -1)
    for seed in seed_range:
        u = float(draw_uniforms([make_generator(seed)])[0])
        x = u * float(cdf[-1])
        j = int(torch.searchsorted(cdf, torch.tensor([x], dtype=torch.float64), right=True))  # drawn
        near = min(float(cdf[j]) - x, x - float(cdf[j - 1]) if j else 1.0)
        if (near < 1e-6) == want_tie and (want_tie or near > 1e-3):
            drawn = int(draw_tokens(warp_scores(logits[None], [params]), torch.tensor([u]))[0])
            lo = j if float(cdf[j]) - x < 1e-6 else j - 1  # the boundary x is near: between lo and lo + 1
            return model, prompt, params, seed, lo, lo + 1, drawn
    raise AssertionError("no such seed in range")


def test_a_sampled_difference_on_a_near_tie_passes():
    model, prompt, params, seed, lo, hi, drawn = _step0(range(20000), want_tie=True)
    assert drawn in (lo, hi)  # the helper's boundary is the sampler's
    a, b = [_row([lo, 2], [-4.0, -4.0], seed, prompt)], [_row([hi], [-4.5], seed, prompt)]
    found = assert_rows_agree(a, b, model=model, params=params)
    assert found.diverged[0][:2] == (0, 0) and found.diverged[0][2] < 1e-6 < NEAR_TIE


def test_a_sampled_difference_that_is_no_near_tie_fails():
    model, prompt, params, seed, lo, hi, drawn = _step0(range(200), want_tie=False)
    other = drawn + 1 if drawn + 1 < model.config.vocab_size else drawn - 1
    a, b = [_row([drawn], [-4.0], seed, prompt)], [_row([other], [-4.0], seed, prompt)]
    with pytest.raises(AssertionError, match="no near-tie"):
        assert_rows_agree(a, b, model=model, params=params)
    with pytest.raises(AssertionError, match="pass model="):
        assert_rows_agree(a, b)
    with pytest.raises(AssertionError, match="no near-tie"):  # the right token under another seed
        assert_rows_agree(
            [_row([drawn], [-4.0], seed + 1, prompt)], [_row([other], [-4.0], seed + 1, prompt)],
            model=model, params=params,
        )  # fmt: skip


def test_job_results_agree_under_the_promise_and_a_changed_answer_fails():
    """``cli_jobs.assert_results_agree`` (the resumed and relaunched jobs of test_cli*.py):
    rows that agree keep every field; a token that is not a near-tie fails."""
    from cli_jobs import assert_results_agree
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardgen import toy

    tok = AutoTokenizer.from_pretrained(toy.toy_model_path())
    model = AutoModelForCausalLM.from_pretrained(toy.toy_model_path()).eval()
    prompt = "count from 3 to 9 :"
    ids = torch.tensor([tok(prompt)["input_ids"]])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=6)
    tokens = out[0, ids.shape[1] :].tolist()
    ref = [
        {"id": "a", "prompt": prompt, "token_ids": tokens, "text": "x", "rank": 0},
        {"id": "b", "error": "E"},
    ]
    assert_results_agree([dict(ref[0], rank=1), ref[1]], ref)
    with pytest.raises(AssertionError):
        assert_results_agree([dict(ref[0], text="y"), ref[1]], ref)  # the same tokens, another field
    changed = tokens[:2] + [(tokens[2] + 1) % model.config.vocab_size] + tokens[3:]
    with pytest.raises(AssertionError, match="no near-tie"):
        assert_results_agree([dict(ref[0], token_ids=changed), ref[1]], ref)
