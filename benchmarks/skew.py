"""Skewed workload: shardgen vs today's workarounds, on the shipped toy model, side by side.

    python benchmarks/skew.py                  # 2 gloo ranks on CPU
    python benchmarks/skew.py --nproc 2 --prompts 96 --json out.json

Every rank answers its own prompts from the toy task (``make_prompts(skew=True)``):
most answers are 1-4 numbers, a few are 20-25, so EOS comes at very different steps.
The same FSDP2-sharded weights serve every method, run one after another in one process:

- ``hf_synced``: HF ``generate(synced_gpus=True)`` over batches, the ranks making the same
  number of calls (uneven calls would hang); a batch runs until its longest answer ends.
- ``hf_eos_none``: the same with ``eos_token_id=None`` (the deadlock workaround in the wild):
  every batch decodes ``max_new_tokens``, then the answers are cut at the first EOS.
- ``shardgen``: one ``generate()`` per rank (continuous refill), and ``shardgen_waves`` with
  refill off.

Reports useful tokens/s (answer tokens up to EOS) and each method's ratio to shardgen; checks
every answer of every method against the task.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import run_as_ranks, script_args, write_json  # noqa: E402


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import shardgen
    from shardgen.toy import check_answer, make_prompts, toy_model_path

    torch.set_num_threads(1)
    shardgen.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    path = toy_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [p["prompt"] for p in make_prompts(args.prompts, seed=rank, skew=True)]

    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    for layer in hf.model.layers:
        fully_shard(layer)
    fully_shard(hf)

    def hf_run(eos_none: bool) -> list[str]:
        texts = []
        for i in range(0, len(prompts), args.batch):
            enc = tok(prompts[i : i + args.batch], return_tensors="pt", padding=True)
            kw = dict(max_new_tokens=args.max_new_tokens, do_sample=False, synced_gpus=True)
            if eos_none:
                kw.update(eos_token_id=None)
                saved, hf.generation_config.eos_token_id = hf.generation_config.eos_token_id, None
            with torch.no_grad():
                out = hf.generate(**enc, **kw)
            if eos_none:
                hf.generation_config.eos_token_id = saved
            for row in out[:, enc["input_ids"].shape[1] :].tolist():
                if tok.eos_token_id in row:
                    row = row[: row.index(tok.eos_token_id) + 1]
                texts.append(tok.decode(row, skip_special_tokens=True))
        return texts

    opts = dict(max_batch_size=args.batch, gather=args.gather)
    engines = {
        "shardgen": shardgen.Engine.from_pretrained(path, backend="fsdp2", **opts),
        "shardgen_waves": shardgen.Engine.from_pretrained(path, backend="fsdp2", refill=False, **opts),
    }

    def sg_run(name: str) -> list[str]:
        return [c.text for c in engines[name].generate(prompts, max_new_tokens=args.max_new_tokens)]

    methods = {
        "hf_synced": lambda: hf_run(False),
        "hf_eos_none": lambda: hf_run(True),
        "shardgen": lambda: sg_run("shardgen"),
        "shardgen_waves": lambda: sg_run("shardgen_waves"),
    }
    times = {k: 0.0 for k in methods}
    useful = 0
    for rnd in range(args.rounds):
        for name, fn in methods.items():
            dist.barrier()
            t0 = time.perf_counter()
            texts = fn()
            dist.barrier()
            times[name] += time.perf_counter() - t0
            bad = [p for p, t in zip(prompts, texts, strict=True) if not check_answer(p, t)]
            assert not bad, f"rank {rank} {name}: wrong answers for {bad[:3]}"
            if rnd == 0 and name == "shardgen":
                useful = sum(len(t.split()) + 1 for t in texts)  # numbers + EOS
    for e in engines.values():
        e.close()
    total = torch.tensor([useful], dtype=torch.float64)
    dist.all_reduce(total)
    if rank == 0:
        tok_s = {k: args.rounds * total.item() / v for k, v in times.items()}
        res = {
            "useful_tok_s": tok_s,
            "ratio_shardgen_over": {k: tok_s["shardgen"] / v for k, v in tok_s.items()},
            "world": world,
            "config": vars(args),
        }
        for k, v in tok_s.items():
            print(f"{k:15s} {v:9.1f} useful tok/s   shardgen is {tok_s['shardgen'] / v:5.2f}x")
        write_json(args.json, res)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--prompts", type=int, default=64, help="prompts per rank")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=26)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument(
        "--gather",
        default="per-layer",
        help="shardgen's gather policy (default per-layer: what HF's path gathers; or auto, once)",
    )
    p.add_argument("--json", default=None)
    args = p.parse_args(script_args())
    run_as_ranks(__file__, args.nproc, rank_main, args)


if __name__ == "__main__":
    main()
