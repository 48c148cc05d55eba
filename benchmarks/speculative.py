"""Speculative decoding from history (``EngineConfig.speculate``) against the plain engine.

    python benchmarks/speculative.py                       # toy model, FSDP2, 2 gloo ranks
    python benchmarks/speculative.py --gathers once --modes sampled --speculate 6 --rounds 3

The RL rollout pattern: the shipped toy model, each rank its own prompts (uneven: 16 on rank 0,
11 on the others), ``n`` samples each, ``max_new_tokens`` new tokens; three epochs over the same
prompts, then one over new ones (drafts only from the live rows and the prompts then). With
``--deal shuffled`` each epoch over the same prompts deals them to the ranks anew (as a trainer's
``DistributedSampler(shuffle=True)``): a prompt's earlier rollout then mostly lies on another rank,
which shares it through the tick. For each
gather mode and each of greedy and sampled (temperature 1, a seed per epoch), a fresh engine
with ``speculate`` off and one with it on run the four epochs; rounds alternate them. Every
row of the speculative engine is asserted equal to the plain engine's (tokens; and logprobs
bit for bit under ``--numerics invariant``). Reports useful tokens/s (every generated token,
EOS included) of each, the speedup (and each round's: its two runs back to back; and each
epoch's over the rounds, with its mean wall per round), the acceptance (draft tokens kept / fed),
tokens per forward (a live row's tokens per decode forward) and decode forwards, per epoch kind.
``--timeline``: each call's milliseconds per kind on each rank (``engine.timeline()``: prefill,
decode, gather, tick, ...) and the speculative counters, printed as the calls run.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import run_as_ranks, script_args, write_json  # noqa: E402

COUNTERS = ("drafted", "accepted", "decode_steps", "verify_forwards", "decode_tokens", "decode_row_steps")


#: ``--model medium``: a random Llama where per-row compute matters (as benchmarks/invariant.py's).
MEDIUM = dict(
    vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=6,
    num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
)  # fmt: skip


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import shardgen
    from shardgen.core.timeline import totals
    from shardgen.toy import make_prompts, toy_model_path

    torch.set_num_threads(1)
    shardgen.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    path = toy_model_path()
    count = args.prompts if rank == 0 else args.prompts_other
    if args.model == "medium":  # random weights, prompts of random ids that never repeat
        tok = None
        gen = torch.Generator().manual_seed(rank)
        epochs = [
            [torch.randint(3, MEDIUM["vocab_size"], (int(torch.randint(12, 31, (1,), generator=gen)),),
                           generator=gen).tolist() for _ in range(count)]
            for _ in range(4)
        ]  # fmt: skip
    else:
        tok = AutoTokenizer.from_pretrained(path)
        counts = [args.prompts] + [args.prompts_other] * (world - 1)
        pool = [p["prompt"] for r in range(world) for p in make_prompts(counts[r], seed=r)]
        new = [p["prompt"] for p in make_prompts(count, seed=1000 + rank)]
        epochs, start = [], sum(counts[:rank])
        for e in range(3):
            order = list(range(len(pool)))
            if args.deal == "shuffled" and e:
                random.Random(e).shuffle(order)  # the same deal on every rank
            epochs.append([pool[i] for i in order[start : start + count]])
        epochs.append(new)

    def build(gather: str, spec: int):
        if args.model == "medium":
            from transformers import LlamaConfig, LlamaForCausalLM

            torch.manual_seed(0)  # the same weights on every rank
            model = LlamaForCausalLM(LlamaConfig(**MEDIUM)).eval()
        else:
            model = AutoModelForCausalLM.from_pretrained(path).eval()
        return shardgen.Engine(
            model, tok, backend="fsdp2", gather=gather, max_batch_size=args.batch, speculate=spec,
            numerics=args.numerics, speculate_share=args.share == "on", timeline=args.timeline,
        )  # fmt: skip

    def run(eng, mode: str) -> tuple[list, list[dict], list[float]]:
        outs, deltas, walls = [], [], []
        for e, prompts in enumerate(epochs):
            kw = dict(max_new_tokens=args.max_new_tokens, n=args.n)
            if mode == "sampled":
                kw.update(temperature=1.0, seed=e)
            else:
                kw.update(do_sample=False)
            before = eng.stats()
            dist.barrier()
            t0 = time.perf_counter()
            got = eng.rollout(prompts, **kw)
            dist.barrier()
            t1 = time.perf_counter()
            walls.append(t1 - t0)
            after = eng.stats()
            delta = {k: after[k] - before[k] for k in COUNTERS}
            if args.timeline:  # where this call's time went, per rank
                spans = [(max(a, t0), min(b, t1), k) for a, b, k in eng.timeline() if b > t0 and a < t1]
                kinds = {k: round(1e3 * v) for k, v in sorted(totals(spans).items())}
                per_rank = [None] * world
                counts = {k: v for k, v in delta.items() if v}
                dist.all_gather_object(per_rank, (round(1e3 * (t1 - t0)), kinds | counts))
                if rank == 0:
                    name = "speculative" if eng.config.speculate else "plain"
                    print(
                        f"  {name:11s} epoch {e}: "
                        + "   ".join(f"rank {r} {w} ms {k}" for r, (w, k) in enumerate(per_rank)),
                        flush=True,
                    )
            deltas.append(delta)
            rows = []
            for r in range(len(got)):
                m = got.response_mask[r].bool()
                rows.append((got.response_ids[r][m].tolist(), got.logprobs[r][m]))
            outs.append(rows)
        return outs, deltas, walls

    results: dict = {}
    for gather in args.gathers.split(","):
        for mode in args.modes.split(","):
            per_round: dict[int, list[float]] = {0: [], args.speculate: []}
            per_epoch = {0: [0.0] * len(epochs), args.speculate: [0.0] * len(epochs)}
            first: dict = {}
            stats: dict = {}
            for rnd in range(args.rounds):
                for spec in (0, args.speculate) if rnd % 2 == 0 else (args.speculate, 0):
                    eng = build(gather, spec)
                    # The model just loaded leaves a full collection due (about 0.1-0.4 s with
                    # torch and transformers imported): collected here, not inside a timed call
                    # of whichever engine it would otherwise stall, on whichever rank.
                    gc.collect()
                    outs, deltas, ws = run(eng, mode)
                    eng.close()
                    per_round[spec].append(sum(ws))
                    per_epoch[spec] = [a + b for a, b in zip(per_epoch[spec], ws, strict=True)]
                    first.setdefault(spec, outs)
                    stats.setdefault(spec, deltas)
            useful = sum(len(t) for ep in first[0] for t, _ in ep)
            for e, (a, b) in enumerate(zip(first[0], first[args.speculate], strict=True)):
                for r, ((ta, la), (tb, lb)) in enumerate(zip(a, b, strict=True)):
                    assert ta == tb, f"rank {rank} {gather} {mode} epoch {e} row {r}: {tb} != plain {ta}"
                    if args.numerics == "invariant":
                        assert torch.equal(la, lb), f"rank {rank} {gather} {mode} epoch {e} row {r}: logprobs"
            total = torch.tensor([float(useful)], dtype=torch.float64)
            dist.all_reduce(total)
            walls = torch.tensor([sum(per_round[0]), sum(per_round[args.speculate])], dtype=torch.float64)
            dist.all_reduce(walls, op=dist.ReduceOp.MAX)
            # Each round's two runs back to back (the same rows): its ratio of walls is the speedup
            # that round, under the machine's load of that moment.
            rounds = torch.tensor([per_round[0], per_round[args.speculate]], dtype=torch.float64)
            dist.all_reduce(rounds, op=dist.ReduceOp.MAX)
            counters = torch.tensor(
                [[d[k] for k in COUNTERS] for d in stats[args.speculate]], dtype=torch.float64
            )  # [epoch, counter]: summed over ranks
            dist.all_reduce(counters)
            results[f"{gather}/{mode}"] = _summary(args, total.item(), walls.tolist(), counters)
            results[f"{gather}/{mode}"]["round_speedups"] = (rounds[0] / rounds[1]).tolist()
            # Each epoch's speedup over the rounds (this rank's walls: the slower rank's differ
            # little, and every epoch ends at a barrier).
            results[f"{gather}/{mode}"]["epoch_speedups"] = [
                a / b for a, b in zip(per_epoch[0], per_epoch[args.speculate], strict=True)
            ]
            results[f"{gather}/{mode}"]["epoch_ms"] = [
                [1e3 * w / args.rounds for w in per_epoch[s]] for s in (0, args.speculate)
            ]  # [plain, speculative][epoch]: mean wall per round
    if rank == 0:
        print(f"\n{args.model} model, FSDP2, {world} ranks, prompts {args.prompts}/{args.prompts_other}, "
              f"n={args.n}, "
              f"{args.max_new_tokens} new tokens, speculate={args.speculate}, numerics={args.numerics}, "
              f"deal={args.deal}, share={args.share}, "
              f"{args.rounds} rounds")  # fmt: skip
        for key, r in results.items():
            print(
                f"{key:20s} plain {r['plain_tok_s']:8.1f} tok/s  speculative {r['spec_tok_s']:8.1f} tok/s  "
                f"{r['speedup']:5.2f}x   same prompts: accept {r['same']['acceptance']:.2f} "
                f"tok/fwd {r['same']['tokens_per_forward']:.2f}   new prompts: accept "
                f"{r['new']['acceptance']:.2f} tok/fwd {r['new']['tokens_per_forward']:.2f}",
                flush=True,
            )
            ups = r["round_speedups"]
            print(f"{'':20s} per round: {', '.join(f'{x:.2f}x' for x in ups)} "
                  f"(median {statistics.median(ups):.2f}x); per epoch: "
                  f"{', '.join(f'{x:.2f}x' for x in r['epoch_speedups'])} (ms "
                  f"{' '.join(f'{a:.0f}/{b:.0f}' for a, b in zip(*r['epoch_ms'], strict=True))})",
                  flush=True)  # fmt: skip
        write_json(args.json, {"results": results, "world": world, "config": vars(args)})
    dist.destroy_process_group()


def _summary(args: argparse.Namespace, useful: float, walls: list[float], counters) -> dict:
    """Useful tokens/s of each engine and the speculative one's counters, for the three epochs
    over the same prompts and the one over new ones."""

    def part(rows) -> dict:
        c = dict(zip(COUNTERS, rows.sum(0).tolist(), strict=True))
        return {
            "acceptance": c["accepted"] / c["drafted"] if c["drafted"] else 0.0,
            "tokens_per_forward": c["decode_tokens"] / c["decode_row_steps"]
            if c["decode_row_steps"]
            else 0.0,
            "decode_forwards": c["decode_steps"],
            "verify_forwards": c["verify_forwards"],
        }

    plain, spec = args.rounds * useful / walls[0], args.rounds * useful / walls[1]
    return {"plain_tok_s": plain, "spec_tok_s": spec, "speedup": spec / plain,
            "same": part(counters[:3]), "new": part(counters[3:])}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2, help="gloo ranks to spawn")
    p.add_argument("--model", choices=["toy", "medium"], default="toy",
                   help="toy: the shipped model, epochs over the same prompts; medium: a random Llama "
                   "(hidden 512, 6 layers), four epochs of prompts that never repeat")  # fmt: skip
    p.add_argument("--prompts", type=int, default=16, help="prompts on rank 0")
    p.add_argument("--prompts-other", type=int, default=11, help="prompts on every other rank")
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--batch", type=int, default=64, help="max_batch_size")
    p.add_argument("--speculate", type=int, default=4, help="the speculative engine's EngineConfig.speculate")
    p.add_argument("--gathers", default="per-layer,once")
    p.add_argument("--modes", default="greedy,sampled")
    p.add_argument("--numerics", choices=["fast", "invariant"], default="fast")
    p.add_argument("--deal", choices=["fixed", "shuffled"], default="fixed",
                   help="fixed: a rank's prompts every epoch; shuffled: dealt anew each epoch")  # fmt: skip
    p.add_argument("--share", choices=["on", "off"], default="on",
                   help="off: the speculative engine keeps its rollouts on its rank (a control)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=2, help="runs of each engine (alternating)")
    p.add_argument("--timeline", action="store_true",
                   help="print where each call's time went on each rank (ms per kind, counters)")  # fmt: skip
    p.add_argument("--json", default=None)
    args = p.parse_args(script_args())
    from shardgen.config import MAX_SPECULATE

    if not 1 <= args.speculate <= MAX_SPECULATE:
        p.error(f"--speculate must be in 1..{MAX_SPECULATE}, got {args.speculate}")
    run_as_ranks(__file__, args.world, rank_main, args)


if __name__ == "__main__":
    main()
