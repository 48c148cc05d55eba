"""Scenario functions run on every rank by tests/multirank/test_engine_multirank.py (module level:
importable)."""

from __future__ import annotations

import os
import random
import sys
import threading
import time

import torch
import torch.distributed as dist
from models import batch, chunked_against_own_fill, eos_after, hf_generate, tiny_model
from numerics import assert_ids_agree
from world import assert_no_thread, rank

import shardgen


def _check(eng, ref, ids, mask, **kw):
    got = eng.generate_ids(ids, attention_mask=mask, **kw)
    exp = hf_generate(ref, ids, mask, **kw)
    # rows that end leave the engine's batch (HF keeps them): other shapes, tests/helpers/numerics.py
    assert_ids_agree(got, exp, mask, ref, kw.get("eos_token_id"), what=f"rank {rank()}")
    return got


def _generated(rows: torch.Tensor, width: int, eos: int | None) -> int:
    """Tokens the requests of a generate_ids() result produced: up to the first EOS, inclusive."""
    total = 0
    for row in rows[:, width:].tolist():
        total += row.index(eos) + 1 if eos is not None and eos in row else len(row)
    return total


def assert_lockstep(stats: list[dict], one_forward_per_tick: bool = True) -> None:
    """For the tests, on the ``engine.stats()`` the scenarios return: the tick's invariant. Every
    rank ran the same ticks, decided FORWARD on the same ones and (gathering per layer, so one
    forward per tick) ran exactly one real or shadow forward in each."""
    assert len({s["ticks"] for s in stats}) == 1, [s["ticks"] for s in stats]
    assert len({s["forward_ticks"] for s in stats}) == 1, [s["forward_ticks"] for s in stats]
    if one_forward_per_tick:
        for r, s in enumerate(stats):
            assert s["forwards"] + s["shadow_forwards"] == s["forward_ticks"], (r, s)


def fidelity(arch: str, backend: str = "fsdp2"):
    """Each rank generates its own batch of prompts of different lengths; greedy == HF."""
    ref = tiny_model(arch, seed=11)
    eng = shardgen.Engine(tiny_model(arch, seed=11), backend=backend, gather="per-layer")
    ids, mask = batch([3 + rank(), 8, 5, 1 + 2 * rank()], seed=100 + rank())
    row, step = rank() % 4, 2 + 3 * rank()
    eos = eos_after(ref, ids, mask, row=row, step=step)
    kw = dict(max_new_tokens=10 + 4 * rank(), eos_token_id=eos, pad_token_id=0)
    got = eng.generate_ids(ids, attention_mask=mask, **kw)
    eng.close()
    assert_no_thread("shardgen-", timeout=5)
    return {
        "got": got.tolist(),
        "hf": hf_generate(ref, ids, mask, **kw).tolist(),
        "width": ids.shape[1],
        "eos": eos,
        "eos_row": row,
        "eos_step": step,
        "stats": eng.stats(),
    }


def sampled_same_seed_any_rank(backend: str = "fsdp2"):
    """The same (prompt, seed) gives the same tokens on every rank, alone or inside a batch."""
    eng = shardgen.Engine(tiny_model("llama", seed=12), backend=backend, gather="per-layer")
    ids, mask = batch([5, 3, 7], seed=7)
    prompts = [ids[i][mask[i].bool()] for i in range(3)]
    opts = dict(max_new_tokens=8, do_sample=True, temperature=0.8, top_p=0.95)
    if rank() == 0:
        out = [c.token_ids for c in eng.generate(prompts, seed=[5, 6, 7], **opts)]
    else:
        out = [
            eng.generate([p], seed=s, **opts)[0].token_ids for p, s in zip(prompts, [5, 6, 7], strict=True)
        ]
    greedy = [c.token_ids for c in eng.generate(prompts, max_new_tokens=8)]
    eng.close()
    return {"sampled": out, "greedy": greedy, "prompts": [p.tolist() for p in prompts]}


def eos_at_different_steps(backend: str = "fsdp2"):
    """(a) rank r's single row hits EOS after 2 + 5r tokens; everybody else keeps decoding."""
    ref = tiny_model("llama", seed=13)
    eng = shardgen.Engine(tiny_model("llama", seed=13), backend=backend, gather="per-layer")
    ids, mask = batch([4, 6], seed=20 + rank())
    eos = eos_after(ref, ids, mask, row=0, step=2 + 5 * rank())
    got = _check(eng, ref, ids, mask, max_new_tokens=25, eos_token_id=eos, pad_token_id=0)
    eng.close()
    return {"width": got.shape[1], "tokens": _generated(got, ids.shape[1], eos), "stats": eng.stats()}


def seed_script(backend: str = "fsdp2"):
    """(b) The seed report: rank 0 makes two calls, rank 1 three; then a default-group barrier; close."""
    ref = tiny_model("llama", seed=14)
    eng = shardgen.Engine(tiny_model("llama", seed=14), backend=backend, gather="per-layer")
    ids, mask = batch([3, 6, 2], seed=30)
    for c in range(2 if rank() == 0 else 3):
        _check(eng, ref, (ids + c) * mask, mask, max_new_tokens=12)
    dist.barrier()  # on the default group, while a peer may still be generating
    eng.close()
    return eng.stats()


def idle_rank_only_closes(backend: str = "fsdp2"):
    """(c) rank 1 submits nothing and only closes; rank 0 generates."""
    ref = tiny_model("gpt2", seed=15)
    eng = shardgen.Engine(tiny_model("gpt2", seed=15), backend=backend, gather="per-layer")
    if rank() == 0:
        ids, mask = batch([4, 2, 5], seed=31)
        _check(eng, ref, ids, mask, max_new_tokens=10)
    eng.close()
    return eng.stats()


def sleeper(sleep_s: float, backend: str = "fsdp2"):
    """(d) rank 1's main thread sleeps before its first call; the others finish meanwhile."""
    ref = tiny_model("qwen2", seed=16)
    eng = shardgen.Engine(tiny_model("qwen2", seed=16), backend=backend, gather="per-layer")
    t0 = time.monotonic()
    if rank() == 1:
        time.sleep(sleep_s)
    for c in range(3):
        ids, mask = batch([2 + c, 5, 3], seed=40 + 10 * rank() + c)
        _check(eng, ref, ids, mask, max_new_tokens=8)
    done_at = time.monotonic() - t0
    eng.close()
    return done_at


def random_workload(case: int, arch: str = "llama", backend: str = "fsdp2"):
    """(e) Random per-rank workload: 0..3 calls, random batches, EOS, sleeps, async submits."""
    rng = random.Random(1000 * case + rank())
    ref = tiny_model(arch, seed=case)
    eng = shardgen.Engine(
        tiny_model(arch, seed=case), backend=backend, max_batch_size=rng.choice([2, 4, 8]), gather="per-layer"
    )
    futures = []
    rows = tokens = 0  # what this rank asked for and got, for the test to check the counters
    for _ in range(rng.randint(0, 3)):
        if rng.random() < 0.3:
            time.sleep(rng.random() * 0.3)
        lengths = [rng.randint(1, 9) for _ in range(rng.randint(1, 5))]
        ids, mask = batch(lengths, seed=rng.randrange(10**6))
        n = rng.randint(1, 14)
        eos = eos_after(ref, ids, mask, row=0, step=rng.randint(0, n - 1))
        rows += len(lengths)
        if rng.random() < 0.3:  # async: a future per prompt, collected at the end
            prompts = [ids[i][mask[i].bool()] for i in range(len(lengths))]
            futures += [
                (eng.submit(p, max_new_tokens=n, eos_token_id=eos, pad_token_id=0), p, n, eos)
                for p in prompts
            ]
        else:
            got = _check(eng, ref, ids, mask, max_new_tokens=n, eos_token_id=eos, pad_token_id=0)
            tokens += _generated(got, ids.shape[1], eos)
    for fut, p, n, eos in futures:
        exp = hf_generate(
            ref, p[None], torch.ones_like(p[None]), max_new_tokens=n, eos_token_id=eos, pad_token_id=0
        )
        toks = exp[0, p.numel() :].tolist()
        if eos in toks:
            toks = toks[: toks.index(eos) + 1]
        assert fut.result(timeout=60).token_ids == toks, f"rank {rank()} case {case}"
        tokens += len(toks)
    eng.close()
    return {"rows": rows, "tokens": tokens, "stats": eng.stats()}


def mismatched(setting: str):
    """Ranks construct with different settings: every rank gets a ValueError naming it."""
    kw: dict = {"backend": "fsdp2"}
    model_kw: dict = {}
    if setting == "backend" and rank() == 1:
        kw["backend"] = "local"
    if setting == "model" and rank() == 1:
        model_kw["num_hidden_layers"] = 3
    if setting == "max_prefill_tokens" and rank() == 1:
        kw["max_prefill_tokens"] = 64
    if setting == "speculate":  # on in one rank only: the ticks would differ in size
        kw["speculate"] = 4 if rank() == 0 else 0
    if setting == "speculate_share":  # rollouts shared by one rank only: as above
        kw.update(speculate=4, speculate_share=rank() == 0)
    if setting == "speculate_history_tokens":  # no history on one rank: it shares nothing, as above
        kw.update(speculate=4, speculate_history_tokens=0 if rank() == 1 else 1000)
    model = tiny_model("llama", seed=17, **model_kw)
    if setting == "dtype" and rank() == 1:
        model = model.to(torch.bfloat16)
    try:
        shardgen.Engine(model, **kw)
    except ValueError as e:
        return str(e)
    return "no error"


def pause_and_user_collectives():
    """Generate, pause for a 'training step' with default-group collectives, generate again."""
    ref = tiny_model("llama", seed=18)
    eng = shardgen.Engine(tiny_model("llama", seed=18), backend="fsdp2", gather="per-layer")
    ids, mask = batch([3, 5], seed=50 + rank())
    _check(eng, ref, ids, mask, max_new_tokens=6)
    with eng.paused():
        ticks = eng.stats()["ticks"]
        t = torch.ones(1)
        dist.all_reduce(t)  # a user collective: no engine traffic can interleave
        time.sleep(0.3 * rank())
        assert eng.stats()["ticks"] == ticks, "the engine ticked while paused"
    # Back to back, as a training loop does: each block must be a pause of its own. (A block
    # exiting and the next paused() right after it once looked the same to the driver: the
    # next block ran inside the previous pause and the ranks fell out of step.)
    for i in range(6):
        ticks = eng.stats()["ticks"]
        with eng.paused():
            assert eng.stats()["ticks"] > ticks, f"block {i} ran without a pause of its own"
            dist.all_reduce(torch.ones(1))
            time.sleep(0.02 * rank() * (i % 2))
    _check(eng, ref, ids, mask, max_new_tokens=6)
    eng.close()
    return t.item()


def fingerprint_divergence():
    """debug_collectives: a rank whose forwards gather other units is caught, not hung."""
    eng = shardgen.Engine(
        tiny_model("llama", seed=19), backend="fsdp2", debug_collectives=True, gather="per-layer"
    )
    if rank() == 1:
        real = eng.backend.collective_signature
        eng.backend.collective_signature = lambda: (*real(), 99)  # simulate a divergent gather sequence
    fut = eng.submit([5, 6, 7], max_new_tokens=4)
    try:
        fut.result(timeout=30)
        return "no error"
    except shardgen.CollectiveDivergenceError as e:
        return str(e)
    finally:
        eng._driver.thread.join(10)
        eng._teardown()


def concurrent_user_threads():
    """Several user threads on a rank submit at once; results still match HF."""
    ref = tiny_model("llama", seed=21)
    eng = shardgen.Engine(tiny_model("llama", seed=21), backend="fsdp2", max_batch_size=3, gather="per-layer")
    errors = []

    def work(t):
        try:
            ids, mask = batch([2 + t, 4], seed=60 + 10 * rank() + t)
            _check(eng, ref, ids, mask, max_new_tokens=5 + t)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    eng.close()
    assert not errors, errors
    return eng.stats()


def gather_policy(gather: str, budget_gb: float | None = None, backend: str = "fsdp2"):
    """gather='once'/'auto': weights gathered when work starts, released when all idle, before a
    pause and at close; same outputs. Released means the replica's storage is freed."""
    ref = tiny_model("llama", seed=22)
    eng = shardgen.Engine(
        tiny_model("llama", seed=22), backend=backend, gather=gather, memory_budget_gb=budget_gb
    )
    for c in range(2 if rank() == 0 else 1):
        ids, mask = batch([3, 6], seed=70 + 10 * rank() + c)
        _check(eng, ref, ids, mask, max_new_tokens=12 + 10 * rank())
    # Pause and close requested while rank 0 still decodes: PAUSE / EXIT follow its last forward
    # directly (no idle tick in between) and must release the gathered weights themselves.
    fut = eng.submit(ids[0], max_new_tokens=40, eos_token_id=[]) if rank() == 0 else None
    with eng.paused():
        assert not eng._driver.gathered  # a training step here must see (and update) the shards
        assert eng.backend.gathered_bytes() == 0
    assert fut is None or len(fut.result().token_ids) == 40
    fut = eng.submit(ids[0], max_new_tokens=40, eos_token_id=[]) if rank() == 0 else None
    eng.close()
    assert not eng._driver.gathered and eng.backend.gathered_bytes() == 0
    assert fut is None or len(fut.result().token_ids) == 40
    st = eng.stats()
    replica = eng.backend.replica
    on_replica = replica.forwards if replica is not None else 0
    said = st["gather"]  # what stats() says the forwards used
    return eng.gather_policy, st["shadow_forwards"], st["forward_ticks"], st["forwards"], on_replica, said


def late_arrival(backend: str):
    """gather='once': rank 0's request reaches its driver after that rank's tick row was built
    (its ``take_inbox`` hides it until a forward tick has begun; rank 1's request started that
    tick). Its forwards are local, so it starts in that tick, after the gather, not after rank
    1's burst of forwards and another tick. -> rank 0's timeline kinds from the gather to its
    first prefill, and whether its tokens equal HF's."""
    ref = tiny_model("llama", seed=25)
    eng = shardgen.Engine(tiny_model("llama", seed=25), backend=backend, gather="once", timeline=True)
    ids, mask = batch([4], seed=90 + rank())
    if rank() == 0:
        sh, driver = eng._shared, eng._driver
        plain, t0 = sh.take_inbox, time.monotonic()

        def hidden():  # driver thread: the requests wait in the inbox until a forward tick
            if driver.stats.forward_ticks == 0 and time.monotonic() - t0 < 10:
                with sh.lock:
                    return [], sh.closed, sh.pause_wanted
            return plain()

        sh.take_inbox = hidden
    dist.barrier()
    kw = dict(max_new_tokens=24, eos_token_id=[])
    got = eng.generate_ids(ids, attention_mask=mask, **kw)
    same = torch.equal(got, hf_generate(ref, ids, mask, **kw))
    eng.close()
    kinds = [k for _, _, k in eng.timeline()]
    start = kinds.index("gather")
    return kinds[start : kinds.index("prefill", start) + 1], same, eng.stats()["forward_ticks"]


def user_wrapped_fsdp2_seed_script():
    """The seed script with a model the USER wrapped with fully_shard on the default group."""
    from torch.distributed.fsdp import fully_shard

    ref = tiny_model("llama", seed=23)
    model = tiny_model("llama", seed=23)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    eng = shardgen.Engine(model, backend="fsdp2", gather="per-layer")
    for c in range(2 if rank() == 0 else 3):
        ids, mask = batch([3, 5], seed=80 + c)
        _check(eng, ref, ids, mask, max_new_tokens=10)
    if rank() == 0:
        for _ in range(20):  # default-group traffic while rank 1 still decodes
            t = torch.ones(1)
            dist.all_reduce(t)
    else:
        for _ in range(20):
            t = torch.ones(1)
            dist.all_reduce(t)
    dist.barrier()
    eng.close()
    return eng.stats()


def spinner(done_flag: str, most_s: float):
    """A rank whose user thread spins in pure Python: its driver still serves the peers (slower).
    Rank 1 spins until rank 0's call is done (rank 0 then creates ``done_flag``) or ``most_s``
    passed: had rank 0 waited for the spinning user thread, the spin runs its ``most_s``."""
    ref = tiny_model("llama", seed=24)
    eng = shardgen.Engine(tiny_model("llama", seed=24), backend="fsdp2", gather="per-layer")
    assert abs(sys.getswitchinterval() - 0.0002) < 1e-9  # the engine lowered it while open
    with eng.paused():
        inside = sys.getswitchinterval()
    deadline = time.monotonic() + 10.0  # the driver leaves the pause once every rank's block has
    while abs(sys.getswitchinterval() - 0.0002) > 1e-9 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert abs(inside - 0.005) < 1e-9, inside  # the interpreter's own while every engine is paused
    assert abs(sys.getswitchinterval() - 0.0002) < 1e-9, sys.getswitchinterval()  # lowered again
    dist.barrier()
    t0 = time.monotonic()
    if rank() == 1:
        i = 0
        while time.monotonic() - t0 < most_s:
            i += 1
            if i % 100_000 == 0 and os.path.exists(done_flag):  # a stat every few ms, else pure Python
                break
    else:
        ids, mask = batch([4, 6], seed=90)
        _check(eng, ref, ids, mask, max_new_tokens=20)
        open(done_flag, "w").close()
    elapsed = time.monotonic() - t0
    eng.close()
    assert abs(sys.getswitchinterval() - 0.005) < 1e-9  # restored with the last engine
    return elapsed


def moe_routing(backend: str = "fsdp2"):
    """Mixtral-style MoE: ranks route their tokens to different experts; no deadlock, outputs = HF.

    Returns this rank's per-expert token counts (first layer), so the test can assert that
    routing really differed across ranks.
    """
    ref = tiny_model("mixtral", seed=25)
    eng = shardgen.Engine(tiny_model("mixtral", seed=25), backend=backend, gather="per-layer")
    counts = torch.zeros(4, dtype=torch.long)
    gate = [m for n, m in eng.model.named_modules() if n.endswith("layers.0.mlp.gate")][0]

    def record(_m, _inp, out):
        counts.add_(torch.bincount(out[2].reshape(-1).cpu(), minlength=4))

    handle = gate.register_forward_hook(record)
    for c in range(1 + rank()):  # uneven numbers of calls too
        ids, mask = batch([3 + 2 * rank(), 5], seed=200 + 7 * rank() + c)
        _check(eng, ref, ids, mask, max_new_tokens=6 + 4 * rank())
    dist.barrier()
    eng.close()
    handle.remove()
    return counts.tolist()


def late_close(idle_s: float, stall: float):
    """Both ranks idle longer than stall_timeout, then close one second apart: no error."""
    eng = shardgen.Engine(
        tiny_model("gpt2", seed=26), backend="fsdp2", stall_timeout=stall, gather="per-layer"
    )
    eng.generate([[5, 6, 7]], max_new_tokens=3)
    time.sleep(idle_s + rank())  # rank 1 closes a second after rank 0
    eng.close()
    return eng.stats()


def pause_alone(stall: float):
    """Only rank 0 enters paused(): it is told which rank never came, then both close normally."""
    eng = shardgen.Engine(
        tiny_model("gpt2", seed=27), backend="fsdp2", stall_timeout=stall, gather="per-layer"
    )
    msg = "no error"
    if rank() == 0:
        try:
            with eng.paused():
                pass
        except shardgen.RendezvousTimeoutError as e:
            msg = str(e)
        eng.generate([[5, 6]], max_new_tokens=2)  # the engine still works afterwards
    # Rank 1 stays out of the engine (on the default group) until rank 0 is done with it: a
    # fixed sleep raced rank 0's close() bound whenever rank 1's constructor returned late.
    dist.barrier()
    eng.close()
    return msg


def whole_gather_equals_unit_by_unit() -> list[dict]:
    """``gather_all`` on FSDP2 in chunks of many parameters (``backends/fsdp2/whole.py``) against
    FSDP2's own unsharding unit by unit, and both against the unsharded model, for: rows that do
    not divide among the ranks (vocabulary 97), a shard left empty (2 rows at 3 ranks), tied
    embeddings, a model the user sharded with bf16 compute (``MixedPrecisionPolicy``), and a
    chunk budget smaller than the model (several chunks)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from shardgen.backends import make_backend

    cases = [
        ("llama-odd-rows", "llama", dict(vocab_size=97), False, None),
        ("llama-empty-shard", "llama", dict(intermediate_size=2), False, None),
        ("gpt2-tied", "gpt2", {}, False, None),
        ("llama-user-bf16", "llama", dict(vocab_size=97), True, None),
        ("llama-small-chunks", "llama", {}, False, 4096),
    ]
    out = []
    for name, arch, over, user, budget in cases:
        model, ref = tiny_model(arch, seed=3, **over), tiny_model(arch, seed=3, **over)
        want = torch.float32
        if user:
            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh, mp_policy=mp)
            fully_shard(model, mesh=mesh, mp_policy=mp)
            want = torch.bfloat16
        group = dist.new_group(backend="gloo")
        b = make_backend("fsdp2", model, param_group=group, device=torch.device("cpu"))
        if budget is not None:
            b.WHOLE_CHUNK_BYTES = budget
            b.block_bytes = lambda: 0  # type: ignore[method-assign]
        out.append({"case": name, **chunked_against_own_fill(b, ref, want)})
    return out
