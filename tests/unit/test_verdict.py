"""Tier 1: the verdict (first writer wins, acks) on a real TCPStore, and the stuck-driver rule."""

from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist

from shardgen.errors import PeerFailedError, PeerStalledError, RendezvousTimeoutError
from shardgen.faults import verdict
from shardgen.faults.stalls import find_laggard
from shardgen.faults.verdict import Verdict


@pytest.fixture
def store():
    s = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=5))
    return dist.PrefixStore("t", s)


def test_first_verdict_wins_and_every_rank_reads_it(store):
    first = verdict.publish(store, "e1", Verdict(2, "gone", "rank 2 (host h, pid 9) is gone", by=0))
    second = verdict.publish(store, "e1", Verdict(0, "gone", "rank 0 (host h, pid 7) is gone", by=1))
    assert first == second == verdict.read(store, "e1")
    assert first.culprit == 2 and first.by == 0
    assert verdict.read(store, "e2") is None  # engines do not share verdicts


def test_verdict_errors_name_the_detector_to_others():
    v = Verdict(1, "raised", "rank 1 (host h, pid 5) raised ValueError: x", by=1)
    assert isinstance(v.error(1), PeerFailedError) and "detected by" not in str(v.error(1))
    assert isinstance(Verdict(1, "silent", "m", by=0).error(2), PeerStalledError)
    assert "[detected by rank 0]" in str(Verdict(1, "silent", "m", by=0).error(2))
    assert isinstance(Verdict(1, "absent", "m", by=0).error(0), RendezvousTimeoutError)


def test_store_host_waits_only_for_peers_that_have_not_acknowledged(store):
    verdict.publish(store, "e", Verdict(3, "gone", "m", by=0))
    store.set("e/hb/1", '{"phase": "left: peer 3 failed"}')
    assert verdict.unacknowledged(store, "e", 4, verdict.read(store, "e"), me=0) == [2]
    verdict.acknowledge(store, "e", 2)
    assert verdict.wait_for_acks(store, "e", 4, me=0, bound_s=0.1) == []
    assert verdict.wait_for_acks(store, "none", 4, me=0, bound_s=5) == []  # no verdict: no wait


def _rec(tick: int, phase: str, gathers: int) -> dict:
    return {"tick": tick, "phase": phase, "gathers": gathers, "forwards": 0}


def test_driver_deadlocked_before_its_gathers_is_the_laggard():
    recs = {0: _rec(5, "decode", 11), 1: _rec(5, "decode", 10), 2: _rec(5, "shadow", 11)}
    frozen = dict.fromkeys(recs, 5.0)
    assert find_laggard(recs, frozen, 4.0) == (1, [0, 2])


def test_driver_deadlocked_after_its_gathers_is_behind_in_ticks():
    recs = {0: _rec(5, "tick", 12), 1: _rec(5, "decode", 12), 2: _rec(5, "tick", 12)}
    assert find_laggard(recs, dict.fromkeys(recs, 5.0), 4.0) == (1, [0, 2])


def test_rank_that_skipped_its_gathers_is_blamed_not_the_rank_blocked_in_one():
    # rank 2 left the forward without gathering and waits in the next tick: ahead in ticks, behind in gathers
    recs = {0: _rec(5, "decode", 11), 1: _rec(5, "decode", 11), 2: _rec(5, "tick", 10)}
    assert find_laggard(recs, dict.fromkeys(recs, 5.0), 4.0) == (2, [0, 1])


def test_no_stall_while_anyone_moves_pauses_or_everyone_waits_alike():
    recs = {0: _rec(5, "tick", 12), 1: _rec(5, "decode", 12)}
    assert find_laggard(recs, {0: 5.0, 1: 1.0}, 4.0) is None  # rank 1's forward still moves
    assert find_laggard({**recs, 1: _rec(5, "paused", 12)}, dict.fromkeys(recs, 60.0), 4.0) is None
    same = {0: _rec(5, "tick", 12), 1: _rec(5, "tick", 12)}
    assert find_laggard(same, dict.fromkeys(same, 60.0), 4.0) is None
    left = {0: _rec(5, "tick", 12), 1: _rec(4, "left: peer 2 failed", 3)}
    assert find_laggard(left, dict.fromkeys(left, 60.0), 4.0) is None
