"""Multi-turn rollouts: the prefix cache on against off, and HF generate() re-prefilling each turn.

    python benchmarks/turns.py                              # 2 gloo ranks on CPU, FSDP2
    python benchmarks/turns.py --rounds 3 --json turns.json

The issue's conversation: a 48-token start, then turns of ``--gen`` generated tokens (no EOS)
and ``--tool`` environment tokens; rank 0 takes ``--turns`` turns, the other ranks ``--turns-other``
(uneven turns). ``--convs`` conversations per rank run at once (``engine.rollout(env=...)``).
Per method, rounds interleaved: the prompt tokens computed (all ranks) against the new tokens
(each turn's reply and the last answer's token: what a turn adds), the cached prompt tokens,
and the wall time of the whole rollout (the slowest rank's). ``hf``: rank 0 alone runs the same
conversations with single-process HF ``generate()`` per turn on an unsharded copy, each turn's
prompt re-prefilled (the way a tool loop calling ``generate()`` per turn runs, without ZeRO-3's
gathers: a floor for such loops on sharded weights).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import run_as_ranks, script_args, write_json  # noqa: E402


def model_of(hidden: int, layers: int, seed: int = 0):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=4096, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096,
    )  # fmt: skip
    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_config(cfg).eval()
    m.generation_config.pad_token_id = 0
    m.generation_config.eos_token_id = None
    return m


def env_of(turns: int, tool: int):
    """A deterministic environment: ``tool`` ids derived from the conversation, ``turns`` model turns."""
    seen: dict[int, int] = {}

    def env(row, c):
        seen[row] = seen.get(row, 0) + 1
        if seen[row] >= turns:
            return None
        base = sum(c.token_ids) + len(c.prompt_token_ids)
        return [3 + (base * 31 + j * 17) % 4000 for j in range(tool)]

    return env


def starts(rank: int, convs: int, length: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(1000 + rank)
    return [torch.randint(3, 4000, (length,), generator=g).tolist() for _ in range(convs)]


def hf_conversations(model, prompts, turns: int, gen: int, tool: int) -> float:
    """Each turn: ``model.generate()`` on the whole conversation so far (greedy, no cache kept)."""
    import torch

    env = env_of(turns, tool)
    t0 = time.perf_counter()
    with torch.no_grad():
        for row, p in enumerate(prompts):
            conv = list(p)
            while True:
                out = model.generate(torch.tensor([conv]), max_new_tokens=gen, min_new_tokens=gen,
                                     do_sample=False, synced_gpus=False)  # fmt: skip
                new = out[0, len(conv) :].tolist()

                class C:  # what env reads of a Completion
                    token_ids, prompt_token_ids = new, conv

                reply = env(row, C)
                if reply is None:
                    break
                conv = conv + new + reply
    return time.perf_counter() - t0


def rank_main(args) -> None:
    import torch
    import torch.distributed as dist

    import shardgen

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    turns = args.turns if rank == 0 else args.turns_other
    prompts = starts(rank, args.convs, args.start)
    # the new tokens of a conversation: its start, then per later turn the reply and one answer token
    new_tokens = args.convs * (args.start + (turns - 1) * (args.tool + 1))
    results: dict[str, list[dict]] = {m: [] for m in args.methods}
    engines = {}
    for m in args.methods:
        if m == "hf":
            continue
        cap = None if m == "cache" else 0
        opts = dict(
            backend=args.backend, gather=args.gather, prefix_cache_tokens=cap, max_batch_size=args.convs
        )
        engines[m] = shardgen.Engine(model_of(args.hidden, args.layers), **opts)
    ref = model_of(args.hidden, args.layers) if "hf" in args.methods and rank == 0 else None
    for _ in range(args.rounds):
        for m in args.methods:
            dist.barrier()
            if m == "hf":
                t = hf_conversations(ref, prompts, turns, args.gen, args.tool) if rank == 0 else 0.0
                results[m].append({"s": t})
                continue
            eng = engines[m]
            before = eng.stats()
            t0 = time.perf_counter()
            eng.rollout(prompts, n=1, env=env_of(turns, args.tool), do_sample=False, max_new_tokens=args.gen)
            t = time.perf_counter() - t0
            after = eng.stats()
            row = [after[k] - before[k] for k in ("prefill_tokens", "cached_prompt_tokens")] + [new_tokens]
            tot = torch.tensor(row, dtype=torch.float64)
            dist.all_reduce(tot)
            slow = torch.tensor([t], dtype=torch.float64)
            dist.all_reduce(slow, op=dist.ReduceOp.MAX)
            results[m].append(
                {"computed": int(tot[0]), "cached": int(tot[1]), "new": int(tot[2]), "s": slow.item()}
            )
            with eng.paused():  # between rounds, as between trainer steps: the cache is dropped
                pass
    for eng in engines.values():
        eng.close()
    if rank == 0:
        summary = {}
        print(f"{world} ranks, {args.backend} {args.gather}, {args.convs} conversations per rank, start "
              f"{args.start}, turns {args.turns} (rank 0) / {args.turns_other}, {args.gen} + {args.tool} "
              f"tokens a turn, {args.rounds} rounds (median)")  # fmt: skip
        print("| method | prompt tokens computed | cached | new tokens | computed / new | wall s |")
        print("|---|---|---|---|---|---|")
        for m, rows in results.items():
            s = statistics.median(r["s"] for r in rows)
            if m == "hf":
                summary[m] = {"s": s}
                print(f"| hf generate() per turn (rank 0, unsharded) | | | | | {s:.2f} |")
                continue
            c, k, n = (statistics.median(r[key] for r in rows) for key in ("computed", "cached", "new"))
            summary[m] = {"computed": c, "cached": k, "new": n, "s": s}
            print(f"| {m} | {c:.0f} | {k:.0f} | {n:.0f} | {c / n:.2f} | {s:.2f} |")
        if "cache" in summary and "nocache" in summary:
            print(f"wall time, cache / no cache: {summary['cache']['s'] / summary['nocache']['s']:.2f}")
        if "cache" in summary and "hf" in summary:
            print(f"wall time, cache / hf per turn: {summary['cache']['s'] / summary['hf']['s']:.2f}")
        write_json(args.json, {"args": vars(args), "summary": summary, "rounds": results})
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--backend", default="fsdp2")
    p.add_argument("--gather", default="per-layer")
    p.add_argument("--methods", nargs="+", default=["cache", "nocache", "hf"])
    p.add_argument("--convs", type=int, default=1)
    p.add_argument("--start", type=int, default=48)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--turns-other", type=int, default=3)
    p.add_argument("--gen", type=int, default=8)
    p.add_argument("--tool", type=int, default=256)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json")
    args = p.parse_args(script_args())
    run_as_ranks(__file__, args.nproc, rank_main, args)


if __name__ == "__main__":
    main()
