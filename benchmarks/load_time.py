"""Wall time of ``Engine.from_pretrained`` at N ranks, DeepSpeed against FSDP2, side by side.

    PYTHONPATH=src .venv/bin/python benchmarks/loading.py --make /tmp/llama-320m   # once, 1.3 GB
    PYTHONPATH=src .venv/bin/python benchmarks/load_time.py --model /tmp/llama-320m --rounds 3

Each round launches two fresh ``torchrun`` jobs, one per backend, alternating: each rank imports,
runs ``shardgen.init()``, then times ``Engine.from_pretrained(model, backend=...)`` and one first
``generate`` (4 tokens). Every job gets an empty ``TORCH_EXTENSIONS_DIR``, as on a fresh machine,
so a JIT-built op (DeepSpeed's CPU shm all-reduce, which shardgen does not build) would show in
its time. Prints the median seconds per backend and the ratio deepspeed / fsdp2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

RANK = r"""
import sys, time
import torch, shardgen
rank, world = shardgen.init()
t0 = time.perf_counter()
eng = shardgen.Engine.from_pretrained(sys.argv[1], backend=sys.argv[2])
t1 = time.perf_counter()
eng.generate_ids(torch.tensor([[1, 2, 3]]), max_new_tokens=4)
t2 = time.perf_counter()
eng.close()
if rank == 0:
    print(f"RESULT {t1 - t0:.3f} {t2 - t1:.3f}", flush=True)
"""


def one(model: str, backend: str, nproc: int) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as ext, tempfile.NamedTemporaryFile("w", suffix=".py") as f:
        f.write(RANK)
        f.flush()
        env = dict(os.environ, TORCH_EXTENSIONS_DIR=ext, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
        run = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
        cmd = [*run, f.name, model, backend]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
        if out.returncode or not line:
            tail = f"{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
            raise RuntimeError(f"{backend}: exit {out.returncode}\n{tail}")
        load, gen = (float(x) for x in line[0].split()[1:])
        return load, gen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="/tmp/llama-320m")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    times: dict[str, list[tuple[float, float]]] = {"fsdp2": [], "deepspeed": []}
    for r in range(args.rounds):
        for backend in ("fsdp2", "deepspeed") if r % 2 == 0 else ("deepspeed", "fsdp2"):
            times[backend].append(one(args.model, backend, args.nproc))
            load, gen = times[backend][-1]
            print(f"round {r} {backend}: load {load:.2f} s, first generate {gen:.2f} s", flush=True)
    med = {b: statistics.median(t[0] for t in v) for b, v in times.items()}
    print(f"| backend | from_pretrained s (median of {args.rounds}) |\n|---|---|")
    for b, v in med.items():
        print(f"| {b} | {v:.2f} |")
    ratio = med["deepspeed"] / med["fsdp2"]
    print(f"deepspeed / fsdp2: {ratio:.2f}x (target <= 1.5x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"nproc": args.nproc, "times": times, "median": med, "ratio": ratio}, f, indent=1)


if __name__ == "__main__":
    main()
