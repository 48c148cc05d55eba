"""Gather policy ``once`` against its floor (``backend="local"`` replicas) and ``per-layer``.

    python benchmarks/gather_once.py                      # toy model, skewed task, 2 gloo ranks
    python benchmarks/gather_once.py --model big          # 8 layers x hidden 1024: gathers dominate
    python benchmarks/gather_once.py --methods local,once-fsdp2,once-deepspeed --rounds 3

``--model toy``: the shipped toy model on the skewed toy task (``make_prompts(skew=True)``,
every answer checked), as ``benchmarks/skew.py`` runs it. ``--model big``: a random Llama of
8 layers x hidden 1024 (vocab 2048, about 100M parameters, 400 MB in fp32), each rank its own
random prompts with skewed ``max_new_tokens``; outputs of every method checked equal to the
first method's. Methods (``--methods``, comma list): ``local`` (an unsharded replica per rank,
the physical floor of ``once``), ``once-fsdp2``, ``once-deepspeed``, ``per-layer-fsdp2``,
``per-layer-deepspeed``. One engine per method, all built before timing, rounds interleaved.
Reports useful tokens/s and each method as a multiple of ``local`` and of ``per-layer-fsdp2``,
and where each rank's timed wall time went (``engine.stats()`` over the timed rounds: real
forwards, shadow forwards, the tick's all-gather, the rest: gathers, idle ticks, the user thread).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import run_as_ranks, script_args, write_json  # noqa: E402

ALL = ("local", "once-fsdp2", "once-deepspeed", "per-layer-fsdp2", "per-layer-deepspeed")


def _engine(kind: str, build, batch: int, tok):
    import shardgen

    if kind == "local":
        return shardgen.Engine(build(), tok, backend="local", max_batch_size=batch)
    gather, backend = kind.rsplit("-", 1)
    return shardgen.Engine(build(), tok, backend=backend, gather=gather, max_batch_size=batch)


def rank_main(args: argparse.Namespace) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    import shardgen
    from shardgen.toy import check_answer, make_prompts, toy_model_path

    torch.set_num_threads(1)
    shardgen.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    methods = args.methods.split(",")
    if args.model == "toy":
        path = toy_model_path()
        tok = AutoTokenizer.from_pretrained(path)
        prompts = [p["prompt"] for p in make_prompts(args.prompts, seed=rank, skew=True)]

        def build():
            return AutoModelForCausalLM.from_pretrained(path).eval()

        def run(eng):
            texts = [c.text for c in eng.generate(prompts, max_new_tokens=args.max_new_tokens)]
            bad = [p for p, t in zip(prompts, texts, strict=True) if not check_answer(p, t)]
            assert not bad, f"rank {rank}: wrong answers for {bad[:3]}"
            return texts, sum(len(t.split()) + 1 for t in texts)  # numbers + EOS

    else:
        tok = None
        cfg = LlamaConfig(
            vocab_size=2048,
            hidden_size=1024,
            intermediate_size=2048,
            num_hidden_layers=8,
            num_attention_heads=16,
            num_key_value_heads=8,
            max_position_embeddings=256,
        )

        def build():
            torch.manual_seed(0)
            m = AutoModelForCausalLM.from_config(cfg).eval()
            m.generation_config.eos_token_id = None
            m.generation_config.pad_token_id = 0
            return m

        g = torch.Generator().manual_seed(100 + rank)
        ids = torch.randint(3, 2048, (args.prompts, 8), generator=g)
        lens = torch.randint(2, args.max_new_tokens + 1, (args.prompts,), generator=g).tolist()

        def run(eng):
            futs = [eng.submit(ids[i], max_new_tokens=lens[i], eos_token_id=[]) for i in range(len(lens))]
            outs = [f.result().token_ids for f in futs]
            return [list(o) for o in outs], sum(lens)

    engines = {m: _engine(m, build, args.batch, tok) for m in methods}
    first = None
    times = dict.fromkeys(methods, 0.0)
    spent = {m: dict.fromkeys(SPENT, 0.0) for m in methods}  # this rank's timed seconds, by kind
    useful = 0
    for rnd in range(args.rounds + 1):  # round 0 warms up and checks outputs
        for name in methods:
            dist.barrier()
            before = engines[name].stats()
            t0 = time.perf_counter()
            out, n = run(engines[name])
            dist.barrier()
            wall = time.perf_counter() - t0
            after = engines[name].stats()
            if rnd:
                _add_spent(spent[name], before, after, wall)
            if rnd == 0:
                first = first if first is not None else out
                assert out == first, f"rank {rank}: {name} differs from {methods[0]}"
                useful = n
            else:
                times[name] += time.perf_counter() - t0
    for e in engines.values():
        e.close()
    total = torch.tensor([useful], dtype=torch.float64)
    dist.all_reduce(total)
    per_rank: list = [None] * world
    dist.all_gather_object(per_rank, spent)  # every rank, once, after the timed rounds
    if rank == 0:
        tok_s = {k: args.rounds * total.item() / v for k, v in times.items()}
        res = {"useful_tok_s": tok_s, "world": world, "config": vars(args)}
        if "local" in tok_s:
            res["x_local"] = {k: v / tok_s["local"] for k, v in tok_s.items()}
        if "per-layer-fsdp2" in tok_s:
            res["x_per_layer_fsdp2"] = {k: v / tok_s["per-layer-fsdp2"] for k, v in tok_s.items()}
        print(f"\nmodel {args.model}, {world} ranks, batch {args.batch}, {args.prompts} prompts per rank")
        for k, v in tok_s.items():
            extra = "".join(
                f"  {v / tok_s[ref]:5.2f}x {ref}" for ref in ("local", "per-layer-fsdp2") if ref in tok_s
            )
            print(f"{k:22s} {v:9.1f} useful tok/s{extra}", flush=True)
        res["spent_s"] = per_rank
        print("\nseconds per rank over the timed rounds: " + ", ".join(SPENT))
        for name in methods:
            cells = "   ".join(
                f"r{r}: " + " ".join(f"{per_rank[r][name][k]:6.2f}" for k in SPENT) for r in range(world)
            )
            print(f"{name:22s} {cells}")
        write_json(args.json, res)
    dist.destroy_process_group()


SPENT = ("wall", "real", "shadow+plan", "tick", "other", "ticks", "forwards", "shadows")


def _add_spent(into: dict, before: dict, after: dict, wall: float) -> None:
    """This rank's timed seconds by kind, from two ``engine.stats()`` snapshots around a run."""
    d = {k: after[k] - before[k] for k in ("forward_s", "busy_s", "control_s", "ticks", "forwards")}
    d["shadow_forwards"] = after["shadow_forwards"] - before["shadow_forwards"]
    into["wall"] += wall
    into["real"] += d["busy_s"]
    into["shadow+plan"] += d["forward_s"] - d["busy_s"]  # shadow forwards, planning a burst
    into["tick"] += d["control_s"]
    into["other"] += wall - d["forward_s"] - d["control_s"]
    into["ticks"] += d["ticks"]
    into["forwards"] += d["forwards"]
    into["shadows"] += d["shadow_forwards"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2, help="gloo ranks to spawn")
    p.add_argument("--model", choices=["toy", "big"], default="toy")
    p.add_argument("--methods", default="local,once-fsdp2,once-deepspeed,per-layer-fsdp2")
    p.add_argument("--prompts", type=int, default=64, help="prompts per rank")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=26)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args(script_args())
    bad = set(args.methods.split(",")) - set(ALL)
    if bad:
        p.error(f"unknown methods {sorted(bad)}; choose from {', '.join(ALL)}")
    run_as_ranks(__file__, args.world, rank_main, args)


if __name__ == "__main__":
    main()
