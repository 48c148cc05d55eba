"""One sampling step for a batch of rows: the row-by-row sampler shardgen had, the batched one it has,
and a plain batched softmax + multinomial (no top-k / top-p, one generator) as a floor.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/sampling.py
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/sampling.py --vocab 72,32000 --rows 64 --rounds 15

Each round times every method at every vocabulary (small vocabularies over several calls),
interleaved, so machine noise hits all;
the table gives medians of CPU time (``time.process_time``: this machine is shared, wall time
moves with the load; both are in ``--json``). Before timing, the old and new samplers are checked
to give the same tokens for the same seeds. Logits: standard normal x 3 (``--logits``), so top-p
keeps a large nucleus; ``zipf`` gives a peaked, LLM-like distribution.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from shardgen import SamplingParams
from shardgen.generation.sampling import make_generator, select_tokens, warpers_for


def old_select_tokens(logits, params, generators, input_ids):
    """The row-by-row sampler as it was before the batched one (HF warpers + a float64 CDF on the CPU)."""
    out = torch.argmax(logits, dim=-1)
    for i, p in enumerate(params):
        if not p.do_sample:
            continue
        scores = warpers_for(p)(input_ids[i : i + 1], logits[i : i + 1])
        probs = torch.softmax(scores[0].double().cpu(), dim=-1)
        cdf = torch.cumsum(probs, dim=-1)
        u = torch.rand((), generator=generators[i], dtype=torch.float64) * cdf[-1]
        idx = int(torch.searchsorted(cdf, u, right=True).clamp_(max=probs.numel() - 1))
        while idx > 0 and probs[idx] == 0.0:
            idx -= 1
        out[i] = idx
    return out


def plain_batched(logits, temperature, generator):
    """The floor: softmax(logits / T) and one multinomial draw per row, one generator for the batch."""
    return torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1, generator=generator)[:, 0]


def make_logits(kind: str, rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "normal":
        return torch.randn(rows, vocab, generator=g) * 3
    if kind == "zipf":  # log-probabilities ~ -1.1 log(rank) x 4, ranks shuffled per row
        base = -4.4 * torch.log(torch.arange(1, vocab + 1, dtype=torch.float32))
        perm = torch.argsort(torch.rand(rows, vocab, generator=g), dim=-1)
        return base[perm] + 0.01 * torch.randn(rows, vocab, generator=g)
    raise ValueError(kind)


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", default="72,32000,152064")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--logits", choices=["normal", "zipf"], default="normal")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    vocabs = [int(v) for v in args.vocab.split(",")]
    p = SamplingParams(
        do_sample=True, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=0
    )
    rows = args.rows
    params = [p] * rows
    data = {v: make_logits(args.logits, rows, v, seed=v) for v in vocabs}
    ids = torch.zeros((rows, 1), dtype=torch.long)
    for v, logits in data.items():  # same tokens for the same seeds, over a few steps
        ga = [make_generator(s) for s in range(rows)]
        gb = [make_generator(s) for s in range(rows)]
        for _ in range(3):
            a = old_select_tokens(logits, params, ga, ids)
            b = select_tokens(logits, params, gb, ids)
            assert torch.equal(a, b), f"vocab {v}: old and new samplers disagree"
    methods = {
        "old": lambda x, gens, g: old_select_tokens(x, params, gens, ids),
        "new": lambda x, gens, g: select_tokens(x, params, gens, ids),
        "plain": lambda x, gens, g: plain_batched(x, args.temperature, g),
    }
    cpu = {(m, v): [] for m in methods for v in vocabs}
    wall = {(m, v): [] for m in methods for v in vocabs}
    gens = [make_generator(s) for s in range(rows)]
    g = torch.Generator().manual_seed(0)
    for _ in range(args.rounds):
        for v in vocabs:
            reps = max(1, 4096 // v)  # short steps are timed over several calls
            for m, f in methods.items():
                w0, c0 = time.perf_counter(), time.process_time()
                for _ in range(reps):
                    f(data[v], gens, g)
                cpu[(m, v)].append(1e3 * (time.process_time() - c0) / reps)
                wall[(m, v)].append(1e3 * (time.perf_counter() - w0) / reps)
    med = {k: statistics.median(x) for k, x in cpu.items()}
    medw = {k: statistics.median(x) for k, x in wall.items()}
    print(
        f"{rows} sampled rows, one step, temperature {args.temperature}, top_k {args.top_k}, "
        f"top_p {args.top_p}, logits {args.logits}; median CPU ms of {args.rounds} interleaved rounds"
    )
    print("| vocabulary | old (row by row) | new (batched) | plain softmax + multinomial | old / new |")
    print("|---|---|---|---|---|")
    for v in vocabs:
        o, n, b = med[("old", v)], med[("new", v)], med[("plain", v)]
        print(f"| {v:,} | {o:.2f} ms | {n:.2f} ms | {b:.2f} ms | **{o / n:.1f}x** |")
    if args.json:
        out = {f"{m}/{v}": {"cpu_ms": med[(m, v)], "wall_ms": medw[(m, v)]} for (m, v) in med}
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "median": out}, f, indent=2)


if __name__ == "__main__":
    main(sys.argv[1:])
