"""DeepSpeed ZeRO-3 backend on 2 gloo ranks (CPU, DS_ACCELERATOR=cpu), every run under a hard timeout.

The ranks of these tests import DeepSpeed, which leaves process-wide state behind (its comm
layer, zero.Init class attributes, the F.linear patch of a user's deepspeed.initialize), so
they get their own World instead of the session-wide ``world2``. The seed-hang test runs in a
World of its own that it expects to hang and be killed.
"""

from __future__ import annotations

import sys

import pytest

pytest.importorskip("deepspeed")

import ds_scenarios as sc  # noqa: E402
import pool_scenarios as pool_sc  # noqa: E402
from engine_scenarios import assert_lockstep  # noqa: E402
from world import World, WorldHang  # noqa: E402

from shardgen.backends.deepspeed import internals as dsi  # noqa: E402
from shardgen.backends.deepspeed import partition as dsp  # noqa: E402

pytestmark = pytest.mark.multirank

ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
TOL = 1e-5
SEED_HANG_S = 10.0  # the seed script finishes in ~2 s when it does not hang


@pytest.fixture(scope="module")
def dsworld(world2):
    return world2


# ----------------------------------------------------------------------------- in-process
def test_lockstep_config_forces_history_free_gathers():
    cfg = dsp.lockstep_config(
        {
            "zero_optimization": {
                "stage": 3,
                "prefetch_bucket_size": 5e7,
                "stage3_param_persistence_threshold": 1e5,
            }
        }
    )
    zero = cfg["zero_optimization"]
    assert zero["stage3_prefetch_bucket_size"] == 0 and "prefetch_bucket_size" not in zero
    assert zero["stage3_param_persistence_threshold"] == 0 and zero["stage3_max_reuse_distance"] == 0
    assert zero["memory_efficient_linear"] is False and cfg["train_micro_batch_size_per_gpu"] == 1
    with pytest.raises(ValueError, match="stage 3"):
        dsp.lockstep_config({"zero_optimization": {"stage": 2}})
    with pytest.raises(ValueError, match="hpZ"):
        dsp.lockstep_config({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}})


def test_moe_block_detection():
    import torch.nn as nn

    class Router(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(4, 2)
            self.experts = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    class FooSparseMoeBlock(nn.Module):
        pass

    class Qwen2MoeDecoderLayer(nn.Module):
        pass

    assert dsp.is_moe_block(Router()) and dsp.is_moe_block(FooSparseMoeBlock())
    assert not dsp.is_moe_block(Qwen2MoeDecoderLayer()) and not dsp.is_moe_block(nn.Linear(2, 2))


def test_missing_deepspeed_gives_install_hint(monkeypatch):
    import torch

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # _import_deepspeed would set it in this process
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    with pytest.raises(ImportError, match=r"pip install 'shardgen\[deepspeed\]'"):
        dsi.import_deepspeed(torch.device("cpu"))


# ----------------------------------------------------------------------------- 2 ranks
@pytest.mark.parametrize(
    "arch, offload", [("llama", False), ("llama", True), ("gpt2", False), ("mixtral", False)]
)
def test_forward_logits_equal_unsharded(dsworld, arch, offload):
    """Default plan, small buckets (one gather per bucket) and the gather-once replica."""
    r0, r1 = dsworld.run(sc.logits_match, arch, offload, timeout=90)
    for r in (r0, r1):
        assert r["diff"] <= TOL and r["diff_small_buckets"] <= TOL, r
        assert r["diff_replica"] <= TOL and r["replica_calls"] == [] and r["replica_freed"], r
        n_buckets, n_calls = r["small_buckets"]
        # one gather per bucket, and per row chunk of the embeddings / head (not in the plan)
        assert r["chunks"] and n_calls == n_buckets + sum(r["chunks"].values()) and n_buckets > 1, r

        assert r["partitioned"] and r["full_bytes_ok"]
        assert r["groups"] == ["param"], f"gathers outside the private group: {r['groups']}"
        assert r["describe"]["zero_stage"] == "3"
        assert r["describe"]["offload_param"] == ("cpu" if offload else "none")
    assert r0["n_gathers"] == r1["n_gathers"] > 0
    if arch == "mixtral":
        assert "MixtralSparseMoeBlock" in r0["leaves"]


def test_gather_once_in_chunks_equals_deepspeeds_own_gathers(dsworld):
    """The replica filled from chunks of many partitions holds exactly what DeepSpeed's own
    bucketed gathers give, and the unsharded model's values."""
    for r, cases in enumerate(dsworld.run(sc.whole_gather_equals_bucketed, timeout=120)):
        by = {c["case"]: c for c in cases}
        for c in cases:
            assert c["names"] and not c["equal_own"] and not c["equal_full"], (r, c)
        assert by["gpt2-odd-tied"]["chunks"] == by["llama-offload"]["chunks"] == 1, (r, cases)
        assert by["llama-small-chunks"]["chunks"] > 3 and by["gpt2-odd-tied"]["tied"], (r, cases)


@pytest.mark.parametrize("bucket_bytes", [None, 20_000, 0], ids=["default-plan", "7-buckets", "per-module"])
def test_lockstep_real_vs_shadow_forwards_issue_identical_collectives(dsworld, bucket_bytes):
    """Rank 0: 3 real forwards of different shapes; rank 1: shadow, real, shadow. Then gather
    policy 'once' with 3 vs 1 local forwards (different trace histories), then lockstep again.
    With a bucket plan, each forward issues exactly one all-gather per bucket."""
    r0, r1 = dsworld.run(sc.lockstep_uneven, bucket_bytes, timeout=90)
    per_forward = {sc.gathers(seq, 2) for r in (r0, r1) for seq in r["seqs"]}
    chunks = r0["chunks"]  # the embeddings and head: gathers of row chunks, not in the plan
    assert len(chunks) == 2, chunks
    if bucket_bytes == 0:  # one per module
        assert r0["n_buckets"] is None and per_forward == {r0["n_units"] - 2 + sum(chunks.values())}
    else:
        assert per_forward == {r0["n_buckets"] + sum(chunks.values())}, (per_forward, r0["n_buckets"])
        assert r0["n_buckets"] < r0["n_units"]  # the plan is what makes it fewer
        if bucket_bytes:
            assert r0["n_buckets"] > 2  # several buckets
        assert r0["prefetch"] is False  # a CPU device: no bucket is gathered ahead (DEEPSPEED.md)
    ref = r0["seqs"][0]
    assert ref and all(c[1] == "param" for c in ref), ref
    for r in (r0, r1):
        assert all(d <= TOL for d in r["diffs"]), r["diffs"]
        assert all(seq == ref for seq in r["seqs"]), "a forward's collective sequence differs"
        assert all(calls == [] for calls in r["local_calls"]), "forwards after gather_all issued collectives"
        assert r["gather_all_calls"] and all(c[1] == "param" for c in r["gather_all_calls"])
        assert r["release_all_calls"] == []
        assert r["lockstep_flag_after"] is True
    assert r0["gather_all_calls"] == r1["gather_all_calls"]
    assert len(r0["diffs"]) == 3 + 3 + 1 and len(r1["diffs"]) == 1 + 1 + 1


@pytest.mark.parametrize(
    "pass_engine, offload", [(True, False), (False, True)], ids=["engine", "module-offload"]
)
def test_user_partitioned_model_moves_to_private_group(dsworld, pass_engine, offload):
    """Engine forwards in a background thread while rank 1's main thread sits in a default-group
    barrier: finishes only because no gather is left on the default group (the same scenario with
    the gathers on the default group hangs: ds_scenarios.user_model_private_group(move=False))."""
    r0, r1 = dsworld.run(sc.user_model_private_group, pass_engine, offload, timeout=60)
    for r in (r0, r1):
        assert r["before"] == ["default"] and r["after"] == ["param"]
        assert r["box"].get("done") and "error" not in r["box"], r["box"]
        assert not r["alive"]
        assert r["default_calls"] == [("barrier", "default", -1)], r["default_calls"]
        assert r["param_calls"] == r0["param_calls"] > 0
        assert r["describe"]["offload_param"] == ("cpu" if offload else "none")
    assert all(d <= TOL for d in r0["box"]["diffs"]) and len(r0["box"]["diffs"]) == 3


def test_model_partitioned_by_zero_init_alone(dsworld):
    for r in dsworld.run(sc.zero_init_model_without_engine, timeout=60):
        assert r["diff"] <= TOL and r["groups"] == ["param"] and r["same"] and r["n"] > 0, r


def test_model_partitioned_on_other_ranks_is_refused(dsworld):
    msgs = dsworld.run(sc.mismatched_group_raises, timeout=60)
    for rank, msg in enumerate(msgs):
        assert f"partitioned over ranks [{rank}]" in msg and "[0, 1]" in msg, msg


@pytest.mark.parametrize(
    "user_partitioned, gather",
    [(False, "per-layer"), (True, "per-layer"), (False, "once"), (True, "stationary")],
    ids=[
        "shardgen-partitioned",
        "user-partitioned",
        "shardgen-partitioned-gather-once",
        "user-partitioned-stationary-rank-away-8s",
    ],
)
def test_seed_script_through_engine_completes(dsworld, user_partitioned, gather):
    """The seed's uneven calls + default barrier, through shardgen.Engine(backend='deepspeed').
    Stationary (the seed's setup: offloaded parameters, rank 0 away for 8 s after its first
    call): rank 1's next calls finish while rank 0 is away, rank 0's driver serving them."""
    away = 8.0 if gather == "stationary" else 0.0
    r0, r1 = dsworld.run(sc.seed_script_engine, user_partitioned, gather, away, timeout=120)
    assert r0["policy"] == r1["policy"] == gather
    if away:
        assert r1["done_s"] < away < r0["done_s"], (r0["done_s"], r1["done_s"])
    assert (r0["calls"], r1["calls"]) == (2, 3)  # outputs equal HF: asserted in the ranks
    stats = [r0["stats"], r1["stats"]]
    assert [s["prefills"] for s in stats] == [2, 3] and [s["requests"] for s in stats] == [6, 9], stats
    if gather in ("per-layer", "stationary"):
        assert r0["stats"]["shadow_forwards"] > 0  # rank 0 kept rank 1's third call going
    else:
        assert r0["stats"]["shadow_forwards"] == r1["stats"]["shadow_forwards"] == 0, stats
    assert_lockstep(stats, one_forward_per_tick=gather != "once")
    assert r0["describe"]["offload_param"] == r1["describe"]["offload_param"] == "cpu"


@pytest.mark.parametrize("user_partitioned", [False, True], ids=["shardgen-partitioned", "user-partitioned"])
def test_moe_routing_does_not_change_gathers(dsworld, user_partitioned):
    """An MoE block whose experts run only when routed to is made a ZeRO-3 leaf (reinstalling the
    hooks of a user-partitioned model): real and shadow forwards route to different numbers of
    experts but issue the same gathers."""
    r0, r1 = dsworld.run(sc.toy_moe_lockstep, user_partitioned, timeout=60)
    for r in (r0, r1):
        assert r["leaf"] and r["same"], r
        assert all(d <= TOL for d in r["diffs"]), r["diffs"]
    assert r0["seq_lens"] == r1["seq_lens"]
    calls = set(r0["experts_called"]) | set(r1["experts_called"])
    assert len(calls) > 1, f"routing did not vary, the test proves nothing: {calls}"


def test_comm_layer_started_by_shardgen_builds_no_shm_op(dsworld):
    """DeepSpeed's CPU shm all-reduce op (a ~30 s JIT build) serves only tensor-parallel inference:
    shardgen starts the comm layer without it, and DeepSpeed's own function is put back."""
    for r, res in enumerate(dsworld.run(sc.comm_layer_state)):
        assert res == {"shm_op": False, "restored": True, "all_reduce": 3.0}, f"rank {r}: {res}"


def test_engine_leaves_glibcs_mmap_threshold_alone(dsworld):
    for r, res in enumerate(dsworld.run(pool_sc.allocator_untouched, "deepspeed", timeout=120)):
        if res["after"] is None:
            pytest.skip("no glibc mallinfo2")
        assert res["equal"], r
        assert res["after"] == 0, f"rank {r}: the engine fixed glibc's mmap threshold ({res})"


@pytest.mark.parametrize("bucket_mb", [None, 1e-4], ids=["buckets", "one-param-buckets"])
def test_gather_buffers_are_reused_across_forwards_and_emptied_at_pause_and_close(dsworld, bucket_mb):
    """The bucket plan and the row chunks gather into the backend's pool (``internals.PooledGather``):
    coalesced buckets copy out into a pooled bucket buffer, a one-parameter bucket is used where
    it was gathered."""
    runs = dsworld.run(pool_sc.pools_reused_and_emptied, "deepspeed", bucket_mb, timeout=120)
    for r, res in enumerate(runs):
        pool_sc.check_pools(r, res)


def test_seed_hang_plain_deepspeed_generate():
    """The seed report, asserted: plain DeepSpeed ZeRO-3 + HF generate, rank 0 makes 2 calls and
    rank 1 makes 3, then dist.barrier(): never finishes. The World kills the ranks by pid."""
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu"},
            "stage3_param_persistence_threshold": 8192,
            "memory_efficient_linear": False,
        },
    }
    with World(2, env=ENV, start_timeout=120.0) as world:
        world.run(sc.warm_up, timeout=300)  # so that the hang timeout does not include a JIT build
        with pytest.raises(WorldHang) as info:
            world.run(sc.seed_script_hangs, cfg, timeout=SEED_HANG_S)
        assert world.broken
    stacks = info.value.stacks
    assert "in barrier" in stacks[0], stacks[0]  # rank 0 finished its 2 calls
    assert "in generate" in stacks[1] and "in barrier" not in stacks[1], stacks[1]  # rank 1: third call


def test_refusals_of_a_user_partitioned_model(dsworld):
    """docs/DEEPSPEED.md, "A model the user partitioned": refused on every rank, before anything
    is changed, each with its documented error and message."""
    want = {
        "mixed": "ValueError: 1 of 22 parameters are not ZeRO-3 parameters",
        "stage": "ValueError: the DeepSpeed engine runs ZeRO stage 0, which does not partition parameters",
        "inflight": "RuntimeError: parameters [",  # its ds_id: a process-wide counter
        "inflight_then": "] have a gather in flight; create the backend between forwards",
        "gathered_open": "RuntimeError: a GatheredParameters context is open on this model; exit it first",
        "no_coordinator": "RuntimeError: this module has DeepSpeed ZeRO-3 hooks but shardgen cannot find "
        "their coordinator; pass the DeepSpeedEngine",
        "hpz": "ValueError: the model uses hpZ secondary partitions (zero_hpz_partition_size > 1)",
    }
    then = want.pop("inflight_then")[1:]
    for r in dsworld.run(sc.refusals, timeout=180):
        assert r["inflight"].split("]", 1)[1].startswith(then), r["inflight"]
        assert set(r) == set(want), r
        for case, said in want.items():
            assert r[case].startswith(said) and "moved" not in r[case], (case, r[case])


def test_real_models_refuse_a_backend_that_cannot_run_them(dsworld):
    """Issue 33: a DeepSpeedEngine given backend='fsdp2' was constructed and the first generate()
    died in backends/replica.py with a TypeError. Real objects of each kind, not look-alikes:
    refused at construction with both named; backend=None picks the model's own."""
    want = {
        "engine": "ValueError: backend='fsdp2' cannot run the model given: it is a DeepSpeedEngine",
        "engine_local": "ValueError: backend='local' cannot run the model given: it is a DeepSpeedEngine",
        "zero": "ValueError: backend='fsdp2' cannot run the model given: it is a ZeRO-3-partitioned module",
        "fsdp": "ValueError: backend='deepspeed' cannot run the model given: it is a module sharded with "
        "fully_shard",
    }
    for r in dsworld.run(sc.model_kinds, timeout=180):
        for case, said in want.items():
            assert r[case].startswith(said), (case, r[case])
        assert (r["engine_picks"], r["zero_picks"], r["fsdp_picks"]) == ("deepspeed", "deepspeed", "fsdp2")
