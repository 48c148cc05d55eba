"""Random schedules for the fuzzer (``make fuzz``, tests/multirank/test_fuzz.py), reproducible from a seed.

A schedule is what every rank's user thread does with one engine (its gather mode, and whether
it decodes speculatively, drawn per schedule): generate calls (batch shapes, lengths, EOS
steps), sleeps, the user's own collectives on the default group (barrier, all_reduce) and
``paused()`` blocks with a training step, then ``close()`` after a random delay (so ranks
close in a random order). Collectives are made by every rank the same number of times in the
same order, as real programs do; the calls between them differ per rank. In a share of
schedules one rank suffers a fault (SIGKILL, SIGSTOP, an exception in its forward); user
collectives then happen only before the first call, since after a peer's death a
default-group collective is the user's own hang, not shardgen's.

``run_schedule`` executes one rank's part; it is used in a reused World (fault-free
schedules) and by tests/helpers/fuzz_rank.py (fault schedules, one process per rank).
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import threading
import time
from typing import Any

FAULTS = ("sigkill", "sigstop", "raise")
GATHERS = ("per-layer", "stationary", "once", "auto")  # EngineConfig.gather, one per schedule
SPECULATE = (0, 0, 4)  # EngineConfig.speculate, one per schedule: a third decode speculatively


def make_schedule(seed: int, fault_share: float = 0.25, world: int | None = None) -> dict[str, Any]:
    rng = random.Random(seed)
    world = world or rng.randint(2, 4)
    fault = None
    if rng.random() < fault_share:
        fault = {
            "victim": rng.randrange(world),
            "kind": rng.choice(FAULTS),
            "delay": round(rng.random() * 1.5, 2),
        }
        fault["forward"] = rng.randint(1, 3)
    syncs = [rng.choice(["barrier", "all_reduce", "pause"]) for _ in range(rng.randint(0, 3))]
    ranks = []
    for r in range(world):
        calls: list[dict[str, Any]] = []
        for _ in range(rng.randint(1 if fault and fault["victim"] == r else 0, 4)):
            lengths = [rng.randint(1, 8) for _ in range(rng.randint(1, 4))]
            n = rng.randint(1, 10)
            eos = (
                {"row": rng.randrange(len(lengths)), "step": rng.randint(0, n - 1)}
                if rng.random() < 0.6
                else None
            )
            calls.append(
                {"op": "gen", "lengths": lengths, "seed": rng.randrange(10**6), "max_new": n, "eos": eos}
            )
            if rng.random() < 0.3:
                calls.append({"op": "sleep", "s": round(rng.random() * 0.5, 2)})
        if fault and fault["victim"] == r:  # its first call makes the injected forwards happen
            calls[0].update(max_new=max(calls[0]["max_new"], 4), eos=None)
        # The collectives, in the same order on every rank, at random places among the calls.
        ops = list(calls)
        if fault:
            ops = [{"op": s} for s in syncs] + ops
        else:
            for s in syncs:
                ops.insert(rng.randint(0, len(ops)), {"op": s})
                # keep the order: a later collective goes after the earlier ones
            ops = _ordered(ops, syncs)
        ranks.append({"ops": ops, "close_delay": round(rng.random() * 0.6, 2)})
    # From an RNG of its own, so that adding the draw left every older seed's schedule as it was.
    gather = random.Random(f"gather:{seed}").choice(GATHERS)
    speculate = random.Random(f"speculate:{seed}").choice(SPECULATE)
    return {"seed": seed, "world": world, "fault": fault, "ranks": ranks, "stall_timeout": 4.0,
            "gather": gather, "speculate": speculate}  # fmt: skip


def _ordered(ops: list[dict[str, Any]], syncs: list[str]) -> list[dict[str, Any]]:
    """Rewrite the collective slots so they appear in ``syncs`` order (their positions stay random)."""
    it = iter(syncs)
    return [{"op": next(it)} if o["op"] in ("barrier", "all_reduce", "pause") else o for o in ops]


def run_schedule(sched: dict[str, Any], rank: int, event: Any = None) -> dict[str, Any]:
    """One rank's part of ``sched``: checks every output against HF generate (AssertionError).

    Returns counters. Collective: every rank of the world runs it with the same schedule.
    """
    import torch
    import torch.distributed as dist
    from models import batch, eos_after, hf_generate, tiny_model
    from numerics import assert_ids_agree

    import shardgen

    event = event or (lambda *a, **k: None)
    part = sched["ranks"][rank]
    fault = sched["fault"] if sched["fault"] and sched["fault"]["victim"] == rank else None
    model_seed = sched["seed"] % 97
    ref = tiny_model("llama", seed=model_seed)
    eng = shardgen.Engine(
        tiny_model("llama", seed=model_seed),
        backend="fsdp2",
        gather=sched["gather"],
        stall_timeout=sched["stall_timeout"],
        init_timeout=30.0,
        max_batch_size=1 + sched["seed"] % 4,
        speculate=sched.get("speculate", 0),
    )
    event("constructed")
    if fault and fault["kind"] == "raise":
        real, count = eng.backend.forward, [0]

        def flaky(plan: Any, inputs: dict) -> Any:
            count[0] += 1
            if count[0] == fault["forward"]:
                event("fault", kind="raise")
                raise ValueError("injected failure in the forward")
            return real(plan, inputs)

        eng.backend.forward = flaky
    done = {"calls": 0, "syncs": 0}
    for op in part["ops"]:
        kind = op["op"]
        if kind == "gen":
            if fault and fault["kind"] in ("sigkill", "sigstop") and done["calls"] == 0:
                _signal_self_later(fault, event)
            ids, mask = batch(op["lengths"], seed=op["seed"])
            kw: dict[str, Any] = {"max_new_tokens": op["max_new"], "pad_token_id": 0}
            if op["eos"] is not None:
                kw["eos_token_id"] = eos_after(ref, ids, mask, op["eos"]["row"], op["eos"]["step"])
            got = eng.generate_ids(ids, attention_mask=mask, **kw)
            exp = hf_generate(ref, ids, mask, **kw)
            # rows that end leave the engine's batch (HF keeps them): other shapes, tests/helpers/numerics.py
            what = f"rank {rank} seed {sched['seed']}"
            assert_ids_agree(got, exp, mask, ref, kw.get("eos_token_id"), what=what)
            done["calls"] += 1
            event("call_done", i=done["calls"])
        elif kind == "sleep":
            time.sleep(op["s"])
        elif kind == "barrier":
            dist.barrier()
            done["syncs"] += 1
        elif kind == "all_reduce":
            t = torch.tensor([rank + 1.0])
            dist.all_reduce(t)
            assert t.item() == sched["world"] * (sched["world"] + 1) / 2
            done["syncs"] += 1
        elif kind == "pause":
            with eng.paused():  # a training step: local compute and a collective of the user's own
                w = torch.randn(64, 64, requires_grad=True)
                (w @ w).sum().backward()
                g = torch.ones(1)
                dist.all_reduce(g)
                time.sleep(0.05 * rank)
            done["syncs"] += 1
    done["verified"] = eng.stats()["verify_forwards"]  # speculative decoding's verify forwards
    time.sleep(part["close_delay"])
    event("closing")
    eng.close()
    event("closed")
    return done


def _signal_self_later(fault: dict[str, Any], event: Any) -> None:
    sig = signal.SIGKILL if fault["kind"] == "sigkill" else signal.SIGSTOP

    def fire() -> None:
        time.sleep(fault["delay"])
        event("fault", kind=fault["kind"])
        os.kill(os.getpid(), sig)

    threading.Thread(target=fire, daemon=True, name="fuzz-fault").start()


def main() -> None:
    """``python tests/helpers/fuzz_schedule.py SEED``: print a schedule (to read or to replay)."""
    print(json.dumps(make_schedule(int(sys.argv[1])), indent=1))


if __name__ == "__main__":
    main()
