"""Prefill: shared prefill of the n samples of a prompt, and the ``max_prefill_tokens`` budget.

    python benchmarks/prefill.py                       # both parts, 2 gloo ranks on CPU, FSDP2
    python benchmarks/prefill.py --part share --rounds 2
    python benchmarks/prefill.py --part budget --budgets none 512 128

``share``: ``engine.rollout(prompts, n=...)`` with ``share_prefill`` on and off, n = 4 and 8, on
the shipped toy task (16 prompts per rank, ~8 tokens each, batch 16) and on a longer-prompt
workload (a random Llama, 4 prompts of 512 tokens per rank, batch 16). Prints per rollout
(all ranks): prompt tokens prefilled, prefill forwards, forwards, seconds.

``budget``: each rank generates for 8 prompts, 6 of 16 tokens and 2 of 1024 tokens in its
own shuffled order (so that ranks refill long prompts at different ticks), 32 new tokens
each (no EOS), batch 8, continuous refill, with and without ``max_prefill_tokens``. Prints
the lockstep tick time (every rank waits for the slowest forward of the tick: rank 0's tick
period) as median, p99 and max, and useful tokens/s (all ranks).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import run_as_ranks, script_args, write_json  # noqa: E402

FORWARD_KINDS = ("prefill", "refill", "decode", "shadow")


def long_model(hidden: int, layers: int):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=4096, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
    )  # fmt: skip
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg).eval()
    m.generation_config.pad_token_id = 0
    return m


def totals(stats: dict, keys: tuple[str, ...]) -> list[int]:
    import torch
    import torch.distributed as dist

    t = torch.tensor([stats[k] for k in keys], dtype=torch.int64)
    dist.all_reduce(t)
    return t.tolist()


def part_share(args, rank: int) -> dict:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import shardgen
    from shardgen.toy import make_prompts, toy_model_path

    keys = ("prefill_tokens", "prefill_forwards", "forwards")
    rng = random.Random(rank)
    workloads = {
        "toy": (
            lambda: AutoModelForCausalLM.from_pretrained(toy_model_path()).eval(),
            AutoTokenizer.from_pretrained(toy_model_path()),
            [p["prompt"] for p in make_prompts(16, seed=rank)],
            dict(temperature=1.0, max_new_tokens=26),
        ),
        "512-token prompts": (
            lambda: long_model(args.hidden, args.layers),
            None,
            [[rng.randrange(3, 4096) for _ in range(512)] for _ in range(4)],
            dict(temperature=1.0, max_new_tokens=16, eos_token_id=[]),
        ),
    }
    workloads = {k: v for k, v in workloads.items() if k.split()[0] in args.share_workloads}
    out = {}
    for name, (build, tok, prompts, kw) in workloads.items():
        for n in args.ns:
            for share in (False, True):
                # The prefix cache off: every round brings the same prompts, which it would serve
                # from the round before (an RL step's prompts are new).
                opts = dict(backend="fsdp2", max_batch_size=16, share_prefill=share, gather=args.gather)
                opts["prefix_cache_tokens"] = 0
                with shardgen.Engine(build(), tok, **opts) as eng:
                    eng.rollout(prompts, n=n, seed=0, **kw)  # warm-up
                    before = eng.stats()
                    dist.barrier()
                    t0 = time.perf_counter()
                    for r in range(args.rounds):
                        eng.rollout(prompts, n=n, seed=1 + r, **kw)
                    dist.barrier()
                    secs = (time.perf_counter() - t0) / args.rounds
                    after = eng.stats()
                diff = {k: (after[k] - before[k]) / args.rounds for k in keys}
                row = dict(zip(keys, totals(diff, keys), strict=True))
                out[f"{name}|n={n}|share={share}"] = {**row, "seconds": secs}
    if rank == 0:
        print(
            "\n| workload | n | share_prefill | prefill tokens | prefill forwards | forwards | s / rollout |"
        )
        print("|---|---|---|---|---|---|---|")
        for key, r in out.items():
            name, n, share = key.split("|")
            cells = [name, n[2:], share[6:], *(f"{r[k]:.0f}" for k in keys), f"{r['seconds']:.2f}"]
            print("| " + " | ".join(cells) + " |")
    return out


def part_budget(args, rank: int) -> dict:
    import torch
    import torch.distributed as dist

    import shardgen

    rng = random.Random(100 + rank)
    prompts = [[rng.randrange(3, 4096) for _ in range(16)] for _ in range(args.short)]
    prompts += [[rng.randrange(3, 4096) for _ in range(1024)] for _ in range(args.long)]
    rng.shuffle(prompts)
    ticks: dict[str, list[float]] = {b: [] for b in args.budgets}
    secs = {b: 0.0 for b in args.budgets}
    tokens = {b: 0 for b in args.budgets}
    chunks = {b: 0 for b in args.budgets}
    for rnd in range(args.rounds + 1):  # round 0 warms up; budgets interleaved in every round
        for budget in args.budgets:
            cap = None if budget == "none" else int(budget)
            kw = dict(
                backend="fsdp2",
                max_batch_size=8,
                max_prefill_tokens=cap,
                timeline=True,
                gather=args.gather,
                prefix_cache_tokens=0,  # the rounds' prompts are the same: prefilled, not from a cache
            )
            with shardgen.Engine(long_model(args.hidden, args.layers), **kw) as eng:
                dist.barrier()
                t0 = time.perf_counter()
                done = eng.generate(prompts, max_new_tokens=32, eos_token_id=[])
                dist.barrier()
                dt = time.perf_counter() - t0
                spans = eng.timeline()
            st = eng.stats()
            if rnd == 0:
                continue
            secs[budget] += dt
            tokens[budget] += sum(len(c.token_ids) for c in done)
            chunks[budget] += st["prefill_forwards"] - st["prefills"]
            # a tick's period, from its all-gather's end to the next one's: the slowest forward
            # of the tick on any rank, plus the all-gather (forward ticks only)
            last, forwarded = None, False
            for _, t1, kind in spans:
                if kind == "tick":
                    if last is not None and forwarded:
                        ticks[budget].append(t1 - last)
                    last, forwarded = t1, False
                elif kind in FORWARD_KINDS:
                    forwarded = True
    out = {}
    for budget in args.budgets:
        total = torch.tensor([float(tokens[budget])])
        dist.all_reduce(total)
        t = sorted(ticks[budget])
        out[budget] = {
            "median_ms": 1e3 * statistics.median(t),
            "p99_ms": 1e3 * t[int(0.99 * (len(t) - 1))],
            "max_ms": 1e3 * t[-1],
            "ticks": len(t) / args.rounds,
            "extra_chunks": chunks[budget] / args.rounds,
            "useful_tok_s": total.item() / secs[budget],
        }
    if rank == 0:
        print("\n| max_prefill_tokens | tick median ms | p99 | max | max/median | ticks | tokens/s |")
        print("|---|---|---|---|---|---|---|")
        base = out[args.budgets[0]]["useful_tok_s"]
        for budget, r in out.items():
            print(
                f"| {budget} | {r['median_ms']:.1f} | {r['p99_ms']:.1f} | {r['max_ms']:.1f} | "
                f"{r['max_ms'] / r['median_ms']:.1f} | {r['ticks']:.0f} | {r['useful_tok_s']:.1f} "
                f"({r['useful_tok_s'] / base:.2f}x) |"
            )
    return out


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import shardgen

    torch.set_num_threads(1)
    shardgen.init()
    rank = dist.get_rank()
    results = {}
    if args.part in ("share", "both"):
        results["share"] = part_share(args, rank)
    if args.part in ("budget", "both"):
        results["budget"] = part_budget(args, rank)
    if rank == 0:
        write_json(args.json, {"results": results, "config": vars(args)})
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--part", choices=("share", "budget", "both"), default="both")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--share-workloads", nargs="+", default=["toy", "512-token"], choices=["toy", "512-token"])
    p.add_argument("--ns", nargs="+", type=int, default=[4, 8], help="samples per prompt (share part)")
    p.add_argument("--budgets", nargs="+", default=["none", "2048", "1024", "512", "256"])
    p.add_argument("--short", type=int, default=6, help="16-token prompts per rank (budget part)")
    p.add_argument("--long", type=int, default=2, help="1024-token prompts per rank (budget part)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument(
        "--gather", default="per-layer", help="shardgen's gather policy (the engine's default: auto)"
    )
    p.add_argument("--json", default=None)
    args = p.parse_args(script_args())
    run_as_ranks(__file__, args.nproc, rank_main, args)


if __name__ == "__main__":
    main()
