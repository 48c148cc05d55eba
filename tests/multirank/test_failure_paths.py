"""A driver failure resolves every waiting future with the error, whatever point a request is
at (queued, admitted, prefilling, scoring, decoding, finishing, a multi-turn row's next turn, a
rollout_iter group after another was yielded): generate, submit().result(), rollout,
rollout_iter and score raise instead of hanging. One process on the local backend, then 2 gloo
ranks (backend local). Every call is waited for under a bound (failure_scenarios.BOUND), so a
regression fails and never hangs.

A tokenizer that is only its two ids (no ``decode``, as DeepSpeed's rollout tests pass) does not
fail the driver: a completion's text is None.
"""

from __future__ import annotations

import failure_scenarios as fs
import pytest
from models import tiny_model

import shardgen
from shardgen.faults import blame
from shardgen.generation import batch
from shardgen.generation.requests import build_requests


def _assert_every_call_raised(out: dict, point: str, error: str, rank: int = 0) -> None:
    _, _, calls, _ = fs.POINTS[point]
    for call in calls:
        assert out[call].startswith(f"raised {error}"), f"rank {rank}, failure at {point}: {call} {out[call]}"


@pytest.mark.parametrize("point", list(fs.POINTS))
def test_every_waiting_call_raises_whatever_point_the_driver_fails_at(point):
    out = fs.fail_at(point)
    _assert_every_call_raised(out, point, "Injected")
    if point == "later group":
        assert out["groups"] == [0], out  # a group came out first, then the failure


def test_a_request_queued_after_the_failure_is_refused_not_left_waiting(monkeypatch):
    """The window between a call's own check and its queueing: the failure path has resolved the
    open requests already, so the queue raises the failure rather than keep a request nobody
    will ever resolve."""
    monkeypatch.setattr(batch.Batch, "step", fs._raising(batch.Batch.step, None))
    eng = shardgen.Engine(tiny_model("llama", seed=7), fs.IdsOnly(), backend="local")
    try:
        with pytest.raises(fs.Injected):
            eng.submit(fs.PROMPTS[0], **fs.NO_EOS).result(timeout=fs.BOUND)
        made = build_requests(  # as submit() makes them, past its own check
            [[5, 6]], None, {}, model_config=eng._hf_config, generation_config=eng._gen_config
        )
        with pytest.raises(fs.Injected):
            eng._shared.enqueue(made)
        assert not eng._shared.inbox and not eng._shared.open_reqs
    finally:
        eng._driver.thread.join(fs.BOUND)
        eng._teardown()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_the_failure_reaches_the_calls_even_if_naming_it_fails(monkeypatch):
    """The driver's failure path resolves the futures even when its attribution step raises."""

    def broken(*_args):
        raise RuntimeError("attribution failed")

    monkeypatch.setattr(blame, "attribute", broken)
    monkeypatch.setattr(batch.Batch, "step", fs._raising(batch.Batch.step, None))
    eng = shardgen.Engine(tiny_model("llama", seed=7), fs.IdsOnly(), backend="local")
    try:
        fut = eng.submit(fs.PROMPTS[0], **fs.NO_EOS)
        with pytest.raises(fs.Injected):
            fut.result(timeout=fs.BOUND)
    finally:
        eng._driver.thread.join(fs.BOUND)
        eng._teardown()


def test_a_tokenizer_of_two_ids_gives_no_text_and_refuses_stop_strings():
    eng = shardgen.Engine(tiny_model("llama", seed=7), fs.IdsOnly(), backend="local")
    try:
        (c,) = eng.generate([fs.PROMPTS[0]], **fs.NO_EOS)
        assert c.text is None and len(c.token_ids) == 4
        assert eng.rollout(fs.PROMPTS, n=2, **fs.NO_EOS).texts is None
        with pytest.raises(ValueError, match=r"stop strings need a tokenizer with decode\(\)"):
            eng.submit(fs.PROMPTS[0], stop=["x"])
    finally:
        eng.close()


@pytest.mark.multirank
def test_every_waiting_call_raises_at_2_ranks(world2):
    """Both ranks' drivers raise at the same point of the same tick (the same calls on each): every
    call raises, with its own rank's failure or the peer's (liveness: whichever verdict stood).
    Not "next turn": when a row's next turn reaches the driver depends on the user thread, so a
    rank could fail a tick after its peer, whose tick all-reduce would then be left pending in a
    process the World reuses (a peer's failure is tests/multirank/test_faults.py's, in processes of its
    own)."""
    points = [p for p in fs.POINTS if p != "next turn"]
    for rank, res in enumerate(world2.run(fs.fail_at_each, points, (0, 1), timeout=240)):
        for point, out in res.items():
            for call in fs.POINTS[point][2]:
                said = out[call]
                assert said.startswith("raised") and "injected failure" in said, (rank, point, call, said)
            if point == "later group":
                assert out["groups"] == [0], (rank, out)
