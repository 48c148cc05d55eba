"""Tier 1 (no processes): the tick decision, fingerprints, sampling and config validation."""

from __future__ import annotations

import pytest
import torch

import shardgen
from shardgen.backends import check_backend_name
from shardgen.config import EngineConfig, SamplingParams
from shardgen.core.protocol import (
    NCOLS,
    ControlPlane,
    Decision,
    Fingerprint,
    TickRow,
    TickState,
    check_fingerprints,
    decide,
)
from shardgen.errors import CollectiveDivergenceError
from shardgen.generation.sampling import make_generator, sample_row, select_tokens


def state(*rows: dict[str, int]) -> TickState:
    return TickState([TickRow(**row) for row in rows])


def test_any_live_or_pending_work_anywhere_means_every_rank_forwards():
    assert decide(state({"live": 3, "open": 1}, {"open": 1})) is Decision.FORWARD
    assert decide(state({"open": 0}, {"pending": 1, "open": 1})) is Decision.FORWARD
    # a closed rank still forwards (shadow) while a peer has work
    assert decide(state({"open": 0}, {"live": 1, "open": 0})) is Decision.FORWARD


def test_no_work_idles_until_everyone_closed_then_exits():
    assert decide(state({"open": 1}, {"open": 1})) is Decision.IDLE
    assert decide(state({"open": 0}, {"open": 1})) is Decision.IDLE
    assert decide(state({"open": 0}, {"open": 0})) is Decision.EXIT


def test_pause_drains_live_work_and_holds_pending():
    both = ({"open": 1, "pause": 1}, {"open": 1, "pause": 1})
    assert decide(state({**both[0], "live": 2}, both[1])) is Decision.FORWARD  # drain first
    assert decide(state({**both[0], "pending": 4}, both[1])) is Decision.PAUSE  # queued work waits
    assert not state({**both[0], "pending": 4}, both[1]).admit
    # only one rank wants to pause: pending work is admitted as usual
    one = state({"open": 1, "pause": 1}, {"open": 1, "pending": 1})
    assert one.admit and decide(one) is Decision.FORWARD


def test_fingerprint_mismatch_names_the_ranks():
    a, b = Fingerprint(), Fingerprint()
    a.fold("forward", (0, 1, 2))
    b.fold("forward", (0, 1, 2))
    assert a.value == b.value and 0 <= a.value < 2**63
    check_fingerprints(state({"fingerprint": a.value}, {"fingerprint": b.value}))
    b.fold("forward", (0, 2))
    with pytest.raises(CollectiveDivergenceError, match=r"ranks \[1\]"):
        check_fingerprints(state(*({"fingerprint": v} for v in (a.value, b.value, a.value))))


def test_a_tick_row_is_one_vector_of_its_fields_and_back() -> None:
    """A column is a ``TickRow`` field: the vector the all-reduce carries has one per field, in
    field order, and the agreed state reads the same row back through it."""
    row = TickRow(live=1, pending=2, open=3, pause=4, fingerprint=5, tokens=6, head_rows=7, held_tokens=8,
                  held_head_rows=9, towers=10, held_towers=11, shared=12, turning=13)  # fmt: skip
    assert row.to_vector() == list(range(1, NCOLS + 1))
    assert TickRow.from_vector(row.to_vector()) == row
    shared = list(range(100, 112))  # ``shared`` ints after the row, within the plane's payload
    agreed = ControlPlane(None, 0, 1, payload=16).agree(row, shared=shared)  # one rank: its own row
    assert agreed.rows == [row] and agreed.col("held_towers") == [11] and agreed.total("live") == 1
    assert agreed.payloads == [shared] and ControlPlane(None, 0, 1).agree(TickRow()).payloads == []
    with pytest.raises(AssertionError, match="13 ints to share, room for 12"):
        ControlPlane(None, 0, 1, payload=12).agree(TickRow(shared=13), shared=[0] * 13)
    summed = [a + b for a, b in zip(row.to_vector(), TickRow(live=2, towers=4).to_vector(), strict=True)]
    assert TickRow.from_vector(summed) == TickRow(3, 2, 3, 4, 5, 6, 7, 8, 9, 14, 11, 12, 13)


def test_sample_row_is_deterministic_and_respects_masking():
    scores = torch.tensor([0.0, float("-inf"), 1.0, float("-inf"), 2.0])
    draws = [sample_row(scores, make_generator(7)) for _ in range(3)]
    assert len(set(draws)) == 1
    many = {sample_row(scores, g) for g in [make_generator(s) for s in range(200)]}
    assert many <= {0, 2, 4} and len(many) == 3
    # last-bit noise in logits does not change the draw
    noisy = scores + torch.tensor([1e-7, 0.0, -1e-7, 0.0, 1e-7])
    assert [sample_row(noisy, make_generator(s)) for s in range(50)] == [
        sample_row(scores, make_generator(s)) for s in range(50)
    ]


def test_select_tokens_greedy_rows_are_argmax_and_top_k_1_is_greedy():
    logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(0))
    greedy = SamplingParams()
    topk1 = SamplingParams(do_sample=True, top_k=1, temperature=0.5)
    out = select_tokens(logits, [greedy, topk1, greedy], [None, make_generator(1), None], torch.zeros(3, 1))
    assert out.tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize(
    "kw, msg",
    [
        (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1, got 0"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
        (dict(top_p=1.01), r"top_p must be in \(0, 1\], got 1.01"),
        (dict(do_sample=True, temperature=0.0), "temperature must be > 0"),
        (dict(top_k=-1), "top_k must be an integer >= 0, got -1"),
    ],
)
def test_sampling_params_errors_carry_the_numbers(kw, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kw).validate()


def test_a_mistyped_backend_gets_the_nearest_name_at_the_api():
    """``backend="fsdp"``: Engine(...), EngineConfig.validate() and check_backend_name say the
    nearest backend, as the CLI does for a mistyped flag; a name near none gets no guess."""
    said = "backend must be one of fsdp2, deepspeed, local, got 'fsdp' (did you mean fsdp2?)"
    with pytest.raises(ValueError) as info:
        shardgen.Engine(torch.nn.Linear(1, 1), backend="fsdp")
    assert str(info.value) == said
    with pytest.raises(ValueError) as info:
        shardgen.Engine(torch.nn.Linear(1, 1), config=EngineConfig(backend="deepspeedd"))
    assert str(info.value).endswith("got 'deepspeedd' (did you mean deepspeed?)"), str(info.value)
    with pytest.raises(ValueError) as info:
        EngineConfig(backend="fsdp", max_batch_size=0).validate()
    assert str(info.value) == f"{said}; max_batch_size must be an integer >= 1, got 0"
    with pytest.raises(ValueError) as info:
        check_backend_name("megatron")
    assert "did you mean" not in str(info.value)


def test_engine_config_errors():
    with pytest.raises(ValueError, match="backend must be one of fsdp2, deepspeed, local, got 'megatron'"):
        check_backend_name("megatron")
    # the engine checks the name first: before torch.distributed is needed, before any collective
    with pytest.raises(ValueError, match="backend must be one of"):
        shardgen.Engine(torch.nn.Linear(1, 1), backend="nope")
    with pytest.raises(ValueError, match="gather must be"):
        EngineConfig(gather="sometimes").validate()
    with pytest.raises(ValueError, match="max_batch_size must be an integer >= 1, got 0"):
        EngineConfig(max_batch_size=0).validate()
