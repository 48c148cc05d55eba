"""Faults at 3 and 4 ranks: every healthy rank names the rank that failed, never a messenger.

With 2 ranks the only peer is always the culprit; from 3 ranks on, a rank that exits
because of a peer (or rank 0 taking the c10d store with it) could be blamed instead.
Each test runs real rank processes (tests/helpers/liveness_rank.py), injects one fault into
one rank (a middle rank, or rank 0, the store's host), and checks every other rank's
error. ``pytest -s`` prints a MEASURED line per case for docs/RELIABILITY.md.
"""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
from fault_ranks import STALL, Ranks

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

BOUND = STALL + 8  # a failure must end every healthy process within stall_timeout + a few seconds


def named(msg: str) -> set[int]:
    """Ranks an error message names as a culprit (``rank R (host ...``)."""
    return {int(m) for m in re.findall(r"rank (\d+) \((?:host|no heartbeat)", msg)}


def check_every_healthy_rank_names(ranks: Ranks, victim: int, world: int, fault: str, t_fault: float) -> None:
    worst = 0.0
    for r in range(world):
        if r == victim:
            continue
        code, _ = ranks.wait_exit(r, BOUND)
        worst = max(worst, time.time() - t_fault)
        assert code != 0, ranks.dump()
        errs = ranks.events(r, "error")
        assert errs, f"rank {r} reported no error:\n{ranks.dump()}"
        assert named(errs[0]["msg"]) == {victim}, f"rank {r} blamed the wrong rank:\n{ranks.dump()}"
        assert "last phase" in errs[0]["msg"], ranks.dump()
    print(f"\nMEASURED world={world} fault={fault!r} culprit=rank {victim} detect_and_exit_s={worst:.2f}")


# 3 ranks, the store's host and another as the culprit, in `make test`; the same at 4 ranks in
# `make fuzz` (marker bigworld: each case starts 4 fresh processes).
BIG4 = pytest.mark.bigworld
CASES = [(3, 0), (3, 1), pytest.param(4, 0, marks=BIG4), pytest.param(4, 1, marks=BIG4)]
IDS = ["w3-rank0", "w3-rank1", "w4-rank0", "w4-rank1"]


@pytest.mark.parametrize(("world", "victim"), CASES, ids=IDS)
@pytest.mark.parametrize("sig", ["SIGKILL", "SIGSTOP"])
def test_signal_is_named_by_every_healthy_rank(ranks_factory, world, victim, sig):
    signal_after_two_calls(ranks_factory, world, victim, sig)


def signal_after_two_calls(ranks_factory, world: int, victim: int, sig: str) -> None:
    ranks = ranks_factory("sigkill", world, victim)
    ranks.wait_mid_run(victim, calls=2)
    t_fault = time.time()
    os.kill(ranks.procs[victim].pid, getattr(signal, sig))
    check_every_healthy_rank_names(ranks, victim, world, sig, t_fault)


@pytest.mark.parametrize(("world", "victim"), CASES, ids=IDS)
def test_exception_in_a_forward_is_named_by_every_healthy_rank(ranks_factory, world, victim):
    ranks = ranks_factory("driver_raises", world, victim)
    code, _ = ranks.wait_exit(victim, 300)
    assert code != 0 and "injected failure" in ranks.text(victim), ranks.dump()
    t_fault = ranks.events(victim, "error")[0]["t"]
    check_every_healthy_rank_names(ranks, victim, world, "exception in a forward", t_fault)
    for r in range(world):
        if r != victim:
            assert "raised ValueError: injected failure" in ranks.events(r, "error")[0]["msg"]


@pytest.mark.parametrize("victim", [0, 1])
def test_deadlocked_driver_with_live_heartbeat_is_named(ranks_factory, victim):
    ranks = ranks_factory("driver_deadlock", 3, victim)
    t_fault = ranks.wait_event(victim, "deadlocked", timeout=300)["t"]
    check_every_healthy_rank_names(ranks, victim, 3, "driver deadlocked, heartbeat alive", t_fault)
    assert "stopped reaching the tick" in ranks.events((victim + 1) % 3, "error")[0]["msg"]


@pytest.mark.parametrize("victim", [0, 1])
def test_driver_that_skips_its_gathers_is_named_not_its_blocked_peer(ranks_factory, victim):
    ranks = ranks_factory("skip_forward", 3, victim)
    t_fault = ranks.wait_event(victim, "skipped", timeout=300)["t"]
    check_every_healthy_rank_names(ranks, victim, 3, "driver skipped a forward's gathers", t_fault)


# Beyond 4 ranks: one case per fault kind, culprits spread over the ranks. Minutes on 2 cores
# (8 processes each import torch), so `make fuzz` runs them, not `make test`.
BIG = [(8, 5, "SIGKILL"), (6, 0, "SIGSTOP")]


@pytest.mark.bigworld
@pytest.mark.parametrize(("world", "victim", "sig"), BIG, ids=[f"w{w}-rank{v}-{s}" for w, v, s in BIG])
def test_signal_at_up_to_8_ranks_is_named_by_every_healthy_rank(ranks_factory, world, victim, sig):
    signal_after_two_calls(ranks_factory, world, victim, sig)


@pytest.mark.bigworld
def test_exception_at_5_ranks_is_named_by_every_healthy_rank(ranks_factory):
    world, victim = 5, 3
    ranks = ranks_factory("driver_raises", world, victim)
    code, _ = ranks.wait_exit(victim, 300)
    assert code != 0 and "injected failure" in ranks.text(victim), ranks.dump()
    t_fault = ranks.events(victim, "error")[0]["t"]
    check_every_healthy_rank_names(ranks, victim, world, "exception in a forward", t_fault)


STATIONARY = {"GATHER": "stationary"}


STATIONARY_CASES = [
    ("fsdp2", "SIGKILL"),
    ("fsdp2", "SIGSTOP"),
    ("fsdp2", "raises between two exchanges"),
    ("deepspeed", "raises between two exchanges"),
]


@pytest.mark.parametrize(("backend", "fault"), STATIONARY_CASES)
def test_stationary_faults_at_3_ranks_are_named_by_every_healthy_rank(ranks_factory, backend, fault):
    """gather="stationary": a rank killed, stopped, or raising between two exchanges of a forward
    (its peers wait in the next exchange) is named by both healthy ranks."""
    env = {**STATIONARY, "BACKEND": backend, "DS_ACCELERATOR": "cpu"}
    victim = 1
    if fault == "raises between two exchanges":
        ranks = ranks_factory("exchange_raises", 3, victim, env=env)
        code, _ = ranks.wait_exit(victim, 300)
        assert code != 0 and "injected failure between two exchanges" in ranks.text(victim), ranks.dump()
        check_every_healthy_rank_names(ranks, victim, 3, fault, ranks.events(victim, "error")[0]["t"])
        return
    ranks = ranks_factory("sigkill", 3, victim, env=env)
    ranks.wait_mid_run(victim, calls=2)
    t_fault = time.time()
    os.kill(ranks.procs[victim].pid, getattr(signal, fault))
    check_every_healthy_rank_names(ranks, victim, 3, f"{fault} ({backend}, stationary)", t_fault)
    assert all(e["same_as_hf"] for e in ranks.events(0, "call_done")), ranks.dump()
