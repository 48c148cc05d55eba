"""Peak resident memory per rank (VmHWM) and loading time: sharded loading vs a full copy per rank.

    PYTHONPATH=src .venv/bin/python benchmarks/loading.py --make /tmp/llama-320m   # once, 1.3 GB
    PYTHONPATH=src .venv/bin/python benchmarks/loading.py --model /tmp/llama-320m --nproc 2 4
    PYTHONPATH=src .venv/bin/python benchmarks/loading.py --model /tmp/llama-320m --nproc 2 4 --dtype bfloat16

For each backend, world size and method, a fresh set of ranks (VmHWM is a lifetime peak):
``full`` is the old path (``AutoModelForCausalLM.from_pretrained`` on every rank, then
``Engine(model)`` shards it); ``sharded`` is ``Engine.from_pretrained`` (``loading.py``). Each
rank records VmHWM after its imports (the baseline), after loading, and after generating
4 tokens for one 8-token prompt; the table shows the worst rank, in MB above the baseline,
next to the issue's bound: 1.25 x (checkpoint bytes / N) + two decoder layers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def vm(field: str) -> float:
    """``/proc/self/status`` field in MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(field)


def make(path: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=20,
        num_attention_heads=16,
        num_key_value_heads=16,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(path, max_shard_size="400MB")
    print(f"{path}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters")


def sizes(path: str) -> tuple[int, int]:
    """(checkpoint bytes, bytes of one decoder layer) from the safetensors headers."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
    from shardgen.checkpoint import Checkpoint

    ck = Checkpoint(path)
    total = sum(e.numel * e.itemsize for e in ck.entries.values())
    layer = sum(e.numel * e.itemsize for k, e in ck.entries.items() if ".layers.0." in k)
    return total, layer


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import shardgen

    if args.backend == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed  # noqa: F401  (part of the baseline, like torch)
    from transformers import AutoModelForCausalLM

    shardgen.init()
    rank = dist.get_rank()
    base = vm("VmHWM")
    dist.barrier()
    t0 = time.perf_counter()
    opts = dict(backend=args.backend, gather="per-layer", max_batch_size=1)
    if args.method == "full":
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).eval()
        engine = shardgen.Engine(model, **opts)
        del model
    else:
        engine = shardgen.Engine.from_pretrained(args.model, dtype=args.dtype, **opts)
    load_s = time.perf_counter() - t0
    loaded = vm("VmHWM")
    ids = torch.arange(3, 11).unsqueeze(0)
    engine.generate_ids(ids, max_new_tokens=4, eos_token_id=[])
    generated = vm("VmHWM")
    engine.close()
    row = dict(rank=rank, base=base, load=loaded - base, gen=generated - base, load_s=load_s)
    with open(f"{args.out}.{rank}", "w") as f:
        json.dump(row, f)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--make", help="write the benchmark checkpoint here and exit")
    p.add_argument("--model", default="/tmp/llama-320m")
    p.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    p.add_argument("--backends", nargs="+", default=["fsdp2", "deepspeed"])
    p.add_argument("--methods", nargs="+", default=["full", "sharded"])
    p.add_argument("--dtype", default="float32", help="load the (fp32) checkpoint in this dtype")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--backend", help=argparse.SUPPRESS)
    p.add_argument("--method", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.make:
        make(args.make)
        return
    if args.worker:
        worker(args)
        return
    total, layer = sizes(args.model)
    if args.dtype in ("bfloat16", "float16"):
        total, layer = total // 2, layer // 2  # the fp32 checkpoint, loaded in 16 bits
    print(f"model in {args.dtype}: {total / 1e6:.0f} MB, one decoder layer {layer / 1e6:.1f} MB")
    print(
        "| backend | N | method | load s | baseline MB | peak after load, MB over baseline | "
        "peak after generate | bound | within |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for backend in args.backends:
        for n in args.nproc:
            bound = (1.25 * total / n + 2 * layer) / 2**20
            for method in args.methods:
                with tempfile.TemporaryDirectory() as tmp:
                    out = os.path.join(tmp, "r")
                    cmd = [
                        sys.executable,
                        "-m",
                        "torch.distributed.run",
                        f"--nproc-per-node={n}",
                        "--master-port=29731",
                        __file__,
                        "--worker",
                        "--model",
                        args.model,
                        "--backend",
                        backend,
                        "--method",
                        method,
                        "--out",
                        out,
                        "--dtype",
                        args.dtype,
                    ]
                    subprocess.run(
                        cmd,
                        env=env,
                        check=True,
                        timeout=3600,
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                    rows = [json.load(open(f"{out}.{r}")) for r in range(n)]
                worst = max(r["gen"] for r in rows)
                print(
                    f"| {backend} | {n} | {method} | {max(r['load_s'] for r in rows):.1f} | "
                    f"{max(r['base'] for r in rows):.0f} | {max(r['load'] for r in rows):.0f} | "
                    f"{worst:.0f} | "
                    f"{bound:.0f} | {'yes' if worst <= bound else 'no'} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
