"""Scenarios for tests/multirank/test_rollout_multirank.py (they run inside gloo ranks of a World), and the
checks on a ``RolloutBatch`` that tests/unit/test_rollout.py shares."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from models import batch, tiny_model

EOS = list(range(2, 10))  # many EOS ids: a random tiny model stops at different steps


# ----------------------------------------------------------------------------- checks
def teacher_forced_logprobs(model, b, temperature: float) -> torch.Tensor:
    """[R, G] log p of every response token, one unpadded forward per row (0 where masked)."""
    out = torch.zeros_like(b.logprobs)
    p_width = b.prompt_width
    for i in range(len(b)):
        p, g = int(b.prompt_lengths[i]), int(b.response_lengths[i])
        ids = b.input_ids[i, p_width - p : p_width + g][None]
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].float()
        lp = torch.log_softmax(logits[p - 1 : p - 1 + g] / temperature, -1)
        out[i, :g] = lp.gather(-1, ids[0, p:, None]).squeeze(-1)
    return out


def check_layout(b, pad_id: int) -> None:
    """Every invariant of the padded layout, row by row."""
    p_width = b.prompt_width
    for i in range(len(b)):
        p, g = int(b.prompt_lengths[i]), int(b.response_lengths[i])
        mask = b.response_mask[i].tolist()
        assert mask == [1] * g + [0] * (len(mask) - g), f"row {i}: response_mask {mask} not a prefix"
        assert b.attention_mask[i].tolist() == [0] * (p_width - p) + [1] * (p + g) + [0] * (len(mask) - g)
        assert all(t == pad_id for t in b.response_ids[i, g:].tolist())
        assert all(t == pad_id for t in b.input_ids[i, : p_width - p].tolist())
        assert torch.all(b.logprobs[i, g:] == 0) and torch.all(b.logprobs[i, :g] <= 0)


def rows(b) -> list[tuple]:
    """Each row's content, bit for bit: ids, masks, logprobs, seed, finish reason."""
    return [
        (b.input_ids[i].tolist(), b.attention_mask[i].tolist(), b.response_mask[i].tolist(),
         b.logprobs[i].tolist(), b.seeds[i], b.finish_reasons[i])
        for i in range(len(b))
    ]  # fmt: skip


def id_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    ids, mask = batch(lengths, seed=seed)
    return [row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True)]


# ----------------------------------------------------------------------------- helpers
DS_ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


@contextlib.contextmanager
def ds_world(n: int) -> Iterator[Any]:
    """A World of ``n`` gloo ranks with DeepSpeed's CPU accelerator set and its comm layer
    started (``warm_up``: the first start ever JIT-builds an op), so that no test's bound
    includes that start; closed (its ranks killed by pid) on the way out."""
    from world import World

    world = World(n, env=DS_ENV, start_timeout=120.0)
    try:
        world.run(warm_up, timeout=300)
        yield world
    finally:
        world.close()


def warm_up() -> bool:
    """Import DeepSpeed and start its comm layer (the first time ever it JIT-builds an op)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    from shardgen.backends.deepspeed import internals

    internals.ensure_ds_comm(deepspeed)
    return True


def _pair(seed: int = 7):
    model = tiny_model("llama", seed=seed)
    ref = tiny_model("llama", seed=seed)
    ref.load_state_dict(model.state_dict())
    return model, ref


def _user_fsdp2(model):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _ds_initialize(model, lr: float):
    import deepspeed

    opt = torch.optim.SGD(model.parameters(), lr=lr)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1000},
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    return engine


# ----------------------------------------------------------------------------- scenarios
def logprobs_sharded(backend: str) -> dict:
    """Uneven rollouts (rank 0: 2 prompts, rank 1: 1 prompt, then zero) on a model shardgen shards;
    logprobs against a teacher-forced forward of an unsharded copy, at T = 0.7 and 1.0."""
    import shardgen

    rank = dist.get_rank()
    model, ref = _pair()
    prompts = id_prompts([5, 8] if rank == 0 else [4], seed=rank)
    diffs, reasons = {}, []
    with shardgen.Engine(model, backend=backend) as eng:
        for t in (0.7, 1.0):
            b = eng.rollout(
                prompts, n=2, temperature=t, top_k=40, seed=rank, max_new_tokens=10, eos_token_id=EOS
            )
            check_layout(b, pad_id=0)
            diffs[t] = (b.logprobs - teacher_forced_logprobs(ref, b, t)).abs().max().item()
            reasons += b.finish_reasons
        t0 = time.monotonic()
        empty = eng.rollout([], n=4) if rank == 1 else None
        empty_s = time.monotonic() - t0
    return {
        "diffs": diffs,
        "reasons": reasons,
        "empty": None if empty is None else len(empty),
        "empty_s": empty_s,
    }


def share_on_off(backend: str, gather: str = "per-layer", max_prefill_tokens: int | None = None) -> dict:
    """Rollouts at n = 1, 3 and 8 with ``share_prefill`` on, then off, on a model shardgen shards,
    batches of 5 (groups split, waiting, refilled): rank 0 holds 3 prompts then 2, rank 1 one
    prompt then none; ``max_prefill_tokens`` for sharing on (off: one-shot prefills). ->
    {share: (rows of each rollout, prefill tokens), "policy": the engine's gather policy}."""
    import shardgen

    rank = dist.get_rank()
    prompt_sets = [id_prompts([5, 9, 3], seed=1), id_prompts([6, 4], seed=2)] if rank == 0 else [
        id_prompts([7], seed=3), []]  # fmt: skip
    out = {}
    for share in (True, False):
        model = tiny_model("llama", seed=7)
        kw = dict(backend=backend, gather=gather, share_prefill=share, max_batch_size=5)
        kw["max_prefill_tokens"] = max_prefill_tokens if share else None
        with shardgen.Engine(model, **kw) as eng:
            got = [
                rows(eng.rollout(prompts, n=n, seed=4, max_new_tokens=8, eos_token_id=EOS, temperature=0.9))
                for n in (1, 3, 8)
                for prompts in prompt_sets
            ]
        out[share] = (got, eng.stats()["prefill_tokens"])
        out["policy"] = eng.gather_policy
    return out


def _train_step(step_model, opt, ids, ds: bool) -> float:
    out = step_model(input_ids=ids, labels=ids)
    if ds:
        step_model.backward(out.loss)
        step_model.step()
    else:
        out.loss.backward()
        opt.step()
        opt.zero_grad()
    return float(out.loss.detach())


def train_between(mode: str, steps: int = 3) -> dict:
    """rollout, train, rollout, train... with uneven prompt counts and EOS steps, against the same
    training steps without an engine. ``mode``: ``fsdp2-user`` (a user ``fully_shard`` model),
    ``fsdp2`` (shardgen shards it) or ``deepspeed`` (a ``deepspeed.initialize`` ZeRO-3 engine)."""
    import shardgen

    rank = dist.get_rank()
    lr = 0.5
    ids = batch([6, 6], seed=100 + rank)[0]

    def build():
        """(model to step, what to give the Engine): a fresh model with the same weights."""
        model = tiny_model("llama", seed=7).train()
        if mode == "deepspeed":
            eng = _ds_initialize(model, lr)
            return eng, eng
        return (_user_fsdp2(model) if mode == "fsdp2-user" else model), model

    def optimizer(model):
        return None if mode == "deepspeed" else torch.optim.SGD(model.parameters(), lr=lr)

    # 1. the same training steps, no engine (shardgen's fsdp2 sharding = a user fully_shard)
    step_model, _ = build()
    if mode == "fsdp2":
        _user_fsdp2(step_model)
    opt = optimizer(step_model)
    base = [_train_step(step_model, opt, ids, mode == "deepspeed") for _ in range(steps + 1)]
    del step_model, opt

    # 2. with an engine open: rollouts in between, training inside paused(); one more step after close
    step_model, target = build()
    backend = "deepspeed" if mode == "deepspeed" else "fsdp2"
    losses, changed, restored = [], [], []
    prompts = id_prompts([5, 7, 3] if rank == 0 else [6], seed=rank)
    with shardgen.Engine(target, backend=backend) as eng:
        opt = optimizer(step_model)  # after the engine: shardgen may have sharded the model
        prev = None
        for _ in range(steps):
            b = eng.rollout(prompts, n=2, seed=5, max_new_tokens=8, eos_token_id=EOS, temperature=0.8)
            if prev is not None:
                changed.append(not torch.equal(b.logprobs, prev.logprobs))
                # the driver re-applied shardgen's setup before that rollout
                restored.append(mode == "fsdp2" or not _user_setup_in_place(eng, mode))
            prev = b
            with eng.paused():
                restored.append(_user_setup_in_place(eng, mode))
                losses.append(_train_step(step_model, opt, ids, mode == "deepspeed"))
    restored.append(_user_setup_in_place(eng, mode))  # closed: the model is handed back as it came
    losses.append(_train_step(step_model, opt, ids, mode == "deepspeed"))
    return {"base": base, "losses": losses, "changed": changed, "restored": restored}


def _user_setup_in_place(eng, mode: str) -> bool:
    """Does the model run on the user's own setup now (checked inside and after a pause)?"""
    if mode == "fsdp2":
        from shardgen.backends.fsdp2 import FSDP2Backend

        assert isinstance(eng.backend, FSDP2Backend)
        return True  # shardgen's own sharding: nothing of the user's to restore but reshard flags
    if mode == "fsdp2-user":
        from shardgen.backends.fsdp2 import mesh_infos

        return all(i.shard_process_group is dist.group.WORLD for i in mesh_infos(eng.backend.module))
    coord = eng.backend.offload.get_param_coordinator()
    params = list(eng.backend.module.parameters())
    return (
        coord._PartitionedParameterCoordinator__prefetch_bucket_sz > 0
        and all(p.ds_process_group is not eng.backend.param_group for p in params)
        and any(p.ds_persist for p in params)
    )


def _hooks(model) -> int:
    """Forward hooks and pre-hooks on every module of ``model``."""
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


def engines_leave_the_model(mode: str, engines: int = 4) -> dict:
    """``engines`` engines opened on one user-sharded model (``fsdp2-user`` or ``deepspeed``), one
    after the other, each with a rollout and a training step inside ``paused()``, every other one
    with ``debug_collectives`` (its own hooks), then closed: the model keeps no hook of theirs,
    nothing keeps a closed engine's backend (and so its groups and their gloo threads) alive,
    and the native threads come back to their count before the first."""
    import gc
    import weakref

    import shardgen

    rank = dist.get_rank()
    model = tiny_model("llama", seed=7).train()
    ids = batch([6, 6], seed=100 + rank)[0]
    if mode == "deepspeed":
        step_model = target = _ds_initialize(model, 0.1)
        opt, module = None, step_model.module
    else:
        step_model = target = module = _user_fsdp2(model)
        opt = torch.optim.SGD(step_model.parameters(), lr=0.1)
    backend = "deepspeed" if mode == "deepspeed" else "fsdp2"
    prompts = id_prompts([5, 3] if rank == 0 else [4], seed=rank)

    def one(debug: bool) -> Any:
        eng = shardgen.Engine(target, backend=backend, debug_collectives=debug)
        eng.rollout(prompts, n=2, seed=5, max_new_tokens=4, eos_token_id=EOS, temperature=0.8)
        with eng.paused():
            _train_step(step_model, opt, ids, mode == "deepspeed")
        eng.close()
        return weakref.ref(eng.backend)

    one(False)  # warm-up: what stays by design (torch's lazy state) exists before the baseline
    gc.collect()
    hooks, threads = _hooks(module), len(os.listdir("/proc/self/task"))
    backends = [one(debug=i % 2 == 1) for i in range(engines)]
    gc.collect()
    deadline = time.monotonic() + 5.0  # a peer's sockets close a moment after its own collection
    while len(os.listdir("/proc/self/task")) != threads and time.monotonic() < deadline:
        time.sleep(0.1)
    _train_step(step_model, opt, ids, mode == "deepspeed")  # still trains on the user's setup
    return {
        "hooks": (hooks, _hooks(module)),
        "threads": (threads, len(os.listdir("/proc/self/task"))),
        "alive": [b() is not None for b in backends],
    }


# ----------------------------------------------------------------------------- partial rollouts
SHRINK = 0.97  # the "training step" inside each pause: every weight times this (exact on any shard)


def shrink_weights(model, steps: int = 1) -> None:
    """Every weight times ``SHRINK ** steps``, in place, on the shards of whatever holds it: an
    FSDP2 DTensor's local shard, a ZeRO-3 parameter's partition, a plain tensor. Elementwise, so
    an unsharded copy shrunk the same way has the same bits."""
    with torch.no_grad():
        for p in model.parameters():
            for _ in range(steps):
                (p.ds_tensor if hasattr(p, "ds_tensor") else p).mul_(SHRINK)


def slow_forwards(eng: Any, seconds: float = 0.003) -> None:
    """Every forward of ``eng`` takes ``seconds`` longer: held rows still decode when a call returns."""
    real = eng.backend.forward

    def slow(plan: Any, inputs: Any) -> Any:
        time.sleep(seconds)
        return real(plan, inputs)

    eng.backend.forward = slow


def check_versions(b, ref, temperature: float, greedy: bool) -> int:
    """Each drawn response token against the weights of its version (``b.versions``; version v =
    ``ref`` shrunk v times): its logprob (teacher forcing, one unpadded row) within 1e-5 and,
    greedy, its being the argmax (near-ties aside): a row resumed after a step equals its prompt
    plus prefix fed to the new weights. -> rows whose tokens span two versions."""
    import copy

    spans, models = 0, {}
    p_width = b.prompt_width
    for i in range(len(b)):
        p, g = int(b.prompt_lengths[i]), int(b.response_lengths[i])
        ids = b.input_ids[i, p_width - p : p_width + g][None]
        vs = b.versions[i, :g].tolist()  # -1 on an environment's tokens (multi-turn), not drawn
        drawn = [v for v in vs if v >= 0]
        assert drawn == sorted(drawn) and len(drawn) == int(b.response_mask[i, :g].sum()), f"row {i}: {vs}"
        spans += len(set(drawn)) > 1
        for v in sorted(set(drawn)):
            if v not in models:
                models[v] = copy.deepcopy(ref)
                shrink_weights(models[v], v)
            with torch.no_grad():
                logits = models[v](input_ids=ids).logits[0, p - 1 : p - 1 + g].float()
            lp = torch.log_softmax(logits / temperature, -1)
            for j in (j for j in range(g) if vs[j] == v):
                tok = int(ids[0, p + j])
                diff = abs(float(lp[j, tok]) - float(b.logprobs[i, j]))
                assert diff < 1e-5, f"row {i} token {j} (version {v}): logprob {diff:.3g} off"
                if greedy:
                    gap = float(lp[j].max() - lp[j, tok])
                    assert gap < 1e-4, f"row {i} token {j} (version {v}): not the argmax ({gap:.3g})"
    return spans


@contextlib.contextmanager
def cheap_columns() -> Iterator[None]:
    """A verify forward's columns priced as before any is measured (nearly free), in this rank's
    process until the block ends: whether drafts run does not hang on the machine's timings
    (tests/unit/test_speculative.py's too)."""
    from shardgen.generation.drafts import UNMEASURED_COLUMN_COST, Pacer

    real = Pacer.cost
    Pacer.cost = lambda self, w, rows=None: 1.0 + UNMEASURED_COLUMN_COST * (w - 1)  # type: ignore[method-assign]
    try:
        yield
    finally:
        Pacer.cost = real  # type: ignore[method-assign]


def partial_steps(
    backend: str, gather: str = "per-layer", greedy: bool = False, stale: str = "finish", speculate: int = 0
) -> dict:
    """Partial rollouts over 3 steps, then a drain: each step asks for a quota of groups (rank r:
    ``4 - r`` new prompts, a quota of 2, so held groups pile up unevenly; the last rank holds rows
    while others hold none), then shrinks the weights inside ``paused()``. Each forward sleeps
    3 ms so that rows are mid-answer when a pause parks them. -> per group served (prompt, step
    submitted, step served, finish reasons), the rows spanning two versions, a check of every
    token's version and logprob (``check_versions``), the held groups after the drain. Rank 0
    also holds a ``generate(tokens_per_call=5)`` row, resumed once a step (``per_call.py``): its
    tokens checked alike, its calls returned. ``speculate``: the engine's, its columns priced
    cheap (``cheap_columns``); the verify forwards run and the draft tokens accepted are returned
    too."""
    import shardgen
    from shardgen.generation.partial import held_groups

    rank = dist.get_rank()
    model, ref = _pair()
    n, steps, temperature = 2, 3, 0.8
    served, spans = [], 0
    with (
        cheap_columns() if speculate else contextlib.nullcontext(),
        shardgen.Engine(model, backend=backend, gather=gather, max_batch_size=6, speculate=speculate) as eng,
    ):
        slow_forwards(eng)
        born = {}
        kw = dict(
            n=n, max_staleness=1, stale=stale, max_new_tokens=24, eos_token_id=EOS, temperature=temperature
        )
        if greedy:
            kw.update(do_sample=False)
        gen_kw = {k: v for k, v in kw.items() if k not in ("n", "max_staleness", "stale")}
        gen_kw.update(eos_token_id=EOS[-1:], logprobs=True, seed=3)  # one EOS id: the row spans the steps
        gen = eng.generate(id_prompts([7], seed=99), tokens_per_call=5, **gen_kw) if rank == 0 else []
        gen_calls = 1
        for step in range(steps + 1):
            last = step == steps
            while gen and gen[0].finish_reason == "held" and (last or gen_calls <= step):
                gen, gen_calls = eng.resume(gen), gen_calls + 1
            prompts = [] if last else id_prompts([3 + k for k in range(4 - rank)], seed=100 * rank + step)
            for p in prompts:
                born[tuple(p)] = step
            waiting = [q for q in born if q not in {x[0] for x in served}]
            if stale == "drop":  # groups past max_staleness are dropped, not served
                waiting = [q for q in waiting if step - born[q] <= 1]
            quota = len(waiting) if last else min(2, len(waiting))
            b = eng.rollout(prompts, groups=quota, seed=step, **kw)
            if not last:  # at once, while the held rows are mid-answer: the pause parks them
                with eng.paused():
                    shrink_weights(model)
            assert len(b) == n * len(b.prompts), f"rank {rank}: {len(b)} rows for {len(b.prompts)} groups"
            spans += check_versions(b, ref, temperature, greedy)  # against copies of each version
            for k, p in enumerate(b.prompts):
                served.append((tuple(p), born[tuple(p)], step, b.finish_reasons[k * n : k * n + n]))
                assert int(b.versions[k * n : k * n + n].max()) <= born[tuple(p)] + 1, "past max_staleness"
        left = held_groups(eng)
        stats = eng.stats()
    if gen:
        from shardgen.generation.rollout import pack

        spans += check_versions(pack(gen, pad_id=0, n=1, seeds=[None]), ref, temperature, greedy)
        assert gen[0].finish_reason != "held" and len(set(gen[0].versions)) > 1, (gen_calls, gen[0].versions)
    return {
        "served": served, "born": [list(p) for p in born], "spans": spans, "left": left,
        "verified": (stats["verify_forwards"], stats["accepted"]),
    }  # fmt: skip


def close_with_held_rows(backend: str) -> dict:
    """Each rank closes its engine with held rows, unevenly: rank 0 a ``generate(tokens_per_call=)``
    row cut at its budget, rank 1 partial-rollout groups still decoding (rank 0 none). -> how long
    close() took, and each held row's finish reason and token count once resolved."""
    import shardgen

    rank = dist.get_rank()
    model, _ = _pair()
    long = dict(max_new_tokens=48, eos_token_id=[], temperature=0.9)
    eng = shardgen.Engine(model, backend=backend, max_batch_size=6)
    futures = []
    if rank == 0:
        held = eng.generate(id_prompts([5], seed=7), tokens_per_call=4, seed=1, **long)
        futures = [c.handle.request.future for c in held]
    else:
        assert len(eng.rollout(id_prompts([4, 6], seed=8), n=2, groups=0, seed=2, **long)) == 0
        futures = [g.call.futures[r] for g in eng._held.groups() for r in g.rows]
    t0 = time.perf_counter()
    eng.close()
    took = time.perf_counter() - t0
    ends = [f.result(timeout=10) for f in futures]
    return {"close_s": took, "ends": [(c.finish_reason, len(c.token_ids)) for c in ends]}
