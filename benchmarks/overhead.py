"""Tick overhead: shardgen vs HF generate(synced_gpus=True) on the same FSDP2 model, side by side.

    python benchmarks/overhead.py                 # spawns 2 gloo ranks on CPU
    python benchmarks/overhead.py --nproc 2 --rounds 5 --json out.json

Balanced workload (every rank the same batch shape, no EOS, so both run exactly
max_new_tokens steps): the only difference is the control plane and the engine's
bookkeeping. Rounds alternate HF and shardgen so drift hits both. Prints tokens/s
of each and the ratio shardgen / HF (target >= 0.95).
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
    from transformers import AutoModelForCausalLM, LlamaConfig

    import shardgen

    torch.set_num_threads(1)
    shardgen.init()
    rank = dist.get_rank()
    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 2,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=1024,
    )

    def build():
        torch.manual_seed(0)
        m = AutoModelForCausalLM.from_config(cfg).eval()
        m.generation_config.eos_token_id = None  # balanced: nobody stops early
        m.generation_config.pad_token_id = 0
        return m

    hf_model = build()
    for layer in hf_model.model.layers:
        fully_shard(layer)
    fully_shard(hf_model)
    engine = shardgen.Engine(build(), backend="fsdp2", max_batch_size=args.batch, gather=args.gather)

    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(3, args.vocab, (args.batch, args.prompt_len), generator=g)
    mask = torch.ones_like(ids)
    n = args.new_tokens

    def run_hf():
        with torch.no_grad():
            return hf_model.generate(
                ids, attention_mask=mask, max_new_tokens=n, do_sample=False, synced_gpus=True
            )

    def run_sg():
        return engine.generate_ids(
            ids, attention_mask=mask, max_new_tokens=n, eos_token_id=[], pad_token_id=0
        )

    # warm-up both (lazy init, allocator), then check they agree
    assert torch.equal(run_hf(), run_sg()), "shardgen and HF disagree"
    times = {"hf": 0.0, "shardgen": 0.0}
    for _ in range(args.rounds):
        for name, fn in (("hf", run_hf), ("shardgen", run_sg)):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            dist.barrier()
            times[name] += time.perf_counter() - t0
    engine.close()
    tokens = args.rounds * args.batch * n * dist.get_world_size()
    if rank == 0:
        res = {
            "hf_synced_gpus_tok_s": tokens / times["hf"],
            "shardgen_tok_s": tokens / times["shardgen"],
            "ratio": times["hf"] / times["shardgen"],
            "world": dist.get_world_size(),
            "config": vars(args),
            "engine_stats_rank0": engine.stats(),
        }
        print(f"HF generate(synced_gpus=True): {res['hf_synced_gpus_tok_s']:8.1f} tok/s")
        print(f"shardgen Engine             : {res['shardgen_tok_s']:8.1f} tok/s")
        print(f"ratio shardgen / HF         : {res['ratio']:.3f}")
        write_json(args.json, res)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)
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
