"""Weight-stationary decode (gather="stationary") against per-layer, once and local replicas.

    python benchmarks/stationary.py --part throughput --world 2      # gather-bound Llama, tokens/s
    python benchmarks/stationary.py --part memory --world 2          # VmHWM growth while generating
    python benchmarks/stationary.py --part crossover --world 2       # forward time vs tokens per forward
    python benchmarks/stationary.py --part toy --world 2             # latency-bound toy: auto vs per-layer
    python benchmarks/stationary.py --part latency --world 2         # where a stationary forward's time goes

``big`` model: a random Llama, hidden 1024, intermediate 2816, 8 layers, 16 heads, vocabulary
2048, fp32 (113M parameters, 453 MB); ``--arch gemma`` the same sizes as a Gemma (its scaled
embedding, an ``nn.Embedding`` subclass, tied to the head), ``--vocab`` its vocabulary.
``throughput``: each rank decodes one batch of 8 random 8-token prompts, 24 new tokens each,
no EOS; one engine per method, all built before timing, rounds interleaved (round 0 warms up
and checks every method's tokens equal the first's); while one is timed the others wait in
``paused()``.
``memory``: one method per run; after a warm-up generation the peak is reset (``clear_refs``)
and the growth of VmHWM over the loaded state while generating is reported, worst rank, with
the bound of the issue (a quarter of a decoder layer + KV cache + activations). ``crossover``:
one forward of ``T`` tokens per rank (``[1, T]`` prompts, every rank), per-layer vs stationary
on the same backend, rounds interleaved, median ms, next to the cost model's choice
(``backends/stationary/cost.py``). ``toy``: the shipped toy model on its skewed task
(benchmarks/gather_once.py's ``toy`` workload), ``auto`` against ``per-layer`` (today's default),
``stationary``, and ``auto`` with a memory budget the replica does not fit (per forward choice).
``latency``: a cost model of the stationary forward against ``local``, all measured in one run
(``--backend``, ``--tokens`` per rank, decode-sized by default): the forward of the unsharded
model on one rank's tokens (``local``: the same arithmetic a stationary rank does), the
stationary forward, its collectives per forward (counted as they are issued), and the bare
latency of one ``all_to_all_single`` of a decode exchange's size on the same gloo group, and
the time a forward spends inside its collectives (their waits included) and outside them. The
model: stationary = local + collectives x latency; it prints the prediction beside the
measurement, and the latency a collective would need for stationary to reach 0.8x ``local``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import reset_peak, run_as_ranks, script_args, vm_hwm_mb, write_json  # noqa: E402

THROUGHPUT = "stationary-fsdp2,stationary-deepspeed,per-layer-fsdp2,per-layer-deepspeed,once-fsdp2,local"


def _big(args):
    import torch
    from transformers import AutoModelForCausalLM, GemmaConfig, LlamaConfig

    # Gemma: its scaled embedding (an nn.Embedding subclass) tied to the head
    config_class = {"llama": LlamaConfig, "gemma": GemmaConfig}[args.arch]
    cfg = config_class(
        vocab_size=args.vocab,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=args.layers,
        num_attention_heads=16,
        num_key_value_heads=16,
        head_dim=64,
        max_position_embeddings=1024,
    )
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg).eval()
    m.generation_config.eos_token_id = None
    m.generation_config.pad_token_id = 0
    return m


def _engine(kind: str, model, batch: int, tok=None):
    import shardgen

    if kind == "local":
        return shardgen.Engine(model, tok, backend="local", max_batch_size=batch)
    gather, backend = kind.rsplit("-", 1)
    return shardgen.Engine(model, tok, backend=backend, gather=gather, max_batch_size=batch)


def rank_main(args: argparse.Namespace) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch
    import torch.distributed as dist

    import shardgen

    torch.set_num_threads(1)
    if args.pin:
        # Before any process group exists: gloo's worker threads inherit the main thread's CPU.
        os.sched_setaffinity(0, {int(os.environ["LOCAL_RANK"]) % os.cpu_count()})
    shardgen.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    res = {"world": world, "config": vars(args), "part": args.part}
    if args.part in ("throughput", "memory"):
        g = torch.Generator().manual_seed(100 + rank)
        ids = torch.randint(3, 2048, (args.batch, 8), generator=g)
        n_new = args.max_new_tokens

        def run(eng):
            futs = [eng.submit(ids[i], max_new_tokens=n_new, eos_token_id=[]) for i in range(len(ids))]
            return [list(f.result().token_ids) for f in futs]

        methods = args.methods.split(",")
        if args.part == "memory":
            assert len(methods) == 1, "--part memory: one method per run"
        engines = {m: _engine(m, _big(args), args.batch) for m in methods}
        first, times = None, dict.fromkeys(methods, 0.0)
        grow = {}
        for rnd in range(args.rounds + 1):
            for name in methods:
                # The other engines wait in paused() (no traffic at all): an open engine's idle
                # ticks would otherwise share the cores and the GIL with the one timed.
                with contextlib.ExitStack() as others:
                    for other in methods:
                        if other != name:
                            others.enter_context(engines[other].paused())
                    dist.barrier()
                    base = reset_peak() if (args.part == "memory" and rnd == 1) else None
                    t0 = time.perf_counter()
                    out = run(engines[name])
                    dist.barrier()
                if base is not None:
                    grow[name] = vm_hwm_mb() - base
                if rnd == 0:
                    first = first if first is not None else out
                    assert out == first, f"rank {rank}: {name} differs from {methods[0]}"
                else:
                    times[name] += time.perf_counter() - t0
        for e in engines.values():
            e.close()
        total = args.rounds * world * args.batch * n_new
        worst = {k: torch.tensor([v], dtype=torch.float64) for k, v in times.items()}
        for t in worst.values():
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        res["tok_s"] = {k: total / v.item() for k, v in worst.items()}
        if grow:
            g_t = torch.tensor([grow[methods[0]]], dtype=torch.float64)
            dist.all_reduce(g_t, op=dist.ReduceOp.MAX)
            cfg = engines[methods[0]].model.config
            layer = (4 * 1024 * 1024 + 3 * 1024 * cfg.intermediate_size) * 4  # bytes of one decoder layer
            kv = 2 * cfg.num_hidden_layers * args.batch * (8 + n_new) * 1024 * 4
            act = args.batch * 8 * world * (3 * 1024 + 2 * cfg.intermediate_size) * 4  # the widest prefill
            res["memory"] = {
                "method": methods[0],
                "growth_mib": g_t.item(),
                "bound_mib": (layer / 4 + kv + act) / 2**20,
                "quarter_layer_mib": layer / 4 / 2**20,
                "kv_mib": kv / 2**20,
                "activations_mib": act / 2**20,
            }
    elif args.part == "crossover":
        res["crossover"] = _crossover(args, rank, world)
    elif args.part == "latency":
        res["latency"] = _latency(args, rank, world)
    else:
        res["tok_s"] = _toy(args, rank, world)
    if rank == 0:
        print(f"\n{args.part}, {world} ranks")
        for k, v in res.get("tok_s", {}).items():
            ref = res["tok_s"].get("per-layer-fsdp2") or res["tok_s"].get("per-layer")
            loc = res["tok_s"].get("local")
            extra = (f"  {v / ref:5.2f}x per-layer" if ref else "") + (
                f"  {v / loc:5.2f}x local" if loc else ""
            )
            print(f"{k:22s} {v:9.1f} tok/s{extra}", flush=True)
        if "memory" in res:
            print(res["memory"])
        for row in res.get("crossover", []):
            print(row)
        for row in res.get("latency", []):
            print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
        write_json(args.json, res)
    dist.destroy_process_group()


def _crossover(args, rank: int, world: int) -> list[dict]:
    import torch
    import torch.distributed as dist

    from shardgen.backends import make_backend
    from shardgen.backends.stationary import link_for, stationary_cost
    from shardgen.generation.plan import IDLE_PLAN, Access

    group = dist.new_group(backend="gloo")
    b = make_backend(args.backend, _big(args), param_group=group, device=torch.device("cpu"))
    assert b.enable_stationary() is None
    rows = []
    for tokens in [int(t) for t in args.tokens.split(",")]:
        shapes = [(tokens, 1)] * world  # (tokens, head rows) per rank, as the tick agrees them
        ids = torch.randint(3, 2048, (1, tokens), generator=torch.Generator().manual_seed(rank))
        ms = {"per-layer": [], "stationary": []}
        for rnd in range(args.rounds + 1):
            for mode in ms:
                dist.barrier(group)
                t0 = time.perf_counter()
                with torch.no_grad():  # as in the driver thread
                    plan = IDLE_PLAN.agreed(Access(mode), shapes)  # as the tick agrees it
                    b.forward(plan, {"input_ids": ids, "use_cache": False, "logits_to_keep": 1})
                dist.barrier(group)
                if rnd:
                    ms[mode].append((time.perf_counter() - t0) * 1e3)
        link = link_for(b.device)
        model_s = {
            "per-layer": b.per_layer_cost().seconds(link) * 1e3,
            "stationary": stationary_cost(b.stationary.layout, shapes, rank).seconds(link) * 1e3,
        }
        row = {"tokens_per_rank": tokens, **{f"{k}_ms": statistics.median(v) for k, v in ms.items()}}
        row.update({f"model_{k}_ms": v for k, v in model_s.items()})
        row["measured"] = min(ms, key=lambda k: statistics.median(ms[k]))
        row["auto"] = min(model_s, key=model_s.get)
        rows.append(row)
    b.close()
    return rows


def _latency(args, rank: int, world: int) -> list[dict]:
    """Per ``--tokens`` value: local and stationary forward ms, collectives per forward, the bare
    latency of one exchange, and the model's prediction (rank 0's view; every rank runs it)."""
    import torch
    import torch.distributed as dist

    from shardgen.backends import make_backend
    from shardgen.generation.plan import IDLE_PLAN, Access

    group = dist.new_group(backend="gloo")
    b = make_backend(args.backend, _big(args), param_group=group, device=torch.device("cpu"))
    assert b.enable_stationary() is None
    local = _big(args)  # the same weights (seed 0), unsharded, on every rank
    issued = {"n": 0, "s": 0.0}  # collectives issued, seconds inside them (their waits included)

    class Timed:
        def __init__(self, work):
            self.work = work

        def wait(self, *a, **k):
            t0 = time.perf_counter()
            try:
                return self.work.wait(*a, **k)
            finally:
                issued["s"] += time.perf_counter() - t0

    for name in ("all_to_all_single", "all_gather_into_tensor", "all_reduce", "broadcast", "all_gather"):
        real = getattr(dist, name)

        def counted(*a, _real=real, **k):
            issued["n"] += 1
            t0 = time.perf_counter()
            try:
                work = _real(*a, **k)
            finally:
                issued["s"] += time.perf_counter() - t0
            return Timed(work) if work is not None else None

        setattr(dist, name, counted)
    hidden = local.config.hidden_size
    rows = []
    for tokens in [int(t) for t in args.tokens.split(",")]:
        shapes = [(tokens, 1)] * world
        ids = torch.randint(3, 2048, (1, tokens), generator=torch.Generator().manual_seed(rank))
        ms = {"local": [], "stationary": [], "inside": []}
        calls = 0
        for _ in range(args.rounds * 5 + 1):
            dist.barrier(group)
            t0 = time.perf_counter()
            with torch.no_grad():
                local(input_ids=ids, use_cache=False, logits_to_keep=1)
            ms["local"].append((time.perf_counter() - t0) * 1e3)
            dist.barrier(group)
            before, inside = issued["n"], issued["s"]
            t0 = time.perf_counter()
            with torch.no_grad():
                plan = IDLE_PLAN.agreed(Access.STATIONARY, shapes)
                b.forward(plan, {"input_ids": ids, "use_cache": False, "logits_to_keep": 1})
            ms["stationary"].append((time.perf_counter() - t0) * 1e3)
            ms["inside"].append((issued["s"] - inside) * 1e3)
            calls = issued["n"] - before
        x = torch.randn(tokens * world, hidden)
        out = torch.empty_like(x)
        lat = []
        for _ in range(200):  # a decode exchange: every rank's tokens x hidden, split by rank
            t0 = time.perf_counter()
            dist.all_to_all_single(out, x, [tokens] * world, [tokens] * world, group=group)
            lat.append((time.perf_counter() - t0) * 1e3)
        issued["n"] -= 200
        t_local = statistics.median(ms["local"][1:])
        t_st = statistics.median(ms["stationary"][1:])
        t_in = statistics.median(ms["inside"][1:])
        lam = statistics.median(lat)
        rows.append({
            "tokens_per_rank": tokens,
            "pinned": bool(args.pin),
            "local_ms": t_local,
            "stationary_ms": t_st,
            "collectives": calls,
            "inside_collectives_ms": t_in,
            "outside_collectives_ms": t_st - t_in,
            "exchange_latency_ms": lam,
            "model_stationary_ms": t_local + calls * lam,
            "measured_x_local": t_local / t_st,
            "model_x_local": t_local / (t_local + calls * lam),
            "latency_for_0.8x_ms": 0.25 * t_local / max(calls, 1),
        })  # fmt: skip
    b.close()
    return rows


def _toy(args, rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import shardgen
    from shardgen.toy import check_answer, make_prompts, toy_model_path

    path = toy_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [p["prompt"] for p in make_prompts(args.prompts, seed=rank, skew=True)]
    kinds = {  # name: (gather, memory budget): "auto-nofit" as if the replica did not fit
        "auto": ("auto", None),
        "auto-nofit": ("auto", 1e-9),
        "per-layer": ("per-layer", None),
        "stationary": ("stationary", None),
    }
    engines = {
        k: shardgen.Engine(
            AutoModelForCausalLM.from_pretrained(path).eval(),
            tok,
            backend="fsdp2",
            gather=g,
            memory_budget_gb=budget,
            max_batch_size=8,
        )
        for k, (g, budget) in kinds.items()
    }
    times, useful = dict.fromkeys(kinds, 0.0), 0
    for rnd in range(args.rounds + 1):
        for k, eng in engines.items():
            dist.barrier()
            t0 = time.perf_counter()
            texts = [c.text for c in eng.generate(prompts, max_new_tokens=26)]
            dist.barrier()
            assert all(check_answer(p, t) for p, t in zip(prompts, texts, strict=True)), k
            if rnd:
                times[k] += time.perf_counter() - t0
            else:
                useful = sum(len(t.split()) + 1 for t in texts)
    policies = {k: (e.gather_policy, dict(e._driver.mode.chosen)) for k, e in engines.items()}
    for e in engines.values():
        e.close()
    total = torch.tensor([useful], dtype=torch.float64)
    dist.all_reduce(total)
    if rank == 0:
        print("policies:", policies)
    return {k: args.rounds * total.item() / v for k, v in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2, help="gloo ranks to spawn")
    p.add_argument(
        "--part", choices=["throughput", "memory", "crossover", "toy", "latency"], default="throughput"
    )
    p.add_argument(
        "--methods", default=THROUGHPUT, help="throughput/memory: comma list of GATHER-BACKEND, local"
    )
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--arch", choices=["llama", "gemma"], default="llama", help="throughput/memory/crossover")
    p.add_argument("--vocab", type=int, default=2048, help="the big model's vocabulary (at least 2048)")
    p.add_argument("--batch", type=int, default=8, help="prompts per rank (one batch)")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--backend", default="fsdp2", help="crossover, latency: the backend")
    p.add_argument(
        "--tokens", default="1,8,32,64,128,256,512", help="crossover, latency: tokens per rank per forward"
    )
    p.add_argument("--prompts", type=int, default=32, help="toy: prompts per rank")
    p.add_argument(
        "--pin", action="store_true",
        help="pin rank r (and its threads) to CPU r mod cores, every method alike: on a 2-core VM the "
        "scheduler's placement of the ranks' compute and gloo threads otherwise swings stationary's "
        "tokens/s by 2x between runs",
    )  # fmt: skip
    p.add_argument("--json", default=None)
    args = p.parse_args(script_args())
    run_as_ranks(__file__, args.world, rank_main, args)


if __name__ == "__main__":
    main()
