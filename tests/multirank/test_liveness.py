"""Tier 2 fault injection with real processes: a lost rank is named within seconds, never a hang.

Each rank is its own process started here (not through torchrun's agent, which would
kill the survivors itself), so the test sees exactly what a healthy rank does.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from fault_ranks import STALL, Ranks

pytestmark = [pytest.mark.multirank, pytest.mark.slow]


def measured(fault: str, seconds: float) -> None:
    """One line per fault for docs/RELIABILITY.md (``pytest tests/multirank/test_liveness.py -s``)."""
    print(f"\nMEASURED fault={fault!r} detect_and_exit_s={seconds:.2f} stall_timeout={STALL:g}")


def _calls_matched_hf(ranks: Ranks, r: int, at_least: int) -> None:
    """Rank ``r`` finished ``at_least`` generate calls before the fault, each equal to HF generate()."""
    done = ranks.events(r, "call_done")
    assert len(done) >= at_least, ranks.dump()
    assert all(e["same_as_hf"] for e in done), [e for e in done if not e["same_as_hf"]]


def _no_process_left(ranks: Ranks, r: int) -> None:
    pid = ranks.procs[r].pid
    assert ranks.procs[r].poll() is not None
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_sigkill_mid_decode_names_the_rank(ranks_factory):
    ranks = ranks_factory("sigkill")
    ranks.wait_mid_run(1, calls=3)
    t_fault = time.monotonic()
    os.kill(ranks.procs[1].pid, signal.SIGKILL)
    code, waited = ranks.wait_exit(0, STALL + 5 + 5)
    text = ranks.text(0)
    assert code != 0, ranks.dump()
    assert "PeerStalledError" in text and "rank 1" in text and "is gone" in text, ranks.dump()
    assert "last phase" in text and "at tick 0" not in text, ranks.dump()
    assert time.monotonic() - t_fault <= STALL + 5, f"took {time.monotonic() - t_fault:.1f}s"
    measured("SIGKILL mid-decode", time.monotonic() - t_fault)
    _no_process_left(ranks, 0)
    _calls_matched_hf(ranks, 1, at_least=3)
    _calls_matched_hf(ranks, 0, at_least=0)


def test_sigstop_rank_is_reported_stalled_with_its_state(ranks_factory):
    ranks = ranks_factory("sigstop")
    ranks.wait_mid_run(1, calls=3)
    t_fault = time.monotonic()
    os.kill(ranks.procs[1].pid, signal.SIGSTOP)
    code, _ = ranks.wait_exit(0, STALL + 5 + 5)
    elapsed = time.monotonic() - t_fault
    text = ranks.text(0)
    assert code != 0
    assert "PeerStalledError" in text and "rank 1" in text and "sent no heartbeat" in text, ranks.dump()
    assert "stopped" in text and "last phase" in text, ranks.dump()
    assert STALL - 0.5 <= elapsed <= STALL + 5, f"took {elapsed:.1f}s"
    measured("SIGSTOP mid-decode", elapsed)
    _no_process_left(ranks, 0)
    _calls_matched_hf(ranks, 1, at_least=3)
    _calls_matched_hf(ranks, 0, at_least=0)


def test_exception_in_a_driver_reaches_every_rank(ranks_factory):
    ranks = ranks_factory("driver_raises")
    code1, _ = ranks.wait_exit(1, 300)
    t_fault = ranks.events(1, "error")[0]["t"]
    code0, waited0 = ranks.wait_exit(0, STALL + 5)
    measured("exception in one rank's driver", time.time() - t_fault)
    assert code1 != 0 and code0 != 0, ranks.dump()
    assert "ValueError" in ranks.text(1) and "injected failure" in ranks.text(1)
    err0 = ranks.events(0, "error")
    assert err0 and err0[0]["type"] == "PeerFailedError", ranks.dump()
    assert err0[0]["msg"].startswith("rank 1 (host "), ranks.dump()
    assert "raised ValueError: injected failure in the forward; last phase" in err0[0]["msg"]
    _no_process_left(ranks, 0)
    _no_process_left(ranks, 1)


def test_rank_that_never_constructs_is_named(ranks_factory):
    ranks = ranks_factory("never_constructs")
    ranks.wait_event(1, "away")
    code, waited = ranks.wait_exit(0, STALL + 30)
    measured(
        "rank never constructs the Engine (init_timeout=4)", time.time() - ranks.events(0, "started")[0]["t"]
    )
    err = ranks.events(0, "error")
    assert code != 0 and err and err[0]["type"] == "RendezvousTimeoutError", ranks.dump()
    assert "rank(s) [1]" in err[0]["msg"] and "never constructed" in err[0]["msg"]


def test_stuck_user_thread_is_not_a_failure_but_is_named_at_close(ranks_factory):
    ranks = ranks_factory("user_thread_stuck")
    ranks.wait_event(1, "stuck")
    # rank 0 finishes all its work, with HF's outputs, while rank 1's user is stuck
    t_close = ranks.wait_event(0, "closing", timeout=300)["t"]
    assert len(ranks.events(0, "call_done")) == 2
    _calls_matched_hf(ranks, 0, at_least=2)
    code, _ = ranks.wait_exit(0, STALL + 10)
    measured("user thread stuck, never closes (named at close)", time.time() - t_close)
    err = ranks.events(0, "error")
    assert code != 0 and err and err[0]["type"] == "RendezvousTimeoutError", ranks.dump()
    assert "rank(s) [1] never called close()" in err[0]["msg"]
    assert ranks.procs[1].poll() is None  # the stuck rank itself was never declared failed


def test_fault_in_one_shard_group_spares_the_other(ranks_factory):
    """Engines on [0, 1] and [2, 3]: rank 3 is killed; rank 2 names it, ranks 0 and 1 keep
    generating (and checking against HF) and close cleanly."""
    ranks = ranks_factory("group_sigkill", world=4)
    ranks.wait_event(3, "call_done", count=2, timeout=300)  # 4 ranks importing torch on 2 cores: slow
    t_kill = time.time()
    os.kill(ranks.procs[3].pid, signal.SIGKILL)
    code2, _ = ranks.wait_exit(2, STALL + 10)
    err2 = ranks.events(2, "error")
    assert code2 != 0 and err2 and err2[0]["type"] == "PeerStalledError", ranks.dump()
    assert "rank 3 " in err2[0]["msg"] and "is gone" in err2[0]["msg"], ranks.dump()
    for r in (0, 1):
        code, _ = ranks.wait_exit(r, 4 * STALL + 180)
        assert code == 0 and ranks.events(r, "closed") and not ranks.events(r, "error"), ranks.dump()
        done = ranks.events(r, "call_done")
        assert any(e["t"] > t_kill + STALL for e in done), ranks.dump()
        assert all(e["same_as_hf"] for e in done), ranks.dump()
        assert "rank 3" not in ranks.text(r), ranks.dump()
