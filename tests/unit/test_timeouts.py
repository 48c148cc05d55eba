"""Tier 1: every wait derives from stall_timeout and init_timeout, in a consistent order."""

from __future__ import annotations

import pytest
from models import tiny_model

import shardgen
from shardgen.faults.liveness import Liveness
from shardgen.timeouts import derive


@pytest.mark.parametrize("stall", [0.1, 0.3, 2.0, 10.0, 60.0, 600.0, 7200.0])
@pytest.mark.parametrize("init", [1.0, 300.0])
def test_derived_waits_are_ordered(stall, init):
    t = derive(stall, init)
    assert t.stall == stall and t.arrival == init
    # several heartbeats fit in one stall verdict, so one late beat is never a verdict
    assert 0 < t.heartbeat <= stall / 2
    assert t.heartbeat <= 1.0
    # a broken collective waits for the verdict (and the beats that carry it) before blaming itself
    assert t.attribution_grace > t.stall + t.heartbeat
    # the groups' own timeouts are backstops: liveness must name the culprit first
    assert t.param_group > t.attribution_grace
    assert t.control_group >= t.param_group
    assert t.close == t.paused == stall
    # a store whose host is gone (refused) or stopped (blocked) is named within the stall bound
    assert t.store_lost <= t.stall and t.store_call <= max(0.5, t.stall)
    # rank 0 outwaits the beats that carry the verdict to its peers
    assert t.verdict_linger > 2 * t.heartbeat


def test_waits_grow_with_stall_timeout():
    a, b = derive(2.0, 10.0), derive(20.0, 10.0)
    for name in ("heartbeat", "stall", "attribution_grace", "close", "paused", "param_group"):
        assert getattr(a, name) < getattr(b, name), name


def test_engine_and_liveness_take_their_numbers_from_derive():
    model = tiny_model("llama", seed=1)
    with shardgen.Engine(model, backend="local", stall_timeout=7, init_timeout=9) as eng:
        assert eng.timeouts == derive(7, 9)
    t = derive(3.0, 5.0)
    live = Liveness(None, "p", 0, 2, t, status=lambda: (0, "idle"), on_failure=lambda e: None)
    assert (live.interval, live.stall_timeout) == (t.heartbeat, t.stall)
