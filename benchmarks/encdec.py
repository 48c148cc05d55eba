"""An encoder-decoder rollout with uneven requests per rank: shardgen against HF
generate(synced_gpus=True) on ZeRO-3 (equal call counts: dummy calls on the rank with fewer
prompts), and against local replicas.

    python benchmarks/encdec.py                    # 2 gloo ranks on CPU
    python benchmarks/encdec.py --json encdec.json

A T5 built in code (``--hidden``, ``--layers`` encoder and decoder layers). Rank 0 holds
``--prompts`` prompts of different lengths, the other ranks half as many; each decodes ``--gen``
tokens (no EOS). Per method, after the model is built and sharded (not timed): the generation's
wall time on the slowest rank, and each rank's peak resident memory (VmHWM, MiB) during
generation above what it held once the model was in place (its shard or replica).

- ``shardgen``: one FSDP2 engine, ``engine.generate(prompts)``, batched per rank; each request's
  encoder runs in its first forward, and a rank with none starting runs it on a shadow token.
- ``hf-zero3-synced``: DeepSpeed ZeRO-3, HF ``generate(synced_gpus=True)`` per prompt; a rank
  with fewer prompts makes dummy calls until every rank made as many (the workaround that keeps
  the gathers in step: without it the rank with more calls hangs).
- ``replica``: the whole model on every rank, HF ``generate()`` per prompt, no communication.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "helpers"))
from common import reset_peak, run_as_ranks, script_args, vm_hwm_mb, write_json  # noqa: E402


def model_of(args):
    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    h = args.hidden
    cfg = T5Config(
        vocab_size=4096, d_model=h, d_kv=h // 8, d_ff=2 * h, num_layers=args.layers,
        num_decoder_layers=args.layers, num_heads=8, decoder_start_token_id=0, pad_token_id=0,
        eos_token_id=None,
    )  # fmt: skip
    m = T5ForConditionalGeneration(cfg).eval()
    m.generation_config.eos_token_id = None
    return m


def prompts_of(rank: int, n: int) -> list[list[int]]:
    return [[10 + rank + i + j for j in range(8 + 8 * (i % 4))] for i in range(n)]  # 8 to 32 tokens


def hf_one(model, p, gen: int, synced: bool):
    import torch

    return model.generate(input_ids=torch.tensor([p]), max_new_tokens=gen, min_new_tokens=gen,
                          do_sample=False, synced_gpus=synced)  # fmt: skip


def rank_main(args) -> None:
    import torch
    import torch.distributed as dist

    import shardgen

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_grad_enabled(False)
    ps = prompts_of(rank, args.prompts if rank == 0 else args.prompts // 2)
    calls = args.prompts  # the most any rank makes
    full = sum(p.numel() * p.element_size() for p in model_of(args).parameters()) / 2**20
    out: dict = {"model_mb": round(full, 1)}
    if rank == 0:
        print(
            f"model: {full:.1f} MiB of weights (a shard: {full / dist.get_world_size():.1f} MiB)", flush=True
        )
    for method in ("shardgen", "hf-zero3-synced", "replica"):
        dist.barrier()
        if method == "shardgen":
            eng = shardgen.Engine(model_of(args), backend="fsdp2", gather="per-layer")
        elif method == "hf-zero3-synced":
            import deepspeed

            cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
            engine, *_ = deepspeed.initialize(model=model_of(args), config=cfg)
        else:
            m = model_of(args)
        dist.barrier()
        base = reset_peak()
        t0 = time.perf_counter()
        if method == "shardgen":
            eng.generate(ps, max_new_tokens=args.gen, eos_token_id=None, pad_token_id=0)
        elif method == "hf-zero3-synced":
            for k in range(calls):  # equal call counts: dummy prompts past this rank's own
                hf_one(engine.module, ps[k] if k < len(ps) else [5], args.gen, synced=True)
        else:
            for p in ps:
                hf_one(m, p, args.gen, synced=False)
        wall = torch.tensor([time.perf_counter() - t0])
        peak = vm_hwm_mb() - base
        if method == "shardgen":
            eng.close()
        elif method == "hf-zero3-synced":
            del engine
        else:
            del m
        dist.all_reduce(wall, op=dist.ReduceOp.MAX)
        mem = torch.tensor([peak, base])
        mems = [torch.zeros(2) for _ in range(dist.get_world_size())]
        dist.all_gather(mems, mem)
        peaks, bases = [round(m[0].item()) for m in mems], [round(m[1].item()) for m in mems]
        out[method] = {"wall_s": round(wall.item(), 2), "peak_above_mb": peaks, "resident_mb": bases}
        if rank == 0:
            print(f"{method:16s} wall {wall.item():6.2f} s   peak above resident (MiB/rank) {peaks}"
                  f"   resident {bases}", flush=True)  # fmt: skip
    if rank == 0:
        write_json(args.json, {"args": vars(args), "results": out})
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--gen", type=int, default=16)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(script_args())
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    run_as_ranks(__file__, args.nproc, rank_main, args)


if __name__ == "__main__":
    main()
