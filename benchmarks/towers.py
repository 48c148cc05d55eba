"""A VLM rollout with images on half the ranks: shardgen against HF generate(synced_gpus=True) on
ZeRO-3 with a dummy image on the image-less ranks, and against local replicas.

    python benchmarks/towers.py                    # 2 gloo ranks on CPU
    python benchmarks/towers.py --json towers.json

A Qwen2-VL built in code (``--hidden``, ``--layers`` text layers, ``--depth`` vision blocks).
Rank 0 holds ``--prompts`` prompts with one image each, rank 1 as many text-only prompts; each
decodes ``--gen`` tokens (no EOS). Per method, after the model is built and sharded (not
timed): the generation's wall time on the slowest rank, and each rank's peak resident memory
(VmHWM, MiB) during generation above what it held once the model was in place (its shard or
replica), beside that resident baseline.

- ``shardgen``: one FSDP2 engine, ``engine.generate(prompts, inputs=...)``, batched per rank;
  rank 1 runs the vision tower on shadow images only on the ticks rank 0 runs it.
- ``hf-zero3-dummy``: DeepSpeed ZeRO-3, HF ``generate(synced_gpus=True)`` per prompt, rank 1's
  prompts carrying a dummy image (the workaround that keeps the tower's gathers in step: it
  changes rank 1's prompts and outputs).
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
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    torch.manual_seed(0)
    h = args.hidden
    text = dict(
        vocab_size=4096, hidden_size=h, intermediate_size=2 * h, num_hidden_layers=args.layers,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096, eos_token_id=None,
        pad_token_id=0,
        rope_parameters={"rope_type": "default", "mrope_section": [8, 12, 12], "rope_theta": 1e4},
    )  # fmt: skip
    vision = dict(
        depth=args.depth, embed_dim=h // 2, hidden_size=h, num_heads=8, mlp_ratio=2, patch_size=14,
        spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
    )  # fmt: skip
    cfg = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=4000, video_token_id=4001,
                        vision_start_token_id=4002, vision_end_token_id=4003)  # fmt: skip
    m = Qwen2VLForConditionalGeneration(cfg).eval()
    m.generation_config.eos_token_id = None
    m.generation_config.pad_token_id = 0
    return m


def image(seed: int, side: int = 8):
    import torch

    g = torch.Generator().manual_seed(seed)
    return {"pixel_values": torch.randn((side * side, 3 * 2 * 14 * 14), generator=g),
            "image_grid_thw": torch.tensor([[1, side, side]])}  # fmt: skip


def prompt(i: int, x) -> list[int]:
    ids = [10 + i, 11, 12]
    if x is not None:
        n = int(x["image_grid_thw"].prod()) // 4
        ids += [4002] + [4000] * n + [4003]
    return ids + [20, 21, 22, 23]


def hf_one(model, p, x, gen: int, synced: bool):
    import torch

    ids = torch.tensor([p])
    kw = {} if x is None else dict(x, mm_token_type_ids=(ids == 4000).int())
    return model.generate(input_ids=ids, max_new_tokens=gen, min_new_tokens=gen, do_sample=False,
                          synced_gpus=synced, **kw)  # fmt: skip


def rank_main(args) -> None:
    import torch
    import torch.distributed as dist

    import shardgen

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_grad_enabled(False)
    has_images = rank % 2 == 0
    xs = [image(100 * rank + i) if has_images else None for i in range(args.prompts)]
    ps = [prompt(i, x) for i, x in enumerate(xs)]
    full = sum(p.numel() * p.element_size() for p in model_of(args).parameters()) / 2**20
    out: dict = {"model_mb": round(full, 1)}
    if rank == 0:
        print(
            f"model: {full:.1f} MiB of weights (a shard: {full / dist.get_world_size():.1f} MiB)", flush=True
        )
    for method in ("shardgen", "hf-zero3-dummy", "replica"):
        dist.barrier()
        if method == "shardgen":
            eng = shardgen.Engine(model_of(args), backend="fsdp2", gather="per-layer")
        elif method == "hf-zero3-dummy":
            import deepspeed

            cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
            engine, *_ = deepspeed.initialize(model=model_of(args), config=cfg)
        else:
            m = model_of(args)
        dist.barrier()
        base = reset_peak()
        t0 = time.perf_counter()
        if method == "shardgen":
            eng.generate(ps, inputs=xs, max_new_tokens=args.gen, eos_token_id=None, pad_token_id=0)
        elif method == "hf-zero3-dummy":
            for p, x in zip(ps, xs, strict=True):
                if x is None:  # the workaround: a dummy image keeps the tower's gathers in step
                    x = image(999, side=2)
                    p = p[:3] + [4002, 4000, 4003] + p[3:]
                hf_one(engine.module, p, x, args.gen, synced=True)
        else:
            for p, x in zip(ps, xs, strict=True):
                hf_one(m, p, x, args.gen, synced=False)
        wall = torch.tensor([time.perf_counter() - t0])
        peak = vm_hwm_mb() - base
        if method == "shardgen":
            eng.close()
        elif method == "hf-zero3-dummy":
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
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--gen", type=int, default=16)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(script_args())
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    run_as_ranks(__file__, args.nproc, rank_main, args)


if __name__ == "__main__":
    main()
