"""Peak resident memory per rank (VmHWM) and loading time: sharded loading vs a full copy per rank.

    PYTHONPATH=src .venv/bin/python benchmarks/loading.py --make /tmp/llama-320m   # once, 1.3 GB
    PYTHONPATH=src .venv/bin/python benchmarks/loading.py --model /tmp/llama-320m --nproc 2 4
    PYTHONPATH=src .venv/bin/python benchmarks/loading.py --model /tmp/llama-320m --nproc 2 4 --dtype bfloat16

For each backend, world size and method, a fresh set of ranks (VmHWM is a lifetime peak):
``full`` is the old path (``AutoModelForCausalLM.from_pretrained`` on every rank, then
``Engine(model)`` shards it); ``sharded`` is ``Engine.from_pretrained`` (``loading.py``), its
embeddings and head gathered in row chunks (``backends/chunked.py``); ``whole`` is the same
with ``chunk_mb=0`` (each gathered as one unit). Each
rank imports, runs a warm-up engine the same way on a tiny model of the same architecture
(lazy imports, kernels, the allocator) and closes it, resets its peak (``clear_refs``),
then records VmHWM after loading and after generating 4 tokens for one 8-token prompt;
the table shows the worst rank, in MB above that baseline, next to the issue's bound:
1.25 x (model bytes / N) + two decoder layers. "decode ms": one decode step (greedy, one
sequence), from two timed generations after the measured one: (17 tokens - 1 token) / 16.
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


def make(path: str, tiny: bool = False, like: str | None = None) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    if tiny:  # the warm-up model: the benchmark model's architecture, tiny dimensions
        cfg = AutoConfig.from_pretrained(like)
        cfg.update(
            dict(
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=4,
                head_dim=16,
                vocab_size=128,
            )
        )
        AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
        return
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
    from shardgen.loading.checkpoint import Checkpoint

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
    opts = dict(backend=args.backend, gather="per-layer", max_batch_size=1)
    imports = vm("VmHWM")

    if args.method == "whole":
        opts["chunk_mb"] = 0

    def load(path: str):
        if args.method == "full":
            model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
            return shardgen.Engine(model, **opts)
        return shardgen.Engine.from_pretrained(path, dtype=args.dtype, **opts)

    # Warm-up: the same path on a tiny model of the same architecture (lazy imports, kernels,
    # DeepSpeed's op, the allocator's arenas), closed; then the peak is reset (Linux clear_refs).
    with load(args.warm) as warm:
        warm.generate_ids(torch.arange(3, 6).unsqueeze(0), max_new_tokens=1, eos_token_id=[])
    del warm
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = vm("VmHWM")
    dist.barrier()
    t0 = time.perf_counter()
    engine = load(args.model)
    load_s = time.perf_counter() - t0
    loaded = vm("VmHWM")
    ids = torch.arange(3, 11).unsqueeze(0)
    engine.generate_ids(ids, max_new_tokens=4, eos_token_id=[])
    generated = vm("VmHWM")
    spent = {}
    for new in (1, 17):  # decode step time: the difference over 16 steps (prefill cancels out)
        dist.barrier()
        t0 = time.perf_counter()
        engine.generate_ids(ids, max_new_tokens=new, eos_token_id=[])
        spent[new] = time.perf_counter() - t0
    engine.close()
    row = dict(
        rank=rank,
        imports=imports,
        base=base,
        load=loaded - base,
        gen=generated - base,
        load_s=load_s,
        step_ms=(spent[17] - spent[1]) / 16 * 1000,
    )
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
    p.add_argument("--methods", nargs="+", default=["full", "sharded", "whole"])
    p.add_argument("--dtype", default="float32", help="load the (fp32) checkpoint in this dtype")
    p.add_argument("--json", default=None, help="also write every row (worst rank) here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--backend", help=argparse.SUPPRESS)
    p.add_argument("--method", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--warm", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.make:
        make(args.make)
        return
    if args.worker:
        worker(args)
        return
    total, layer = sizes(args.model)
    warm = os.path.join(tempfile.mkdtemp(), "warm")
    make(warm, tiny=True, like=args.model)
    if args.dtype in ("bfloat16", "float16"):
        total, layer = total // 2, layer // 2  # the fp32 checkpoint, loaded in 16 bits
    print(f"model in {args.dtype}: {total / 1e6:.0f} MB, one decoder layer {layer / 1e6:.1f} MB")
    print(
        "| backend | N | method | load s | imports MB | baseline MB | load: MB over baseline | "
        "generate: MB over baseline | bound | load within | generate within | decode ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    table = []
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
                        "--warm",
                        warm,
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
                load_peak = max(r["load"] for r in rows)
                print(
                    f"| {backend} | {n} | {method} | {max(r['load_s'] for r in rows):.1f} | "
                    f"{max(r['imports'] for r in rows):.0f} | {max(r['base'] for r in rows):.0f} | "
                    f"{load_peak:.0f} | {worst:.0f} | {bound:.0f} | "
                    f"{'yes' if load_peak <= bound else 'no'} | {'yes' if worst <= bound else 'no'} | "
                    f"{max(r['step_ms'] for r in rows):.1f} |",
                    flush=True,
                )
                table.append(
                    dict(
                        backend=backend,
                        nproc=n,
                        method=method,
                        load_s=max(r["load_s"] for r in rows),
                        load_mb=load_peak,
                        generate_mb=worst,
                        bound_mb=bound,
                        decode_ms=max(r["step_ms"] for r in rows),
                    )
                )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"config": vars(args), "model_mb": total / 2**20, "rows": table}, f, indent=2)


if __name__ == "__main__":
    main()
