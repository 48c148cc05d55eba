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


def test_replica_groups_and_a_shard_size_that_does_not_divide(world4):
    two = world4.run(sc.replica_groups, 2, timeout=60)
    assert two == [([0, 1], 0), ([0, 1], 0), ([2, 3], 1), ([2, 3], 1)]
    assert world4.run(sc.replica_groups, 4, timeout=60) == [(None, 0)] * 4
    msg = world4.run(sc.replica_groups, 3, timeout=60)[0]
    assert "--shard-size 3 must divide the world of 4 ranks" in msg


class _Store:
    """The two calls of a c10d store that the arrival checks use."""

    def __init__(self) -> None:
        self.d: dict[str, bytes] = {}

    def set(self, k: str, v: str) -> None:
        self.d[k] = v.encode()

    def get(self, k: str) -> bytes:
        return self.d[k]


def test_members_holding_different_numbers_of_groups_are_refused_before_new_group():
    from shardgen.core import comm

    store = _Store()
    store.set("p/npg/2", "5")
    store.set("p/npg/3", "5")
    comm.check_group_names(store, "p", 2, [2, 3])  # same count: fine
    store.set("p/npg/3", "6")
    with pytest.raises(ValueError, match=r"hold different numbers of process groups \(\{2: '5', 3: '6'"):
        comm.check_group_names(store, "p", 2, [2, 3])


def test_store_prefixes_are_per_rank_set():
    from shardgen.core import comm

    a1, b1, a2 = comm.engine_prefix([0, 1]), comm.engine_prefix([2, 3]), comm.engine_prefix([0, 1])
    assert len({a1, b1, a2}) == 3 and "g0-1" in a1 and "g2-3" in b1
    assert a1.rsplit("engine", 1)[1] == b1.rsplit("engine", 1)[1]  # numbered per rank set


def test_a_rank_outside_the_group_is_refused_before_any_collective(world4):
    out = world4.run(sc.not_a_member, timeout=60)
    assert out[:2] == [None, None]
    assert all(f"rank {r} is not in the engine's group" in out[r] for r in (2, 3)), out
