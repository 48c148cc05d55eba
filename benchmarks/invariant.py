"""What ``numerics="invariant"`` costs: a rollout in the mode against the fast path, and a
trainer forward plus backward inside ``shardgen.invariant_numerics()`` against a plain one,
side by side in one run, on the shipped toy model and a medium Llama (hidden 512, 6 layers,
random weights), in bf16.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/invariant.py [--rounds 3] [--json invariant.json]

One process, ``backend="local"``: the switch changes the ops each rank computes, not the
collectives, so a rank's cost is the figure (gathers are the same bytes either way). Each round
times both arms of each measurement back to back (interleaved, so machine noise hits both); the
table gives the medians of wall time and their ratio. Rollout: 8 prompts of 12-30 tokens, n = 4,
32 new tokens, sampled at T = 1 with a seed, EOS off, no speculative decoding (which the switch
turns on where ``speculate`` is unset: benchmarks/speculative.py ``--numerics invariant``).
Trainer: one forward and backward of the rollout's batch (``[32, P + 32]``), the README's
``my_logprobs`` as the loss.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import shardgen
from shardgen.toy import toy_model_path


def medium() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=512, intermediate_size=1376, num_hidden_layers=6, num_attention_heads=8,
                      num_key_value_heads=4, vocab_size=32000, max_position_embeddings=512)  # fmt: skip
    return AutoModelForCausalLM.from_config(cfg).eval()


def toy() -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(toy_model_path()).eval()


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in torch.linspace(12, 30, 8)]


def trainer_step(model: torch.nn.Module, b) -> None:
    pos = (b.attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=pos).logits
    lp = torch.log_softmax(logits[:, b.prompt_width - 1 : -1].float(), dim=-1)
    loss = -(lp.gather(-1, b.response_ids[..., None]).squeeze(-1) * b.response_mask).sum()
    loss.backward()
    model.zero_grad(set_to_none=True)


def measure(name: str, build, rounds: int) -> dict:
    model = build().to(torch.bfloat16)
    ps = prompts(model.config.vocab_size)
    kw = dict(n=4, temperature=1.0, max_new_tokens=32, seed=0, eos_token_id=[])
    # speculate=0: what the switch costs, apart from the speculation it turns on by default
    engines = {m: shardgen.Engine(model, backend="local", numerics=m, prefix_cache_tokens=0, speculate=0)
               for m in ("fast", "invariant")}  # fmt: skip
    times: dict[str, list[float]] = {f"{what}/{m}": [] for what in ("rollout", "trainer") for m in engines}
    batch = None
    for _ in range(rounds + 1):  # the first round warms up (kernels, the tile checks) and is dropped
        for m, eng in engines.items():
            t0 = time.perf_counter()
            batch = eng.rollout(ps, **kw)
            times[f"rollout/{m}"].append(time.perf_counter() - t0)
        for m in engines:
            t0 = time.perf_counter()
            with shardgen.invariant_numerics(m == "invariant"):
                trainer_step(model, batch)
            times[f"trainer/{m}"].append(time.perf_counter() - t0)
    for eng in engines.values():
        eng.close()
    med = {k: statistics.median(v[1:]) for k, v in times.items()}
    out = {"model": name, **{k: round(v, 4) for k, v in med.items()}}
    for what in ("rollout", "trainer"):
        out[f"{what} ratio"] = round(med[f"{what}/invariant"] / med[f"{what}/fast"], 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = [measure("toy", toy, args.rounds), measure("medium", medium, args.rounds)]
    cols = [f"{what}{arm}" for what in ("rollout", "trainer") for arm in ("/fast", "/invariant", " ratio")]
    print("| model | " + " | ".join(c if "ratio" in c else c + " (s)" for c in cols) + " |")
    print("|---|" + "---|" * len(cols))
    for r in rows:
        cells = [f"{r[c]:.2f}x" if "ratio" in c else f"{r[c]:.3f}" for c in cols]
        print(f"| {r['model']} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
