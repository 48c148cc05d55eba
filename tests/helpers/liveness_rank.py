"""One rank of a fault-injection scenario, started by tests/multirank/test_liveness.py (one process per rank).

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 python tests/helpers/liveness_rank.py SCENARIO

Prints ``EVENT <name> <json>`` lines the test waits for; exits non-zero on any error.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

sys.path[:0] = [os.path.dirname(__file__), os.path.join(os.path.dirname(__file__), "..", "..", "src")]


def event(name: str, **data) -> None:
    print(f"EVENT {name} {json.dumps({'t': time.time(), **data})}", flush=True)


def main(scenario: str) -> None:
    import torch

    torch.set_num_threads(1)
    from models import batch, hf_generate, tiny_model

    import shardgen

    rank, world = shardgen.init()
    stall = float(os.environ.get("STALL_TIMEOUT", "4"))
    victim = int(os.environ.get("VICTIM", world - 1))
    event("started", pid=os.getpid())

    if scenario == "never_constructs" and rank == victim:
        event("away")
        time.sleep(3600)
    group = None
    if scenario == "group_sigkill":  # two engines, on ranks [0, 1] and [2, 3]; the victim is rank 3
        import torch.distributed as dist

        pgs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        group = pgs[rank // 2]
    gather = {"gather": os.environ["GATHER"]} if os.environ.get("GATHER") else {}
    if scenario == "skip_forward" and not gather:
        gather = {"gather": "per-layer"}  # the fault is a skipped per-layer gather
    engine = shardgen.Engine(
        tiny_model("llama", seed=3),
        backend=os.environ.get("BACKEND", "fsdp2"),
        **gather,
        stall_timeout=stall,
        init_timeout=stall if scenario == "never_constructs" else 120,  # a loaded machine starts slowly
        group=group,
    )
    event("constructed")

    if scenario == "driver_raises" and rank == victim:
        real, calls = engine.backend.forward, [0]

        def flaky(plan, inputs):
            calls[0] += 1
            if calls[0] == 4:
                raise ValueError("injected failure in the forward")
            return real(plan, inputs)

        engine.backend.forward = flaky

    if scenario == "exchange_raises" and rank == victim:
        # gather="stationary": raise between two exchanges of one forward (after an input
        # exchange, before its outputs return), in the 4th forward's second linear group.
        from shardgen.backends.stationary import exchange

        real_return, seen = exchange.return_columns, [0]

        def broken(*a, **kw):
            seen[0] += 1
            if seen[0] == 3 * 9 + 2:  # a tiny Llama forward returns 9 groups' outputs (8 + the head)
                event("raising")
                raise ValueError("injected failure between two exchanges")
            return real_return(*a, **kw)

        exchange.return_columns = broken

    if scenario == "driver_deadlock" and rank == victim:
        real, calls = engine.backend.forward, [0]

        def hangs(plan, inputs):
            calls[0] += 1
            if calls[0] == 4:
                event("deadlocked")
                threading.Event().wait()  # the driver never comes back; the heartbeat runs on
            return real(plan, inputs)

        engine.backend.forward = hangs

    if scenario == "skip_forward" and rank == victim:
        # This rank has no requests, so it shadows every forward: it returns without gathering.
        engine.backend.shadow_forward = lambda _plan: event("skipped")
        while engine._shared.failed is None:  # not close(): its own bound would race the verdict
            time.sleep(0.1)
        raise engine._shared.failed

    if scenario == "user_raises":
        try:
            user_raises(engine, rank, victim, os.environ["WHERE"])
        except ValueError:
            if os.environ["WHERE"] == "before_close":
                # The process stays (its driver thread too) for a while after the raise: the close
                # that `with` makes after it must not be agreed to by the peers waiting in theirs.
                time.sleep(2.0)
            raise
        return

    if scenario == "user_thread_stuck" and rank == victim:
        event("stuck")
        threading.Event().wait()  # the user thread never comes back; the driver serves peers

    ids, mask = batch([4, 6, 3], seed=rank)
    expected = hf_generate(tiny_model("llama", seed=3), ids, mask, max_new_tokens=40)
    n_calls = 2 if scenario == "user_thread_stuck" else 10_000
    until = time.monotonic() + 3 * stall + 10  # group_sigkill: group [0, 1] outlives the fault
    for i in range(n_calls):
        if scenario == "group_sigkill" and rank < 2 and time.monotonic() > until:
            break  # the healthy group stops on its own, after the other group's fault
        out = engine.generate_ids(ids, attention_mask=mask, max_new_tokens=40)
        event("call_done", i=i, same_as_hf=bool(torch.equal(out, expected)))
    event("closing")
    engine.close()
    event("closed")


def user_raises(engine, rank: int, victim: int, where: str) -> None:
    """The victim's own code raises ``where`` (before ``paused()``, inside the training step
    before its forward, or before ``close()``) inside ``with engine:``, or (``uncaught``) with no
    ``with`` at all, ending its process; its peers wait in shardgen or in the step's own
    collectives, and must raise naming it."""
    from models import batch

    ids, mask = batch([4, 6, 3][: rank + 1], seed=rank)
    if where == "uncaught" and rank == victim:  # no `with`: the exception ends the process
        engine.generate_ids(ids, attention_mask=mask, max_new_tokens=6)
        event("raising")
        raise ValueError(f"user code failed {where}")
    with engine:
        engine.generate_ids(ids, attention_mask=mask, max_new_tokens=6)
        event("generated")
        if where == "holding":  # a quota of one group: the others stay held, still decoding
            prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True)]
            engine.rollout(prompts, n=2, groups=1, max_new_tokens=100, eos_token_id=[2])
            event("holding")
            if rank == victim:
                event("raising")
                raise ValueError(f"user code failed {where}")
        if where == "before_paused" and rank == victim:
            event("raising")
            raise ValueError(f"user code failed {where}")
        with engine.paused():
            if where == "in_step" and rank == victim:
                event("raising")
                raise ValueError(f"user code failed {where}")
            step = batch([5], seed=9)[0]
            out = engine.model(input_ids=step, labels=step)
            out.loss.backward()
            event("stepped")
        if where == "before_close" and rank == victim:
            time.sleep(1.0)  # the peers are in close() by now
            event("raising")
            raise ValueError(f"user code failed {where}")
        event("closing")
    event("closed")


if __name__ == "__main__":
    try:
        main(sys.argv[1])
    except BaseException as e:
        event("error", type=type(e).__name__, msg=str(e))
        raise
