"""A training step inside ``engine.paused()`` against the same step with no engine, paired and interleaved.

    python benchmarks/train_pause.py                       # 2 gloo ranks, FSDP2 and DeepSpeed
    python benchmarks/train_pause.py --modes fsdp2 --until-ci 5 --max-rounds 200 --steps 2
    python benchmarks/train_pause.py --extra hooks-off beside poller   # diagnostic arms too

Two copies of the same model (Llama, 4 layers, hidden 256) set up by the user: ``fully_shard``
(``fsdp2``) or ``deepspeed.initialize`` ZeRO-3 with a torch optimizer (``deepspeed``). Two arms,
each a block of K training steps:

- ``none``: K steps on copy A, no engine anywhere in the process;
- ``paused``: an engine opens on copy B, one rollout, K steps on B inside ``paused()``, close.

A round runs the blocks in the order A B B A (the next round B A A B), so a drift in the
machine's load within a round hits both arms alike; the round's ratio is B's mean step time over
A's. Rounds are added until the distribution-free 95% confidence interval of the median ratio
is narrower than ``--until-ci`` percent (``hi - lo`` in units of the ratio: [0.98, 1.02] is 4%)
or ``--max-rounds`` / ``--max-minutes`` is reached. Every step is timed between two barriers and
the slower rank's time is kept, so both ranks count the same numbers. Both copies see the same
batches, so their losses must be equal (checked each round).

``--extra`` adds arms (a round then runs every arm's block forward and back: A B C C B A, then
C B A A B C); they are reported against ``none`` but do not decide when to stop:

- ``hooks-off``: as ``paused`` with the backend's pause hooks disabled, so training runs on
  shardgen's generation setup (private group; for DeepSpeed no prefetch and no persistence);
- ``beside``: K steps on a copy with no engine, inside ``paused()`` of an engine on a spare copy:
  the engine's presence (its threads, its memory) without any change to the trained model;
- ``poller``: K steps with no engine, beside a thread that wakes every 50 ms (the paused
  driver's wait loop) and does nothing else;
- ``trim``: K steps with no engine, right after ``malloc_trim(0)`` (``pool.trim_heap``), which
  entering a pause calls once the engine's gather buffers are freed;
- ``no-trim``: as ``paused``, with that call made a no-op for the block (a patch of the backends).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import relaunch_as_ranks, script_args, write_json  # noqa: E402
from stats import median_ci, quartiles  # noqa: E402

# Where the backends call pool.trim_heap (the "no trim" arm makes each a no-op).
BACKEND_TRIMS = (
    "shardgen.backends.fsdp2.pool",
    "shardgen.backends.deepspeed",
    "shardgen.backends.stationary.runner",
)


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    import shardgen

    torch.set_num_threads(1)
    shardgen.init()
    rank = dist.get_rank()
    cfg = LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randint(3, 512, (4, 64), generator=g) for _ in range(args.steps)]
    prompts = [torch.randint(3, 512, (8,), generator=g).tolist() for _ in range(2 + rank)]

    def build(mode: str):
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).train()
        if mode == "deepspeed":
            import deepspeed

            opt = torch.optim.SGD(model.parameters(), lr=1e-2)
            ds_cfg = {
                "train_micro_batch_size_per_gpu": 1,
                "zero_allow_untested_optimizer": True,
                "zero_optimization": {"stage": 3},
            }
            if args.ds_persistence_threshold is not None:
                zero = ds_cfg["zero_optimization"]
                zero["stage3_param_persistence_threshold"] = args.ds_persistence_threshold
            eng, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_cfg)
            return eng, None
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        return model, torch.optim.SGD(model.parameters(), lr=1e-2)

    def steps(model, opt, ds: bool) -> tuple[list[float], list[float]]:
        """K steps, each timed between two barriers: (this rank's seconds per step, losses)."""
        times, losses = [], []
        for ids in batches:
            dist.barrier()
            t0 = time.perf_counter()
            out = model(input_ids=ids, labels=ids)
            if ds:
                model.backward(out.loss)
                model.step()
            else:
                out.loss.backward()
                opt.step()
                opt.zero_grad()
            losses.append(float(out.loss.detach()))
            dist.barrier()
            times.append(time.perf_counter() - t0)
        return times, losses

    def block(arm: str, model, opt, ds: bool, seed: int, spare) -> tuple[list[float], list[float]]:
        if arm == "none":
            return steps(model, opt, ds)
        if arm == "poller":  # a thread that wakes every 50 ms, as the paused driver's wait does
            stop = threading.Event()
            poller = threading.Thread(target=_poll, args=(stop,), daemon=True)
            poller.start()
            try:
                return steps(model, opt, ds)
            finally:
                stop.set()
                poller.join()
        if arm == "trim":  # what entering a pause does to the process heap: malloc_trim(0)
            from shardgen.backends.buffer_pool import trim_heap

            trim_heap()
            return steps(model, opt, ds)
        backend = "deepspeed" if ds else "fsdp2"
        if arm == "beside":  # the engine on a spare copy, paused, while this copy trains
            with shardgen.Engine(spare, backend=backend) as eng:
                eng.rollout(prompts, n=2, max_new_tokens=8, seed=seed)
                with eng.paused():
                    return steps(model, opt, ds)
        if arm == "no trim":  # as "paused", with pool.trim_heap a no-op where the backends call it
            from unittest import mock

            with contextlib.ExitStack() as stack:
                for where in BACKEND_TRIMS:
                    stack.enter_context(mock.patch(f"{where}.trim_heap", lambda: False))
                return block("paused", model, opt, ds, seed, spare)
        with shardgen.Engine(model, backend=backend) as eng:
            if arm == "hooks off":  # (close() still hands the model back)
                eng.backend.enter_pause = eng.backend.exit_pause = lambda: None
            eng.rollout(prompts, n=2, max_new_tokens=8, seed=seed)
            with eng.paused():
                out = steps(model, opt, ds)
            for name in ("enter_pause", "exit_pause"):
                eng.backend.__dict__.pop(name, None)
        return out

    arms = ["none", "paused"] + [EXTRA_ARMS[a] for a in args.extra]
    results = {}
    for mode in args.modes:
        ds = mode == "deepspeed"
        models = {arm: build(mode) for arm in arms}
        spare = build(mode)[0] if "beside" in arms else None
        times: dict[str, list[float]] = {arm: [] for arm in arms}  # slower rank's seconds per step
        ratios: dict[str, list[float]] = {arm: [] for arm in arms[1:]}  # per round, vs "none"
        losses: dict[str, list[float]] = {arm: [] for arm in arms}
        ci, reached, began = None, False, time.monotonic()
        load_before = _loadavg()
        r = 0
        while True:
            seq = arms if r % 2 == 0 else arms[::-1]
            round_times: dict[str, list[float]] = {arm: [] for arm in arms}
            for arm in seq + seq[::-1]:
                model, opt = models[arm]
                ts, ls = block(arm, model, opt, ds, r, spare)
                round_times[arm] += ts
                losses[arm] += ls
            assert all(losses[arm] == losses["none"] for arm in arms), f"round {r}: loss curves differ"
            flat = torch.tensor([t for arm in arms for t in round_times[arm]], dtype=torch.float64)
            dist.all_reduce(flat, op=dist.ReduceOp.MAX)  # the slower rank's time, on both ranks
            per_arm = dict(zip(arms, flat.view(len(arms), -1).tolist(), strict=True))
            r += 1
            if r <= args.warmup:  # warm-up rounds, not counted
                continue
            for arm in arms:
                times[arm] += per_arm[arm]
            for arm in arms[1:]:
                ratios[arm].append(sum(per_arm[arm]) / sum(per_arm["none"]))
            n = r - args.warmup
            ci = median_ci(ratios["paused"])
            width = 100 * (ci[1] - ci[0]) if ci else float("inf")
            reached = n >= args.min_rounds and width < args.until_ci
            late = time.monotonic() - began > 60 * args.max_minutes if args.max_minutes else False
            stop = torch.tensor([int(reached or late or n >= args.max_rounds)])
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)  # the ranks' clocks may disagree on `late`
            if rank == 0 and (n % args.print_every == 0 or stop.item()):
                med = quartiles(ratios["paused"])[1]
                ci_txt = f"[{ci[0]:.3f}, {ci[1]:.3f}] ({width:.1f}% wide)" if ci else "n/a"
                print(f"{mode} round {n}: median ratio {med:.3f}, 95% CI {ci_txt}", flush=True)
            if stop.item():
                break
        summary = {
            "rounds": n,
            "steps_per_block": args.steps,
            "seconds": time.monotonic() - began,
            "loadavg_before": load_before,
            "loadavg_after": _loadavg(),
            "until_ci_pct": args.until_ci,
            "reached": reached,
            "arms": {},
        }
        for arm in arms:
            q1, q2, q3 = quartiles(times[arm])
            entry = {"step_ms_q1": 1000 * q1, "step_ms_median": 1000 * q2, "step_ms_q3": 1000 * q3}
            k = args.steps  # a block's first step, and the others (when K > 1)
            entry["first_step_ms_median"] = 1000 * quartiles(times[arm][::k])[1]
            rest = [t for i, t in enumerate(times[arm]) if i % k]
            entry["later_steps_ms_median"] = 1000 * quartiles(rest)[1] if rest else None
            if arm != "none":
                lo_hi = median_ci(ratios[arm])
                entry |= {"ratio_median": quartiles(ratios[arm])[1], "ratio_ci95": lo_hi}
                entry["ratios"] = ratios[arm]
            entry["step_s"] = times[arm]
            summary["arms"][arm] = entry
        results[mode] = summary
        if rank == 0:
            _print_table(mode, summary, args)
        del models, spare
    if rank == 0:
        write_json(args.json, results)
    dist.destroy_process_group()


EXTRA_ARMS = {
    "hooks-off": "hooks off", "beside": "beside", "poller": "poller", "trim": "trim", "no-trim": "no trim",
}  # fmt: skip


def _poll(stop: threading.Event) -> None:
    while not stop.wait(0.05):
        pass


def _loadavg() -> str:
    try:
        with open("/proc/loadavg", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return "n/a"


def _print_table(mode: str, s: dict, args: argparse.Namespace) -> None:
    arms = s["arms"]
    print(
        f"\n{mode}: {s['rounds']} rounds ({2 * s['rounds']} blocks of {s['steps_per_block']} steps per arm),"
        f" {s['seconds'] / 60:.1f} min, losses equal; CI below {args.until_ci}%:"
        f" {'reached' if s['reached'] else 'NOT reached'}"
    )
    print(f"load average before: {s['loadavg_before']}; after: {s['loadavg_after']}")
    print("| arm | ms / step, median (IQR) | first step / later | median ratio vs none | 95% CI | CI width |")
    print("|---|---|---|---|---|---|")
    for arm, e in arms.items():
        ms = f"{e['step_ms_median']:.1f} ({e['step_ms_q1']:.1f}-{e['step_ms_q3']:.1f})"
        later = e["later_steps_ms_median"]
        split = f"{e['first_step_ms_median']:.1f} / " + (f"{later:.1f}" if later is not None else "-")
        if arm == "none":
            print(f"| {arm} | {ms} | {split} | 1 | | |", flush=True)
            continue
        lo_hi = e["ratio_ci95"]
        ci = f"[{lo_hi[0]:.3f}, {lo_hi[1]:.3f}]" if lo_hi else "n/a"
        w = f"{100 * (lo_hi[1] - lo_hi[0]):.1f}%" if lo_hi else "n/a"
        print(f"| {arm} | {ms} | {split} | {e['ratio_median']:.3f} | {ci} | {w} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--modes", nargs="+", default=["fsdp2", "deepspeed"], choices=["fsdp2", "deepspeed"])
    ap.add_argument("--steps", type=int, default=2, help="training steps per block (K)")
    ap.add_argument(
        "--until-ci", type=float, default=5.0, metavar="PCT",
        help="stop once the 95%% CI of the median ratio is narrower than PCT%% (default 5)",
    )  # fmt: skip
    ap.add_argument("--min-rounds", type=int, default=10, help="never stop before this many rounds")
    ap.add_argument("--max-rounds", type=int, default=200)
    ap.add_argument("--max-minutes", type=float, default=None, help="per backend; stop after this long")
    ap.add_argument("--warmup", type=int, default=1, help="rounds run first and not counted")
    ap.add_argument(
        "--extra",
        nargs="*",
        default=[],
        choices=list(EXTRA_ARMS),
        help="diagnostic arms to add (described at the top of this file)",
    )
    ap.add_argument(
        "--ds-persistence-threshold", type=int, default=None,
        help="deepspeed: stage3_param_persistence_threshold (default: DeepSpeed's, 1e5 elements)",
    )  # fmt: skip
    ap.add_argument("--print-every", type=int, default=5, help="a progress line every N rounds")
    ap.add_argument("--json", default=None, help="write every step time and ratio here")
    args = ap.parse_args(script_args())
    if "LOCAL_RANK" not in os.environ:
        relaunch_as_ranks(__file__, args.nproc)
    rank_main(args)


if __name__ == "__main__":
    main()
