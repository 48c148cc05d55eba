"""DeepSpeed ZeRO-3 decode: shardgen vs HF generate(synced_gpus=True), side by side, per step.

    python benchmarks/ds_decode.py                        # 2 gloo ranks, tiny + medium, +/- offload
    python benchmarks/ds_decode.py --sizes medium --offload on --rounds 3 --json out.json

Both ranks decode the same 4x8 prompt batch, 24 new tokens, no EOS. Every method runs on a
``deepspeed.initialize`` ZeRO-3 engine built from the same weights (stock DeepSpeed settings
otherwise, ``memory_efficient_linear`` off), one engine per method so that each keeps its own
hooks and settings and the rounds can alternate:

- ``hf``: HF ``generate(synced_gpus=True)`` on ``engine.module`` (DeepSpeed's own prefetch);
- ``shardgen``: ``Engine(engine, backend="deepspeed")``, the bucket plan (``--bucket-mb``);
- ``shardgen_per_module``: the same with ``bucket_mb=0`` (one all-gather per module, as before
  the plan);
- ``floor``: the unsharded model's decode (HF ``generate`` without sharding) plus an all-gather
  of the same bytes in per-layer chunks (embeddings, each decoder layer, the rest) per step.

Outputs of the three generators are checked equal first. Prints ms per step, each method as a
multiple of HF and of the floor, and all-gathers per forward (counted in the rank).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import run_as_ranks, script_args  # noqa: E402

SIZES = {"tiny": (64, 3), "medium": (512, 6)}  # hidden, layers


def _count_gathers():
    """Wrap torch.distributed's all-gathers (before DeepSpeed binds them) with a counter."""
    import torch.distributed as dist

    box = {"n": 0}
    for name in ("all_gather_into_tensor", "_all_gather_base", "all_gather"):
        orig = getattr(dist, name, None)
        if orig is None:
            continue

        def counted(*a, _orig=orig, **k):
            box["n"] += 1
            return _orig(*a, **k)

        setattr(dist, name, counted)
    return box


def bench_one(args: argparse.Namespace, size: str, offload: bool, counter: dict) -> dict:
    """One model size and offload setting: every method, rounds interleaved."""
    import deepspeed
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, LlamaConfig

    import shardgen

    world = dist.get_world_size()
    hidden, layers = SIZES[size]
    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=256,
    )

    def build():
        torch.manual_seed(0)
        m = AutoModelForCausalLM.from_config(cfg).eval()
        m.generation_config.eos_token_id = None
        m.generation_config.pad_token_id = 0
        return m

    zero = {"stage": 3, "memory_efficient_linear": False}
    if offload:
        zero["offload_param"] = {"device": "cpu"}
    ds_cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero}

    def ds_engine():
        eng, *_ = deepspeed.initialize(model=build(), config=ds_cfg)
        eng.module.eval()
        return eng

    hf_eng = ds_engine()
    # per-layer: the plan of coalesced gathers is what is measured (auto would gather this model once)
    opts = dict(backend="deepspeed", max_batch_size=args.batch, gather="per-layer")
    sg = shardgen.Engine(ds_engine(), bucket_mb=args.bucket_mb, **opts)
    sg0 = shardgen.Engine(ds_engine(), bucket_mb=0, **opts)
    n_buckets, n_units = len(sg.backend.buckets or ()), len(sg.backend.units())
    plain = build()
    g = torch.Generator().manual_seed(1234)  # the same batch on every rank
    ids = torch.randint(3, args.vocab, (args.batch, args.prompt_len), generator=g)
    mask = torch.ones_like(ids)
    n = args.new_tokens

    def nbytes(mod):
        return sum(p.numel() * p.element_size() for p in mod.parameters())

    chunks = [nbytes(plain.model.embed_tokens)] + [nbytes(layer) for layer in plain.model.layers]
    chunks.append(nbytes(plain) - sum(chunks))
    bufs = [(torch.empty(c // 4 // world), torch.empty(c // 4 // world * world)) for c in chunks]
    group = dist.new_group(backend="gloo")
    kw = dict(attention_mask=mask, max_new_tokens=n)

    def run_hf():
        with torch.no_grad():
            return hf_eng.module.generate(ids, do_sample=False, synced_gpus=True, **kw)

    def run_floor():
        with torch.no_grad():
            out = plain.generate(ids, do_sample=False, synced_gpus=False, **kw)
        for _ in range(n):
            for src, dst in bufs:
                dist.all_gather_into_tensor(dst, src, group=group)
        return out

    methods = {
        "hf": run_hf,
        "shardgen": lambda: sg.generate_ids(ids, eos_token_id=[], pad_token_id=0, **kw),
        "shardgen_per_module": lambda: sg0.generate_ids(ids, eos_token_id=[], pad_token_id=0, **kw),
        "floor": run_floor,
    }
    ref = run_hf()
    for name in ("shardgen", "shardgen_per_module", "floor"):
        assert torch.equal(methods[name]().cpu(), ref.cpu()), f"{name} differs from HF"
    times = dict.fromkeys(methods, 0.0)
    gathers = dict.fromkeys(methods, 0)
    for _ in range(args.rounds):
        for name, fn in methods.items():
            dist.barrier()
            c0, t0 = counter["n"], time.perf_counter()
            fn()
            dist.barrier()
            times[name] += time.perf_counter() - t0
            gathers[name] += counter["n"] - c0
    sg.close()
    sg0.close()
    steps = args.rounds * n
    ms = {k: 1e3 * v / steps for k, v in times.items()}
    return {
        "size": size,
        "hidden": hidden,
        "layers": layers,
        "offload_param": "cpu" if offload else "none",
        "ms_per_step": ms,
        "x_hf": {k: v / ms["hf"] for k, v in ms.items()},
        "x_floor": {k: v / ms["floor"] for k, v in ms.items()},
        "gathers_per_forward": {k: v / steps for k, v in gathers.items()},
        "buckets": n_buckets,
        "units": n_units,
    }


def rank_main(args: argparse.Namespace) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch
    import torch.distributed as dist

    import shardgen

    torch.set_num_threads(1)
    shardgen.init()
    counter = _count_gathers()
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for size in args.sizes.split(","):
        for offload in {"on": [True], "off": [False], "both": [False, True]}[args.offload]:
            row = bench_one(args, size, offload, counter)
            results.append(row)
            if rank == 0:
                print(
                    f"\n{size} (hidden {row['hidden']}, {row['layers']} layers), "
                    f"offload_param={row['offload_param']}, {world} ranks, "
                    f"{row['units']} modules in {row['buckets']} buckets"
                )
                print(f"{'method':22s} {'ms/step':>8s} {'x HF':>6s} {'x floor':>8s} {'gathers/fwd':>12s}")
                for k, v in row["ms_per_step"].items():
                    print(
                        f"{k:22s} {v:8.1f} {row['x_hf'][k]:6.2f} {row['x_floor'][k]:8.2f} "
                        f"{row['gathers_per_forward'][k]:12.1f}",
                        flush=True,
                    )
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"world": world, "config": vars(args), "results": results}, f, indent=2)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2, help="gloo ranks to spawn")
    p.add_argument("--sizes", default="tiny,medium", help="comma list of: " + ", ".join(SIZES))
    p.add_argument("--offload", choices=["on", "off", "both"], default="both")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--bucket-mb", type=float, default=None, help="default: the engine's")
    p.add_argument("--json", default=None)
    args = p.parse_args(script_args())
    run_as_ranks(__file__, args.world, rank_main, args)


if __name__ == "__main__":
    main()
