"""Tier 2 (4 gloo ranks): engines over groups, one per shard group, side by side."""

from __future__ import annotations

import group_scenarios as sc
import pytest

pytestmark = pytest.mark.multirank
SLEEP = 8.0


def test_two_engines_on_explicit_groups(world4):
    out = world4.run(sc.explicit_groups, SLEEP, timeout=180)
    (a0, *_), (a1, *_), (b2, _, shadow2), (b3, *_) = out
    assert max(a0, a1) < SLEEP, f"group [0, 1] closed at {a0:.1f}s/{a1:.1f}s: it waited for rank 3"
    assert min(b2, b3) >= SLEEP
    assert shadow2 > 0  # rank 2 served rank 3's forwards from inside a world barrier
    assert [p for _, p, _ in out] == [1, 3, 2, 1]


def test_hsdp_one_engine_per_shard_group(world4):
    out = world4.run(sc.hsdp, SLEEP, timeout=180)
    assert max(out[2][0], out[3][0]) < SLEEP, f"shard group [2, 3] waited for rank 1: {out}"
    assert out[0][1] > 0  # rank 0 shadowed for its own shard group's sleeper only
