"""Hybrid sharding: 2x2 (replicate x shard, one engine per shard group) against 1x4 (one engine).

    python benchmarks/hybrid.py                  # 4 gloo ranks on CPU
    python benchmarks/hybrid.py --prompts 48 --rounds 3 --json out.json

benchmarks/skew.py's workload: every rank answers its own skewed prompts of the shipped toy
task (``make_prompts(skew=True)``). Two layouts of the same weights, in one process, rounds
interleaved:

- ``1x4``: one engine over all 4 ranks (FSDP2 sharded 4 ways): every step of every rank
  waits for the slowest of 4 in the tick, and a rank with nothing left shadows for 3 peers.
- ``2x2``: the model wrapped by ``fully_shard`` on a 2-D (replicate, shard) mesh; shardgen
  derives one engine per shard group of 2, each with its own tick and early stop.

Reports useful tokens/s (answer tokens up to EOS) over the whole world and the ratio; checks
every answer against the task.
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
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import shardgen
    from shardgen.toy import check_answer, make_prompts, toy_model_path

    torch.set_num_threads(1)
    shardgen.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % args.shard_size:
        raise ValueError(f"--shard-size {args.shard_size} does not divide the world of {world} ranks")
    path = toy_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [p["prompt"] for p in make_prompts(args.prompts, seed=rank, skew=True)]

    shape = (world // args.shard_size, args.shard_size)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("rep", "shard"))
    hsdp = AutoModelForCausalLM.from_pretrained(path).eval()
    for layer in hsdp.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(hsdp, mesh=mesh)
    opts = dict(max_batch_size=args.batch, gather=args.gather)
    engines = {
        f"1x{world}": shardgen.Engine.from_pretrained(path, backend="fsdp2", tokenizer=tok, **opts),
        f"{world // args.shard_size}x{args.shard_size}": shardgen.Engine(hsdp, tok, backend="fsdp2", **opts),
    }
    times = {k: 0.0 for k in engines}
    useful = 0
    for _ in range(args.rounds):
        for name, eng in engines.items():
            dist.barrier()
            t0 = time.perf_counter()
            texts = [c.text for c in eng.generate(prompts, max_new_tokens=args.max_new_tokens)]
            dist.barrier()
            times[name] += time.perf_counter() - t0
            bad = [p for p, t in zip(prompts, texts, strict=True) if not check_answer(p, t)]
            assert not bad, f"rank {rank} {name}: wrong answers for {bad[:3]}"
            useful = sum(len(t.split()) + 1 for t in texts)  # numbers + EOS
    for e in engines.values():
        e.close()
    total = torch.tensor([useful], dtype=torch.float64)
    dist.all_reduce(total)
    if rank == 0:
        tok_s = {k: args.rounds * total.item() / v for k, v in times.items()}
        first, second = list(tok_s)
        ratio = tok_s[second] / tok_s[first]
        res = {"useful_tok_s": tok_s, "ratio": ratio, "world": world, "config": vars(args)}
        for k, v in tok_s.items():
            print(f"{k:6s} {v:9.1f} useful tok/s")
        print(f"{second} / {first} = {res['ratio']:.2f}")
        write_json(args.json, res)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--shard-size", type=int, default=2)
    p.add_argument("--prompts", type=int, default=32, help="prompts per rank")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=26)
    p.add_argument("--gather", default="per-layer", help="per-layer (sharded decode) or once")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args(script_args())
    run_as_ranks(__file__, args.nproc, rank_main, args)


if __name__ == "__main__":
    main()
