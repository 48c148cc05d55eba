"""TRL's ``tools=`` loop: TRL's own generation against shardgen's GRPOTrainer, cache on and off.

    python benchmarks/trl_tools.py                          # 2 gloo ranks on CPU, DeepSpeed ZeRO-3
    python benchmarks/trl_tools.py --rounds 3 --json trl_tools.json

One GRPO step per method and round (a fresh trainer each, rounds interleaved), ``tools=[add]``,
on tests/helpers/tool_model.py's tiny chat model, which calls ``add`` 0-2 times per question then answers.
Every rank gets the same questions (``--questions``, each asked ``num_generations=2`` times), so
every rank takes the same number of tool turns: TRL's own loop hangs or aborts otherwise
(tests/multirank/test_trl_tools.py). Methods: ``stock`` (TRL's ``GRPOTrainer``: HF ``generate()`` per turn on
the ZeRO-3 model, its parameters gathered, each turn's whole prompt prefilled again), ``cache``
(shardgen's subclass, prefix cache on), ``nocache`` (``prefix_cache_tokens=0``). Per method: the
generation phase's wall time (``_generate``, the tool turns included; the slowest rank's), the
prompt tokens computed (all ranks; ``stock``: every call's prompts, unpadded and as HF's padded
batch computes them) and those taken from the cache.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path[:0] = [os.path.dirname(__file__), os.path.join(os.path.dirname(__file__), "..", "tests", "helpers")]
from common import run_as_ranks, script_args, write_json  # noqa: E402

QUESTIONS = ["What is 3 plus 4 plus 5?", "What is 1 plus 2 plus 6?", "What is 3 plus 4?", "Say hi."]


def rank_main(args) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    import tool_model as tm
    import trl_tool_scenarios as sc

    rank, world = dist.get_rank(), dist.get_world_size()
    tm.TOOL_S = args.tool_s
    path = tm.shipped() if rank == 0 else str(tm.SHIPPED)  # rank 0 checks it answers as trained
    dist.barrier()
    questions = [list(args.questions)] * world
    results: dict[str, list[dict]] = {m: [] for m in args.methods}
    outputs: dict[str, list] = {}
    for _ in range(args.rounds):
        for m in args.methods:
            o = sc.grpo_tool_step(args.backend, path, questions, m, args.temperature)
            if m == "stock":
                computed = sum(sum(c) for c in o["calls"])
                padded = sum(len(c) * max(c) for c in o["calls"])
                cached = 0
            else:
                computed = padded = o["stats"]["prefill_tokens"]
                cached = o["stats"]["cached_prompt_tokens"]
            tot = torch.tensor([computed, padded, cached, len(o["calls"])], dtype=torch.float64)
            dist.all_reduce(tot)
            slow = torch.tensor([o["generate_s"]], dtype=torch.float64)
            dist.all_reduce(slow, op=dist.ReduceOp.MAX)
            results[m].append(
                {"computed": int(tot[0]), "padded": int(tot[1]), "cached": int(tot[2]),
                 "calls": int(tot[3]), "s": slow.item()}
            )  # fmt: skip
            outputs.setdefault(m, [o["completion_ids"], o["tool_mask"]])
    same = {m: outputs[m] == outputs[args.methods[0]] for m in args.methods}
    if rank == 0:
        summary = {}
        print(f"{world} ranks, {args.backend}, {len(args.questions)} questions x 2 samples per rank, "
              f"T={args.temperature}, tool call {args.tool_s * 1e3:.0f} ms, "
              f"{args.rounds} rounds (median)")  # fmt: skip
        print("| method | generation calls | prompt tokens computed | padded | cached | wall s |")
        print("|---|---|---|---|---|---|")
        for m, rows in results.items():
            med = {
                k: statistics.median(r[k] for r in rows)
                for k in ("calls", "computed", "padded", "cached", "s")
            }
            summary[m] = med
            print(f"| {m} | {med['calls']:.0f} | {med['computed']:.0f} | {med['padded']:.0f} | "
                  f"{med['cached']:.0f} | {med['s']:.3f} |")  # fmt: skip
        for m in args.methods[1:]:
            print(
                f"wall time, {m} / {args.methods[0]}: {summary[m]['s'] / summary[args.methods[0]]['s']:.2f}"
            )
        print(f"rank 0's completions and tool masks equal to {args.methods[0]}'s: {same}")
        write_json(args.json, {"args": vars(args), "summary": summary, "rounds": results, "same": same})
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--backend", default="deepspeed", choices=("deepspeed", "fsdp2"))
    p.add_argument("--methods", nargs="+", default=["stock", "cache", "nocache"])
    p.add_argument("--questions", nargs="+", default=QUESTIONS)
    p.add_argument("--temperature", type=float, default=0.05, help="near greedy: the methods' tokens agree")
    p.add_argument("--tool-s", type=float, default=0.0, help="seconds one tool call takes")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json")
    args = p.parse_args(script_args())
    run_as_ranks(__file__, args.nproc, rank_main, args)


if __name__ == "__main__":
    main()
