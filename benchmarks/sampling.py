"""One sampling step for a batch of rows against a greedy one (argmax), and a sampled ``generate``
against a greedy one on the same model; optionally the same for another copy of the sampler.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/sampling.py
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/sampling.py --vocab 72,32000 --logits normal,flat \\
        --before /work/main/src/shardgen/generation/sampling.py --generate --json sampling.json

Step: each round times every method at every vocabulary and logits kind (small vocabularies over
several calls), interleaved, so machine noise hits all; the table gives medians of CPU time
(``time.process_time``: this machine is shared, wall time moves with the load; both are in
``--json``). Methods: ``greedy`` (argmax, what a greedy step costs), ``old`` (the row-by-row
sampler shardgen had), ``new`` (``select_tokens``), ``before`` (``select_tokens`` of the file
``--before`` names, e.g. main's), ``plain`` (batched softmax + multinomial, one generator, no
top-k/top-p: a floor). Before timing, every sampler's
tokens are checked to be in HF's kept set. Logits: ``normal`` (standard normal x 3: top-p keeps
a few hundred tokens at 32,000), ``flat`` (x 0.3, a random model's near-uniform rows: the nucleus
holds most of the vocabulary), ``zipf`` (peaked, LLM-like).

``--generate``: a random Llama (hidden 64, 2 layers, the largest ``--vocab``) on the local
backend, 64 prompts of 8 tokens, 32 new tokens, no EOS; greedy and sampled (the step's knobs,
one seed per prompt) ``generate`` interleaved over ``--gen-rounds``, wall time; with
``--before`` also sampled with that file's ``select_tokens`` swapped in.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch

from shardgen import SamplingParams
from shardgen.generation import batch as batch_module
from shardgen.generation.sampling import make_generator, select_tokens, warp_scores, warpers_for


def load_select_tokens(path: str) -> Callable:
    """``select_tokens`` of another copy of sampling.py (its own imports resolve to this tree)."""
    spec = importlib.util.spec_from_file_location("before_sampling", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.select_tokens


def old_select_tokens(logits, params, generators, input_ids):
    """The row-by-row sampler shardgen had before the batched one (HF warpers, a float64 CDF)."""
    out = torch.argmax(logits, dim=-1)
    for i, p in enumerate(params):
        if not p.do_sample:
            continue
        scores = warpers_for(p)(None, logits[i : i + 1])
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
    if kind in ("normal", "flat"):
        return torch.randn(rows, vocab, generator=g) * (3.0 if kind == "normal" else 0.3)
    if kind == "zipf":  # log-probabilities ~ -1.1 log(rank) x 4, ranks shuffled per row
        base = -4.4 * torch.log(torch.arange(1, vocab + 1, dtype=torch.float32))
        perm = torch.argsort(torch.rand(rows, vocab, generator=g), dim=-1)
        return base[perm] + 0.01 * torch.randn(rows, vocab, generator=g)
    raise ValueError(kind)


def step_part(args, params, samplers: dict[str, Callable]) -> dict:
    rows, vocabs, kinds = args.rows, [int(v) for v in args.vocab.split(",")], args.logits.split(",")
    data = {(k, v): make_logits(k, rows, v, seed=v) for k in kinds for v in vocabs}
    for (k, v), logits in data.items():  # every sampler draws inside HF's kept set
        kept = torch.isfinite(warp_scores(logits, params))
        for name, f in samplers.items():
            gens = [make_generator(s) for s in range(rows)]
            for _ in range(3):
                tokens = f(logits, params, gens, None)
                assert bool(kept.gather(1, tokens[:, None]).all()), f"{name} {k} {v}: outside HF's set"
    methods: dict[str, Callable] = {"greedy": lambda x, gens, g: torch.argmax(x, dim=-1)}
    for name, f in samplers.items():
        methods[name] = lambda x, gens, g, f=f: f(x, params, gens, None)
    methods["plain"] = lambda x, gens, g: plain_batched(x, args.temperature, g)
    cpu = {(m, key): [] for m in methods for key in data}
    wall = {(m, key): [] for m in methods for key in data}
    gens = [make_generator(s) for s in range(rows)]
    g = torch.Generator().manual_seed(0)
    order = list(methods)
    for r in range(args.rounds):
        for key, x in data.items():
            reps = max(1, 4096 // key[1])  # short steps are timed over several calls
            for m in order[r % len(order) :] + order[: r % len(order)]:  # each method's place rotates
                f = methods[m]
                w0, c0 = time.perf_counter(), time.process_time()
                for _ in range(reps):
                    f(x, gens, g)
                cpu[(m, key)].append(1e3 * (time.process_time() - c0) / reps)
                wall[(m, key)].append(1e3 * (time.perf_counter() - w0) / reps)
    med = {k: statistics.median(x) for k, x in cpu.items()}
    print(
        f"{rows} sampled rows, one step, temperature {args.temperature}, top_k {args.top_k}, "
        f"top_p {args.top_p}; median CPU ms of {args.rounds} interleaved rounds"
    )
    names = list(samplers)
    head = " | ".join(f"{n} | {n} / greedy" for n in names)
    print(f"| logits | vocabulary | greedy | {head} | plain |")
    print("|---|---|---|" + "---|---|" * len(names) + "---|")
    for k, v in data:
        gr = med[("greedy", (k, v))]
        cells = " | ".join(f"{med[(n, (k, v))]:.2f} ms | **{med[(n, (k, v))] / gr:.1f}x**" for n in names)
        print(f"| {k} | {v:,} | {gr:.2f} ms | {cells} | {med[('plain', (k, v))]:.2f} ms |")
    cells = {
        (m, k, v): {"cpu_ms": med[(m, (k, v))], "wall_ms": statistics.median(wall[(m, (k, v))])}
        for (m, (k, v)) in med
    }
    return {  # "median": the first logits kind as "method/vocabulary" (scripts/perf_tables.py reads it)
        "median": {f"{m}/{v}": c for (m, k, v), c in cells.items() if k == kinds[0]},
        "by_logits": {f"{m}/{k}/{v}": c for (m, k, v), c in cells.items()},
    }


def generate_part(args, params, samplers: dict[str, Callable]) -> dict:
    from transformers import AutoModelForCausalLM, LlamaConfig

    import shardgen

    vocab = max(int(v) for v in args.vocab.split(","))
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(cfg).eval()
    model.generation_config.eos_token_id = None  # no EOS: every row decodes 32 tokens
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (8,), generator=g).tolist() for _ in range(args.rows)]
    p = params[0]
    sampled = dict(do_sample=True, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p)
    runs = {"greedy": ({"do_sample": False}, None)}
    for name, f in samplers.items():
        runs[f"sampled ({name})"] = ({**sampled, "seed": list(range(args.rows))}, f)
    wall: dict[str, list[float]] = {name: [] for name in runs}
    original = batch_module.select_tokens
    with shardgen.Engine(model, backend="local", max_batch_size=args.rows) as eng:
        eng.generate(prompts[:4], max_new_tokens=4)  # warm up
        for _ in range(args.gen_rounds):
            for name, (kw, f) in runs.items():
                batch_module.select_tokens = f or original
                try:
                    t0 = time.perf_counter()
                    out = eng.generate(prompts, max_new_tokens=32, **kw)
                    wall[name].append(time.perf_counter() - t0)
                finally:
                    batch_module.select_tokens = original
                assert all(len(c.token_ids) == 32 for c in out)
    med = {name: statistics.median(x) for name, x in wall.items()}
    print(
        f"\ngenerate: {args.rows} prompts x 32 new tokens, random Llama "
        f"(hidden 64, 2 layers, vocabulary {vocab:,})"
    )
    print(f"median wall s of {args.gen_rounds} interleaved rounds")
    print("| run | s | / greedy |")
    print("|---|---|---|")
    for name, s in med.items():
        print(f"| {name} | {s:.3f} | **{s / med['greedy']:.2f}x** |")
    return {"generate": {name: {"wall_s": s, "ratio": s / med["greedy"]} for name, s in med.items()}}


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", default="72,32000,152064")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--logits", default="normal", help="comma-separated: normal, flat, zipf")
    ap.add_argument("--before", default=None, help="another sampling.py whose select_tokens runs beside")
    ap.add_argument("--generate", action="store_true", help="also time generate(), greedy against sampled")
    ap.add_argument("--gen-rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    p = SamplingParams(
        do_sample=True, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=0
    ).resolved()
    params = [p] * args.rows
    samplers = {"old": old_select_tokens, "new": select_tokens}
    if args.before:
        samplers = {"old": old_select_tokens, "before": load_select_tokens(args.before), "new": select_tokens}
    out = step_part(args, params, samplers)
    if args.generate:  # the row-by-row sampler would take minutes here
        out.update(generate_part(args, params, {k: f for k, f in samplers.items() if k != "old"}))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), **out}, f, indent=2)


if __name__ == "__main__":
    main(sys.argv[1:])
