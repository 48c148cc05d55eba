"""Scenarios for tests/multirank/test_deepspeed_backend.py; they run inside gloo ranks of a World.

Every scenario first wraps the ``torch.distributed`` collectives of its rank with a recorder
(before DeepSpeed's comm layer binds them, which happens in the first scenario), so it can see
every collective a forward issues (op, group, size): the check that real and shadow forwards
match and that nothing runs on the default group. Nothing is patched in the pytest process.
"""

from __future__ import annotations

import importlib
import os
import threading
import time

import torch
import torch.distributed as dist
from models import batch, chunked_against_own_fill, tiny_model

from shardgen.generation.plan import IDLE_PLAN, Access

# ----------------------------------------------------------------------------- recorder
_RECS: list[list[tuple]] = []  # active recordings (nested, any thread)
_REC_LOCK = threading.Lock()
_GROUP_LABELS: dict[int, str] = {}
_OPS = (
    "all_gather_single",  # the chunked gathers' (torch 2.13); all_gather_into_tensor calls it, but
    # through distributed_c10d's own name, so a DeepSpeed gather is still recorded once
    "all_gather_into_tensor",
    "_all_gather_base",
    "all_gather",
    "broadcast",
    "all_reduce",
    "barrier",
    "reduce_scatter_tensor",
    "all_gather_object",
    "broadcast_object_list",
    "all_reduce_coalesced",
)


def _label(group) -> str:
    if group is None or group is dist.group.WORLD:
        return "default"
    return _GROUP_LABELS.get(id(group), "other")


def _wrap(name: str):
    orig = getattr(dist, name)
    if getattr(orig, "_ds_scenarios_wrapped", False):
        return

    def recorded(*args, **kwargs):
        if _RECS:
            group = kwargs.get("group")
            if group is None:
                group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
            t = kwargs.get("output_tensor", kwargs.get("tensor"))
            if t is None:
                t = next((a for a in args if isinstance(a, torch.Tensor)), None)
            entry = (name, _label(group), int(t.numel()) if t is not None else -1)
            with _REC_LOCK:
                for rec in _RECS:
                    rec.append(entry)
        return orig(*args, **kwargs)

    recorded._ds_scenarios_wrapped = True
    setattr(dist, name, recorded)


def install_recorder() -> None:
    """Idempotent; call at the start of every scenario (inside a rank)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for name in _OPS:
        if hasattr(dist, name):
            _wrap(name)


class record:
    """``with record() as rec:`` -> rec.calls: the collectives issued inside (any thread)."""

    def __enter__(self):
        self.calls = []
        with _REC_LOCK:
            _RECS.append(self.calls)
        return self

    def __exit__(self, *exc):
        with _REC_LOCK:
            _RECS[:] = [r for r in _RECS if r is not self.calls]


# ----------------------------------------------------------------------------- helpers
def _param_group():
    group = dist.new_group(backend="gloo")
    _GROUP_LABELS[id(group)] = "param"
    return group


def _pair(arch: str = "llama", seed: int = 0):
    """(model to shard, unsharded reference with the same weights)."""
    model = tiny_model(arch, seed=seed)
    ref = tiny_model(arch, seed=seed)
    ref.load_state_dict(model.state_dict())
    return model, ref.eval()


def _ref_logits(ref, ids, mask=None):
    with torch.no_grad():
        return ref(input_ids=ids, attention_mask=mask).logits


def _create(model, group, ds_config=None, **options):
    from shardgen.backends.deepspeed import DeepSpeedBackend

    return DeepSpeedBackend.create(
        model, param_group=group, device=torch.device("cpu"), ds_config=ds_config, **options
    )


def _ds_initialize(model, offload: bool):
    import deepspeed

    zero = {"stage": 3, "memory_efficient_linear": False}
    if offload:
        zero["offload_param"] = {"device": "cpu"}
    engine, *_ = deepspeed.initialize(
        model=model, config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero}
    )
    return engine


def _plan(backend):
    """The plan the driver gives a forward: on the replica once gathered, else gathered per layer."""
    return IDLE_PLAN.agreed(Access.PER_LAYER if backend.lockstep else Access.REPLICA)


def _forward_checked(backend, ref, lengths, seed):
    ids, mask = batch(lengths, seed=seed)
    with record() as rec:
        out = backend.forward(_plan(backend), {"input_ids": ids, "attention_mask": mask, "use_cache": False})
    diff = (out.logits - _ref_logits(ref, ids, mask)).abs().max().item()
    return diff, rec.calls


def gathers(calls: list[tuple], world: int | None = None) -> int:
    """Parameter gathers among recorded ``calls``: an all-gather each, or, written in place into a
    pooled buffer (CPU, ``buffer_pool.gather_in_place``), one broadcast per rank of the group (of
    ``world`` ranks, default this rank's world)."""
    world = world if world is not None else dist.get_world_size()
    broadcasts = sum(1 for c in calls if c[0] == "broadcast")
    assert broadcasts % world == 0, calls
    all_gathers = sum(1 for c in calls if c[0].startswith("all_gather") or c[0] == "_all_gather_base")
    return all_gathers + broadcasts // world


def _shadow(backend):
    with record() as rec:
        backend.shadow_forward(_plan(backend))
    return rec.calls


# ----------------------------------------------------------------------------- scenarios
def warm_up() -> bool:
    """Import DeepSpeed and start its comm layer (the first time ever, it JIT-builds a comm op)."""
    install_recorder()
    import deepspeed

    from shardgen.backends.deepspeed.internals import ensure_ds_comm

    ensure_ds_comm(deepspeed)
    return True


def comm_layer_state() -> dict:
    """After warm_up (shardgen started DeepSpeed's comm layer): was its CPU shm op built?"""
    from deepspeed.comm import comm as ds_comm

    ds_torch = importlib.import_module("deepspeed.comm.torch")

    return {
        "shm_op": ds_comm.cdb.shm_comm_op is not None,
        "restored": ds_torch.build_shm_op.__name__ == "build_shm_op",
        "all_reduce": _all_reduce_through_ds(),
    }


def _all_reduce_through_ds() -> float:
    from deepspeed import comm as ds_comm

    t = torch.ones(4) * (dist.get_rank() + 1)
    ds_comm.inference_all_reduce(t, op=dist.ReduceOp.SUM)  # falls back to the process group
    return float(t[0])


def logits_match(arch: str = "llama", offload: bool = False) -> dict:
    """Shardgen partitions a plain model on a private group; logits equal the unsharded model's."""
    install_recorder()
    from deepspeed.utils import z3_leaf_module

    group = _param_group()
    model, ref = _pair(arch)
    cfg = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}} if offload else None
    backend = _create(model, group, cfg)
    part_numel = sum(p.ds_tensor.numel() for p in backend.module.parameters())
    diff, calls = _forward_checked(backend, ref, [5, 3], seed=dist.get_rank())
    backend.use_buckets(8192)  # several small buckets: tied weights and leaves across buckets
    diff_small, calls_small = _forward_checked(backend, ref, [4, 6], seed=dist.get_rank())
    n_small = len(backend.buckets)
    backend.gather_all()  # the plain replica: tied weights, buffers, MoE experts
    diff_replica, calls_replica = _forward_checked(backend, ref, [2, 5], seed=dist.get_rank())
    backend.close()
    return {
        "diff": diff,
        "diff_small_buckets": diff_small,
        "small_buckets": (n_small, gathers(calls_small)),
        "diff_replica": diff_replica,
        "replica_calls": calls_replica,
        "replica_freed": backend.gathered_bytes() == 0,
        "groups": sorted({c[1] for c in calls}),
        "n_gathers": len(calls),
        "partitioned": part_numel < sum(p.numel() for p in ref.parameters()),
        "leaves": sorted({type(m).__name__ for m in backend.module.modules() if z3_leaf_module(m)}),
        "describe": backend.describe(),
        "full_bytes_ok": backend.full_param_bytes() == sum(p.numel() * 4 for p in ref.parameters()),
        "chunks": backend.chunked.describe() if backend.chunked is not None else {},
    }


def lockstep_uneven(bucket_bytes: int | None = None) -> dict:
    """Rank 0: 3 real forwards; rank 1: shadow, real, shadow. Then a ``once`` phase with an
    unequal number of local forwards, and lockstep again. Every forward's collectives recorded.
    ``bucket_bytes``: the gather plan's bucket size (None: the default)."""
    install_recorder()
    rank = dist.get_rank()
    group = _param_group()
    model, ref = _pair("llama")
    backend = _create(model, group, **({} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}))
    n_units = len(backend.units())
    n_buckets = len(backend.buckets) if backend.buckets is not None else None
    prefetch = backend.buckets.prefetch if backend.buckets is not None else None
    seqs, diffs = [], []
    plan = ["real", "real", "real"] if rank == 0 else ["shadow", "real", "shadow"]
    shapes = [[5, 3], [7], [2, 6, 4]]
    for i, step in enumerate(plan):
        if step == "real":
            d, calls = _forward_checked(backend, ref, shapes[i] if rank == 0 else [3], seed=10 * rank + i)
            diffs.append(d)
        else:
            calls = _shadow(backend)
        seqs.append(calls)

    # gather policy 'once': no collectives, ranks forward independently (3 vs 1 times)
    with record() as rec_gather:
        backend.gather_all()
    local = []
    for i in range(3 if rank == 0 else 1):
        d, calls = _forward_checked(backend, ref, [4 + i], seed=100 + i)
        diffs.append(d)
        local.append(calls)
    with record() as rec_release:
        backend.release_all()

    # back to lockstep with different trace histories on the two ranks
    for i in range(2):
        if (rank + i) % 2 == 0:
            d, calls = _forward_checked(backend, ref, [3, 3], seed=200 + i)
            diffs.append(d)
        else:
            calls = _shadow(backend)
        seqs.append(calls)
    backend.close()
    return {
        "seqs": seqs,
        "diffs": diffs,
        "local_calls": local,
        "gather_all_calls": rec_gather.calls,
        "release_all_calls": rec_release.calls,
        "lockstep_flag_after": backend.lockstep,
        "n_units": n_units,
        "n_buckets": n_buckets,
        "prefetch": prefetch,
        "chunks": backend.chunked.describe() if backend.chunked is not None else {},
    }


def _threaded_forwards(backend, ref, n: int, delay: float, real: bool, box: dict):
    try:
        time.sleep(delay)
        for i in range(n):
            if real:
                d, calls = _forward_checked(backend, ref, [4, 2], seed=300 + i)
                box.setdefault("diffs", []).append(d)
            else:
                backend.shadow_forward(_plan(backend))
        box["done"] = True
    except BaseException as exc:  # reported to the test
        box["error"] = repr(exc)


def user_model_private_group(pass_engine: bool, offload: bool, move: bool = True) -> dict:
    """A model the user partitioned with deepspeed.initialize (default group); shardgen moves its
    gathers to a private group. Engine forwards run in a background thread while the other rank's
    main thread is already inside ``dist.barrier()`` on the default group: this only completes if
    no gather uses the default group (else rank 1's barrier pairs with rank 0's first all-gather).
    ``move=False`` is the negative control (documents the hang; not run by the test suite)."""
    install_recorder()
    rank = dist.get_rank()
    model, ref = _pair("llama", seed=3)
    engine = _ds_initialize(model, offload)
    group = _param_group()
    before = {_label(p.ds_process_group) for p in engine.module.parameters()}
    if move:
        backend = _create(engine if pass_engine else engine.module, group)
    else:
        from shardgen.backends.deepspeed import DeepSpeedBackend
        from shardgen.backends.deepspeed.internals import install_trace_check_switch

        install_trace_check_switch()  # only the all-gathers stay on the default group
        backend = DeepSpeedBackend(
            engine.module,
            engine.module,
            torch.device("cpu"),
            offload=engine.optimizer,
            param_group=group,
            offload_device="?",
            created=False,
        )
    after = {_label(p.ds_process_group) for p in backend.module.parameters()}
    box: dict = {}
    t = threading.Thread(
        target=_threaded_forwards,
        name="ds-test-engine",
        args=(backend, ref, 3, 0.0 if rank == 0 else 0.5, rank == 0, box),
    )
    with record() as rec:
        t0 = time.monotonic()
        t.start()
        if rank == 0:
            t.join(30)
            time.sleep(0.2)
        dist.barrier()  # rank 1 gets here first, while its engine thread still has 3 forwards to go
        t.join(30)
        elapsed = time.monotonic() - t0
    backend.close()
    return {
        "before": sorted(before),
        "after": sorted(after),
        "box": box,
        "elapsed": elapsed,
        "alive": t.is_alive(),
        "default_calls": [c for c in rec.calls if c[1] == "default"],
        "param_calls": len([c for c in rec.calls if c[1] == "param"]),
        "describe": backend.describe(),
    }


def zero_init_model_without_engine() -> dict:
    """A model partitioned by zero.Init alone (no deepspeed.initialize, so no hooks): shardgen
    moves it to its group and installs the hooks itself."""
    install_recorder()
    import deepspeed

    model, ref = _pair("llama", seed=4)
    deepspeed.zero.Init(
        module=model,
        config_dict_or_path={
            "train_micro_batch_size_per_gpu": 1,
            "zero_optimization": {"stage": 3, "memory_efficient_linear": False},
        },
    )
    group = _param_group()
    backend = _create(model, group)
    diff, calls = _forward_checked(backend, ref, [3, 4], seed=dist.get_rank())
    shadow = _shadow(backend)
    backend.close()
    return {"diff": diff, "groups": sorted({c[1] for c in calls}), "same": calls == shadow, "n": len(calls)}


def mismatched_group_raises() -> str:
    """A model partitioned over a one-rank group cannot move to the two-rank param group."""
    install_recorder()
    import deepspeed

    singles = [dist.new_group([r], backend="gloo") for r in range(dist.get_world_size())]
    mine = singles[dist.get_rank()]
    group = _param_group()
    model = tiny_model("llama")
    deepspeed.zero.Init(
        module=model,
        data_parallel_group=mine,
        config_dict_or_path={
            "train_micro_batch_size_per_gpu": 1,
            "zero_optimization": {"stage": 3, "memory_efficient_linear": False},
        },
    )
    try:
        _create(model, group)
    except ValueError as exc:
        return str(exc)
    return "no error"


def seed_script_hangs(ds_config: dict) -> list[int]:
    """The seed report: plain DeepSpeed ZeRO-3 + HF generate, uneven calls, then a barrier.

    ``synced_gpus=True`` is what generate() picks by itself under ZeRO-3 (via HfDeepSpeedConfig,
    which needs accelerate, absent here); it keeps ranks together inside one call only."""
    install_recorder()
    import deepspeed

    model = tiny_model("llama")
    engine, *_ = deepspeed.initialize(model=model, config=ds_config)
    model = engine.module
    calls = 2 if dist.get_rank() == 0 else 3
    for i in range(calls):
        ids, mask = batch([4, 3], seed=i)
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, synced_gpus=True)
    dist.barrier()
    return [calls]


def seed_script_engine(user_partitioned: bool, gather: str = "per-layer", away_s: float = 0.0) -> dict:
    """The seed script through shardgen.Engine(backend='deepspeed'): rank 0 makes 2 generate
    calls, rank 1 makes 3, then a default-group barrier. Outputs equal HF generate. ``away_s``:
    rank 0 is away that long after its first call (the seed's busy rank), while rank 1 goes on."""
    install_recorder()
    from models import hf_generate

    import shardgen

    ref = tiny_model("llama", seed=14)
    model = tiny_model("llama", seed=14)
    if user_partitioned:
        model = _ds_initialize(model, offload=True)
        eng = shardgen.Engine(model, backend="deepspeed", gather=gather)
    else:
        eng = shardgen.Engine(
            model,
            backend="deepspeed",
            gather=gather,
            debug_collectives=True,
            ds_config={"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}},
        )
    ids, mask = batch([3, 6, 2], seed=30)
    calls = 2 if dist.get_rank() == 0 else 3
    t0 = time.monotonic()
    for c in range(calls):
        got = eng.generate_ids((ids + c) * mask, attention_mask=mask, max_new_tokens=12)
        exp = hf_generate(ref, (ids + c) * mask, mask, max_new_tokens=12)
        assert torch.equal(got, exp), f"rank {dist.get_rank()} call {c}: {got.tolist()} != HF {exp.tolist()}"
        if c == 0 and dist.get_rank() == 0:
            time.sleep(away_s)
    done_s = time.monotonic() - t0
    dist.barrier()
    eng.close()
    return {"calls": calls, "stats": eng.stats(), "describe": eng.backend.describe(), "done_s": done_s,
            "policy": eng.gather_policy}  # fmt: skip


class ToySparseMoeBlock(torch.nn.Module):
    """Old-style MoE: a ModuleList of experts, each called only for the tokens routed to it, so
    without a ZeRO-3 leaf the set of modules a forward calls depends on the data."""

    def __init__(self, hidden: int, n_experts: int = 4):
        super().__init__()
        self.gate = torch.nn.Linear(hidden, n_experts, bias=False)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(n_experts))
        self.calls: list[int] = []

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        choice = self.gate(flat).argmax(-1)
        out = torch.zeros_like(flat)
        for e in choice.unique().tolist():
            rows = choice == e
            out[rows] = self.experts[e](flat[rows])
            self.calls.append(e)
        return out.reshape(x.shape)


def _toy_moe_model(seed: int):
    model = tiny_model("llama", seed=seed)
    torch.manual_seed(seed)
    for layer in model.model.layers:
        layer.mlp = ToySparseMoeBlock(model.config.hidden_size)
    return model.eval()


def toy_moe_lockstep(user_partitioned: bool) -> dict:
    """Routing differs between a real batch and the 1x1 shadow input, yet the gathers match."""
    install_recorder()
    from deepspeed.utils import z3_leaf_module

    rank = dist.get_rank()
    model, ref = _toy_moe_model(5), _toy_moe_model(5)
    ref.load_state_dict(model.state_dict())
    group = _param_group()
    backend = _create(_ds_initialize(model, offload=False) if user_partitioned else model, group)
    blocks = [m for m in backend.module.modules() if isinstance(m, ToySparseMoeBlock)]
    seqs, diffs, experts_called = [], [], []
    for i in range(3):
        for b in blocks:
            b.calls.clear()
        if (rank + i) % 2 == 0:
            d, calls = _forward_checked(backend, ref, [6, 5], seed=40 + 10 * rank + i)
            diffs.append(d)
        else:
            calls = _shadow(backend)
        seqs.append(calls)
        experts_called.append(sum(len(b.calls) for b in blocks))
    backend.close()
    return {
        "leaf": all(z3_leaf_module(b) for b in blocks),
        "seq_lens": [len(s) for s in seqs],
        "same": all(s == seqs[0] for s in seqs),
        "experts_called": experts_called,
        "diffs": diffs,
    }


def _zero_init_model(seed: int = 5, **zero):
    """A tiny Llama partitioned by ``zero.Init`` alone, on the world (collective: broadcasts)."""
    import deepspeed

    model = tiny_model("llama", seed=seed)
    cfg = {"stage": 3, "memory_efficient_linear": False, **zero}
    deepspeed.zero.Init(
        module=model, config_dict_or_path={"train_micro_batch_size_per_gpu": 1, "zero_optimization": cfg}
    )
    return model


def refusals() -> dict[str, str]:
    """DEEPSPEED.md's refusals of a user-partitioned model, each ``type: message`` (or "no error"):
    a mix of ZeRO and plain parameters, a DeepSpeedEngine below stage 3, a gather in flight, an
    open ``GatheredParameters``, hooks whose coordinator cannot be found, hpZ secondary partitions.
    Every rank builds the same models in the same order (``zero.Init`` and ``deepspeed.initialize``
    are collective on the world); the refusals themselves are local."""
    install_recorder()
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    group = _param_group()
    out: dict[str, str] = {}

    def attempt(case: str, model) -> None:
        try:
            _create(model, group).close()
        except (ValueError, RuntimeError) as e:
            out[case] = f"{type(e).__name__}: {e}"
        else:
            out[case] = "no error"
        module = getattr(model, "module", model)
        if any(getattr(p, "ds_process_group", None) is group for p in module.parameters()):
            out[case] += " (and moved to shardgen's group)"  # refused only after changing it

    model = _zero_init_model()
    model.register_parameter("plain", torch.nn.Parameter(torch.zeros(3)))  # not converted
    attempt("mixed", model)

    engine, *_ = deepspeed.initialize(
        model=tiny_model("llama", seed=5),
        config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0}},
    )
    attempt("stage", engine)

    model = _zero_init_model()
    p = next(model.parameters())
    p.ds_status = ZeroParamStatus.INFLIGHT  # as a forward of another thread leaves it mid-gather
    attempt("inflight", model)
    p.ds_status = ZeroParamStatus.NOT_AVAILABLE

    with deepspeed.zero.GatheredParameters([p]):  # collective: both ranks enter and leave it
        attempt("gathered_open", model)

    engine = _ds_initialize(tiny_model("llama", seed=5), offload=False)
    module = engine.module
    module._forward_pre_hooks.clear()  # the root hook that leads to the coordinator: gone
    attempt("no_coordinator", module)

    from deepspeed.utils import groups

    try:
        model = _zero_init_model(zero_hpz_partition_size=2)
    except Exception as e:  # what DeepSpeed says, for the test's message
        out["hpz"] = f"zero.Init failed: {type(e).__name__}: {e}"
    else:
        attempt("hpz", model)
    finally:
        # zero.Init keeps the hpZ group it made in a DeepSpeed global, and every later ZeRO-3
        # model of the process would take secondary partitions from it: the World's next
        # scenario (another test module's) must find DeepSpeed as it was.
        hpz = groups._ZERO_PARAM_INTRA_PARALLEL_GROUP
        if hpz is not None:
            groups._release_process_group_references(hpz)
    return out


def model_kinds() -> dict[str, str]:
    """Real models of each kind (a ZeRO-3 ``DeepSpeedEngine``, a ``zero.Init`` module, a
    ``fully_shard``-ed module), each handed to ``shardgen.Engine`` with a backend that cannot run
    it: ``type: message`` of each refusal (local, before any collective), and what
    ``backend=None`` picks for each. Every rank builds the same models in the same order."""
    from torch.distributed.fsdp import fully_shard

    import shardgen
    from shardgen.backends.kinds import backend_for

    out: dict[str, str] = {}
    engine = _ds_initialize(tiny_model("llama", seed=5), offload=False)
    zero = _zero_init_model()
    fsdp = tiny_model("llama", seed=5)
    for layer in fsdp.model.layers:
        fully_shard(layer)
    fully_shard(fsdp)
    for case, model, backend in [("engine", engine, "fsdp2"), ("engine_local", engine, "local"),
                                 ("zero", zero, "fsdp2"), ("fsdp", fsdp, "deepspeed")]:  # fmt: skip
        try:
            shardgen.Engine(model, backend=backend).close()
        except ValueError as e:
            out[case] = f"ValueError: {e}"
        else:
            out[case] = "no error"
    for case, model in [("engine", engine), ("zero", zero), ("fsdp", fsdp)]:
        out[f"{case}_picks"] = backend_for(None, model)
    return out


def whole_gather_equals_bucketed() -> list[dict]:
    """``gather_all`` on DeepSpeed in chunks of many flat partitions (``backends/whole.py``)
    against DeepSpeed's own coalesced gathers bucket by bucket, and both against the unsharded
    model: partitions padded on the last rank (an odd hidden size), tied embeddings, offload to
    the CPU, and a chunk budget smaller than the model (several chunks)."""
    cases = [
        ("gpt2-odd-tied", "gpt2", dict(n_embd=33, n_head=3), None, None),
        ("llama-offload", "llama", dict(vocab_size=97), {"zero_optimization": {"stage": 3,
            "offload_param": {"device": "cpu"}}}, None),
        ("llama-small-chunks", "llama", {}, None, 4096),
    ]  # fmt: skip
    out = []
    for name, arch, over, cfg, budget in cases:
        model, ref = tiny_model(arch, seed=4, **over), tiny_model(arch, seed=4, **over)
        b = _create(model, _param_group(), cfg)
        if budget is not None:
            b.WHOLE_CHUNK_BYTES = budget
        out.append({"case": name, **chunked_against_own_fill(b, ref)})
    return out
