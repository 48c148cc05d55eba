"""Tests of the multi-rank harness (tests/helpers/world.py) and its fixtures (tests/conftest.py)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
import torch.distributed as dist
from world import World, WorldError, WorldHang, assert_no_thread, rank, run_ranks, world_size

pytestmark = pytest.mark.multirank


# ----------------------------------------------------------------------------------------
# scenarios (module level: the ranks import them by qualified name)
# ----------------------------------------------------------------------------------------


def scenario_all_reduce(base: float, *, scale: float = 1.0) -> dict:
    t = torch.tensor([base + rank()]) * scale
    dist.all_reduce(t)
    return {
        "rank": rank(),
        "world_size": world_size(),
        "sum": t,
        "env": {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")},
        "master_port": os.environ.get("MASTER_PORT"),
        "omp": os.environ.get("OMP_NUM_THREADS"),
        "threads": torch.get_num_threads(),
        "pid": os.getpid(),
        "extra": os.environ.get("SHARDGEN_WORLD_TEST"),
    }


def scenario_echo(value: object) -> tuple[int, object]:
    dist.barrier()
    return rank(), value


def scenario_raise_on_rank1() -> str:
    if rank() == 1:
        raise ValueError("boom from rank 1")
    return "fine"


def scenario_die_on_rank1() -> None:
    if rank() == 1:
        os._exit(3)
    dist.barrier()  # never completes: rank 1 is gone


def scenario_raise_on_rank0_while_rank1_waits() -> None:
    if rank() == 0:
        raise KeyError("rank 0 gave up")
    _hang_in_barrier()


def _hang_in_barrier() -> None:
    dist.barrier()


def _hang_in_recv() -> None:
    dist.recv(torch.zeros(1), src=0)


def scenario_hang() -> None:
    # rank 0 waits in a barrier that rank 1 never joins; rank 1 waits for a send that never comes
    if rank() == 0:
        _hang_in_barrier()
    else:
        _hang_in_recv()


# ----------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _rank_section(message: str, r: int) -> str:
    head = f"=== rank {r} "
    assert head in message, message
    return message.split(head, 1)[1].split("=== rank ", 1)[0]


_PIDS_BEFORE_HANG: list[int] = []


# ----------------------------------------------------------------------------------------
# tests
# ----------------------------------------------------------------------------------------


def test_results_in_rank_order_after_all_reduce(world2):
    out = world2.run(scenario_all_reduce, 1.0, scale=2.0)
    assert [o["rank"] for o in out] == [0, 1]
    assert [o["world_size"] for o in out] == [2, 2]
    for o in out:
        torch.testing.assert_close(o["sum"], torch.tensor([(1.0 + 2.0) * 2.0]))
    assert [o["env"]["RANK"] for o in out] == ["0", "1"]
    assert [o["env"]["LOCAL_RANK"] for o in out] == ["0", "1"]
    assert {o["env"]["WORLD_SIZE"] for o in out} == {"2"}
    assert {o["env"]["MASTER_ADDR"] for o in out} == {"127.0.0.1"}
    assert {o["master_port"] for o in out} == {str(world2.world.port)}
    assert {o["omp"] for o in out} == {"1"}
    assert {o["threads"] for o in out} == {1}
    assert [o["pid"] for o in out] == world2.pids
    # the same processes serve the next scenario
    assert world2.run(scenario_echo, "again") == [(0, "again"), (1, "again")]


def test_run_per_rank(world2):
    out = world2.run_per_rank(scenario_echo, [("a",), ("b",)])
    assert out == [(0, "a"), (1, "b")]
    out = world2.run_per_rank(scenario_all_reduce, [(0.0,), (10.0,)], [{"scale": 1.0}, {"scale": 3.0}])
    # rank 0 contributes 0 + 0, rank 1 contributes (10 + 1) * 3
    torch.testing.assert_close(out[0]["sum"], torch.tensor([33.0]))


def test_exception_on_one_rank_raises_world_error(world2):
    pids = world2.pids
    with pytest.raises(WorldError) as info:
        world2.run(scenario_raise_on_rank1)
    message = str(info.value)
    assert "rank 1" in message
    assert "ValueError: boom from rank 1" in message
    assert "scenario_raise_on_rank1" in message  # the remote traceback, not just the message
    assert "rank 0: returned" in message
    assert set(info.value.failures) == {1}
    # every rank returned and the ranks are still in sync: the World keeps serving
    assert not world2.broken
    assert world2.pids == pids
    assert world2.run(scenario_echo, 5) == [(0, 5), (1, 5)]


def test_unpicklable_scenario_is_rejected_before_sending(world2):
    pids = world2.pids
    with pytest.raises(TypeError, match="module-level"):
        world2.run(lambda: None)
    assert world2.pids == pids and not world2.broken


def test_dead_rank_raises_world_error_with_exit_code(world2):
    pids = world2.pids
    start = time.monotonic()
    with pytest.raises(WorldError) as info:
        world2.run(scenario_die_on_rank1, timeout=30)
    assert time.monotonic() - start < 15
    message = str(info.value)
    assert "rank 1" in message and "exit code 3" in message, message
    assert 1 in info.value.failures
    assert world2.broken
    assert all(_pid_gone(pid) for pid in pids)


def test_error_while_peer_is_stuck_kills_world_after_grace():
    with World(2, error_grace=1.0) as world:
        pids = world.pids
        start = time.monotonic()
        with pytest.raises(WorldError) as info:
            world.run(scenario_raise_on_rank0_while_rank1_waits, timeout=30)
        assert time.monotonic() - start < 8
        message = str(info.value)
        assert "KeyError: 'rank 0 gave up'" in message
        # rank 1 never returned: its stack shows where it waits
        rank1 = message.split("--- rank 1", 1)[1]
        assert "did not return" in rank1 and "_hang_in_barrier" in rank1, message
        assert set(info.value.failures) == {0}
        assert world.broken
        assert all(_pid_gone(pid) for pid in pids)


def test_hang_raises_world_hang_with_every_stack(world2):
    pids = world2.pids
    _PIDS_BEFORE_HANG[:] = pids
    start = time.monotonic()
    with pytest.raises(WorldHang) as info:
        world2.run(scenario_hang, timeout=3)
    elapsed = time.monotonic() - start
    assert 3 <= elapsed < 10, elapsed
    message = str(info.value)
    for r, stuck_in in ((0, "_hang_in_barrier"), (1, "_hang_in_recv")):
        section = _rank_section(message, r)
        assert stuck_in in section, section
        assert "scenario_hang" in section, section
    assert set(info.value.stacks) == {0, 1}
    assert world2.broken
    assert all(_pid_gone(pid) for pid in pids)


def test_fixture_recreates_broken_world(world2):
    # the previous test left world2 broken (killed ranks); the fixture starts a new World
    out = world2.run(scenario_echo, "alive")
    assert out == [(0, "alive"), (1, "alive")]
    assert not world2.broken
    if _PIDS_BEFORE_HANG:
        assert set(world2.pids).isdisjoint(_PIDS_BEFORE_HANG)


def test_run_ranks_fresh_world_with_env():
    out = run_ranks(3, scenario_all_reduce, 1.0, env={"SHARDGEN_WORLD_TEST": "yes"}, timeout=30)
    assert [o["rank"] for o in out] == [0, 1, 2]
    for o in out:
        torch.testing.assert_close(o["sum"], torch.tensor([1.0 + 2.0 + 3.0]))
    assert {o["extra"] for o in out} == {"yes"}
    assert all(_pid_gone(o["pid"]) for o in out)  # closed and reaped


def test_world_context_manager_closes_and_rejects_runs():
    with World(1) as world:
        assert world.run(scenario_echo, 1) == [(0, 1)]
        pids = world.pids
    assert world.closed and world.broken
    assert all(_pid_gone(pid) for pid in pids)
    with pytest.raises(RuntimeError, match="broken or closed"):
        world.run(scenario_echo, 1)


def test_assert_no_thread():
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="shardgen-test-worker")
    thread.start()
    try:
        with pytest.raises(AssertionError, match="shardgen-test-worker"):
            assert_no_thread("shardgen-test")
        assert_no_thread("something-else")
    finally:
        stop.set()
        thread.join()
    assert_no_thread("shardgen-test")


class _Item:
    """The part of a pytest item that conftest's gpu hook reads."""

    def __init__(self, *markers: str) -> None:
        self.markers = [pytest.Mark(m, (), {}) for m in markers]

    def get_closest_marker(self, name: str) -> pytest.Mark | None:
        return next((m for m in self.markers if m.name == name), None)


@pytest.mark.parametrize("cuda", [False, True])
def test_gpu_marker_skips_exactly_when_cuda_is_missing(monkeypatch, cuda):
    import conftest

    monkeypatch.setattr(conftest, "_CUDA_AVAILABLE", None)  # the hook caches the probe
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    conftest.pytest_runtest_setup(_Item("slow"))  # unmarked tests always run
    if cuda:
        conftest.pytest_runtest_setup(_Item("gpu"))
    else:
        with pytest.raises(pytest.skip.Exception, match="needs a CUDA device"):
            conftest.pytest_runtest_setup(_Item("gpu", "slow"))


# ----------------------------------------------------------------------------------------
# scripts run on forked ranks as torchrun starts them (tests/helpers/example_runs.py)
# ----------------------------------------------------------------------------------------

FORKED_SCRIPT = """
import os, sys, time
import torch.distributed as dist
dist.init_process_group("gloo")
env = {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR")}
print(f"rank {dist.get_rank()} env {sorted(env.items())} argv {sys.argv[1:]} cwd {os.getcwd()}")
dist.barrier()
if sys.argv[1] == "fail" and dist.get_rank() == 1:
    raise ValueError("boom on rank 1")
if sys.argv[1] == "fail":
    time.sleep(120)  # a peer left waiting: the failed rank ends the job, as under torchrun
dist.destroy_process_group()
"""


def test_run_forked_is_torchrun_to_the_script_and_ends_the_job_at_a_failure(tmp_path):
    from example_runs import ROOT, run_forked

    script = tmp_path / "script.py"
    script.write_text(FORKED_SCRIPT)
    rc, out, _ = run_forked(script, "ok", nproc=3)
    assert rc == 0, out
    for r in range(3):
        env = [("LOCAL_RANK", str(r)), ("LOCAL_WORLD_SIZE", "3"), ("MASTER_ADDR", "127.0.0.1"),
               ("RANK", str(r)), ("WORLD_SIZE", "3")]  # fmt: skip
        assert f"rank {r} env {env} argv ['ok'] cwd {ROOT}" in out, out
    t0 = time.monotonic()
    rc, out, _ = run_forked(script, "fail", nproc=2, timeout=60)
    assert rc == 1 and "ValueError: boom on rank 1" in out and "Traceback" in out, out
    assert time.monotonic() - t0 < 30, "the job did not end at the failure"
