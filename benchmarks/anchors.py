"""The anchors side by side: shardgen ``rollout()`` against DeepSpeed's and TRL's rollout paths.

    python benchmarks/anchors.py                       # 2 gloo ranks on CPU, DeepSpeed ZeRO-3
    python benchmarks/anchors.py --workloads toy --ns 4 --rounds 2
    python benchmarks/anchors.py --workloads medium --rounds 1

Every method runs on ONE ``deepspeed.initialize`` ZeRO-3 engine per model (with a torch SGD
optimizer, as in a trainer), ``DS_ACCELERATOR=cpu``, with the same prompts (token ids), the
same n and the same sampling (temperature 1, no top-k / top-p); methods interleaved in every
round, round 0 warms up:

- ``hybrid``: DeepSpeed's ``deepspeed.runtime.rollout.HybridEngineRollout(engine,
  tok).generate()`` (HF ``generate(eos_token_id=None)`` on the ZeRO-3 module, then padding
  after the first EOS). Its ``use_shared_prefill`` needs DeepSpeed's hybrid engine and refuses
  ZeRO-3: the script tries it once and prints what it says.
- ``trl_gather`` / ``trl_no_gather``: TRL's ``unwrap_model_for_generation(engine, accelerator,
  gather_deepspeed3_params=...)`` (``ds3_gather_for_generation`` True / False) + HF
  ``generate()`` of all the rank's rows at once, with ``synced_gpus=True`` (what HF picks under
  accelerate's ZeRO-3 setup), masked after the first EOS. ``accelerator`` is a stand-in with the
  two things TRL reads of it (``unwrap_model``, the ZeRO stage).
- ``eos_none``: HF ``generate(eos_token_id=None)`` on the ZeRO-3 module, then masking.
- ``shardgen``: ``Engine(ds_engine, tok, backend="deepspeed")`` with the engine's defaults
  (``--batch`` sets ``max_batch_size``), ``engine.rollout(prompts, n=...)``.

The HF methods run inside ``engine.paused()`` (the model as DeepSpeed set it up). Workloads,
per rank: ``toy``: 16 prompts of the shipped skewed task (``make_prompts(skew=True)``, ~8
tokens), 26 new tokens at most; ``long``: the same questions after a shared few-shot prefix of
the task's worked examples (~96-token prompts); ``medium``: a random Llama (hidden 512, 4
layers, a 16-token vocabulary, so EOS ends rows at random lengths), 64 prompts of 16 tokens,
n = 4 (256 rows per rank), 64 new tokens at most.

Before timing, greedy rows of shardgen are checked equal to ``hybrid``'s up to and including
the first EOS, and to an unsharded HF ``generate(synced_gpus=False)`` on each rank (the
single-process oracle); a mismatch raises. Useful tokens: response tokens up to and including
the first EOS, all ranks, over the wall time between two barriers. Also printed, per rollout
and summed over ranks: prompt tokens prefilled and forwards, shardgen with ``share_prefill``
on and off (a second engine after the timed rounds).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(__file__))
from common import run_as_ranks, script_args, write_json  # noqa: E402

HF_METHODS = ("hybrid", "trl_gather", "trl_no_gather", "eos_none")


def useful_lengths(comp, eos: int):
    """Per row: response tokens up to and including the first EOS (all of them if none)."""
    import torch

    is_eos = comp == eos
    first = is_eos.int().argmax(1) + 1
    return torch.where(is_eos.any(1), first, torch.full_like(first, comp.shape[1]))


def cut_rows(comp, eos: int) -> list[list[int]]:
    return [row[:k].tolist() for row, k in zip(comp, useful_lengths(comp, eos).tolist(), strict=True)]


def left_pad(rows: list[list[int]], pad: int):
    import torch

    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = 1
    return ids, mask


class _Accelerator:
    """What TRL's ``unwrap_model_for_generation`` reads of accelerate's ``Accelerator`` under
    ZeRO-3: the ZeRO stage and ``unwrap_model``."""

    state = SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=3))

    def unwrap_model(self, model):
        return getattr(model, "module", model)


def toy_workloads(tok, rank: int, names: list[str]) -> dict:
    from shardgen.toy import expected_answer, make_prompts

    questions = [p["prompt"] for p in make_prompts(16, seed=rank, skew=True)]
    out = {}
    if "toy" in names:
        out["toy"] = [tok(q)["input_ids"] for q in questions]
    if "long" in names:
        # a shared prefix of worked examples (the same on every rank), then the question
        shots, prefix = make_prompts(40, seed=1000), [1]
        for s in shots:
            ex = tok(s["prompt"] + " " + expected_answer(s["prompt"]), add_special_tokens=False)
            if len(prefix) + len(ex["input_ids"]) + 1 > 88:
                continue
            prefix += ex["input_ids"] + [tok.eos_token_id]
        out["long"] = [prefix + tok(q, add_special_tokens=False)["input_ids"] for q in questions]
    return out


def medium_model(hidden: int, vocab: int):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg).eval()
    m.generation_config.eos_token_id, m.generation_config.pad_token_id = 2, 0
    return m


def ds_initialize(model):
    import deepspeed
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": 3, "memory_efficient_linear": False},
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    engine.module.eval()
    return engine


class Bench:
    """One model: its ZeRO-3 engine, shardgen's engine on it, and every method's call."""

    def __init__(self, args, model, tok, eos: int, pad: int) -> None:
        import shardgen

        self.args, self.tok, self.eos, self.pad = args, tok, eos, pad
        self.ds = ds_initialize(model)
        self.forwards = 0  # top-level forwards of the HF methods
        self.ds.module.register_forward_pre_hook(lambda *_: self._count())
        kw = {} if args.batch is None else {"max_batch_size": args.batch}
        if args.gather is not None:
            kw["gather"] = args.gather
        self.sg_tok = tok if hasattr(tok, "decode") else None  # a real tokenizer, for the texts
        self.sg = shardgen.Engine(self.ds, self.sg_tok, backend="deepspeed", **kw)
        self.sg_batch = self.sg.config.max_batch_size

    def _count(self) -> None:
        self.forwards += 1

    def hybrid(self, prompts, n: int, new: int, temperature: float, shared: bool = False):
        from deepspeed.runtime.rollout import (
            HybridEngineRollout,
            RolloutRequest,
            SamplingConfig,
        )
        from deepspeed.runtime.rollout.hybrid_engine_rollout import HybridEngineRolloutConfig

        cfg = HybridEngineRolloutConfig(use_shared_prefill=shared)
        ids, mask = left_pad(prompts, self.pad)
        sampling = SamplingConfig(max_new_tokens=new, temperature=temperature, n_samples_per_prompt=n)
        out = HybridEngineRollout(self.ds, self.tok, cfg).generate(RolloutRequest(ids, mask), sampling)
        return out.input_ids[:, ids.shape[1] :]

    def hf(self, method: str, prompts, n: int, new: int, temperature: float):
        import torch
        from trl.models import unwrap_model_for_generation

        rows = [p for p in prompts for _ in range(n)]
        ids, mask = left_pad(rows, self.pad)
        kw = dict(attention_mask=mask, max_new_tokens=new, pad_token_id=self.pad)
        if temperature > 0:
            kw.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        else:
            kw.update(do_sample=False)
        if method == "eos_none":
            with torch.no_grad():
                out = self.ds.module.generate(ids, eos_token_id=None, synced_gpus=False, **kw)
        else:
            gather = method == "trl_gather"
            acc = _Accelerator()
            with unwrap_model_for_generation(self.ds, acc, gather_deepspeed3_params=gather) as m:
                with torch.no_grad():
                    out = m.generate(ids, eos_token_id=self.eos, synced_gpus=True, **kw)
        return out[:, ids.shape[1] :]

    def shardgen(self, prompts, n: int, new: int, temperature: float, seed: int, engine=None):
        eng = engine or self.sg
        kw = dict(temperature=temperature) if temperature > 0 else dict(do_sample=False)
        b = eng.rollout(prompts, n=n, max_new_tokens=new, top_k=0, top_p=1.0, seed=seed, **kw)
        comp = b.input_ids[:, b.input_ids.shape[1] - b.response_mask.shape[1] :]
        return comp.masked_fill(b.response_mask == 0, self.pad), b


def greedy_check(bench: Bench, name: str, prompts, n: int, new: int, oracle) -> None:
    """Greedy rows of shardgen equal HybridEngineRollout's and the unsharded oracle's, up to and
    including the first EOS; raises on the first difference."""
    import torch

    comp, _ = bench.shardgen(prompts, n, new, 0.0, seed=0)
    mine = cut_rows(comp, bench.eos)
    with bench.sg.paused():
        theirs = cut_rows(bench.hybrid(prompts, n, new, 0.0), bench.eos)
    rows = [p for p in prompts for _ in range(n)]
    ids, mask = left_pad(rows, bench.pad)
    with torch.no_grad():  # one process's oracle: no collective inside
        ref = oracle.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                              synced_gpus=False, pad_token_id=bench.pad)  # fmt: skip
    ref_rows = cut_rows(ref[:, ids.shape[1] :], bench.eos)
    for i, (a, b, c) in enumerate(zip(mine, theirs, ref_rows, strict=True)):
        if a != b or a != c:
            raise AssertionError(f"{name}: greedy row {i} differs:\nshardgen {a}\nhybrid   {b}\nHF       {c}")


def run_workload(bench: Bench, name: str, prompts, n: int, new: int, methods: list[str], rounds: int):
    """Every method, rounds interleaved (round 0 warms up): seconds and useful tokens (this rank)."""
    import torch.distributed as dist

    secs = {m: 0.0 for m in methods}
    toks = {m: 0 for m in methods}
    fwd = {m: 0 for m in methods}
    sg_keys = ("prefill_tokens", "prefill_forwards", "forwards", "shadow_forwards", "forward_s", "control_s")
    sg_stats = dict.fromkeys(sg_keys, 0)
    sg_stats["wall_s"] = 0.0
    rank = dist.get_rank()
    for rnd in range(rounds + 1):
        order = methods if rnd % 2 == 0 else methods[::-1]  # load hits every method alike
        for m in order:
            seed = 1000 * rnd + rank
            before = bench.sg.stats() if m == "shardgen" else None
            bench.forwards = 0
            dist.barrier()
            t0 = time.perf_counter()
            if m == "shardgen":
                comp, _ = bench.shardgen(prompts, n, new, 1.0, seed=seed)
            else:
                import torch

                torch.manual_seed(seed)
                with bench.sg.paused():
                    if m == "hybrid":
                        comp = bench.hybrid(prompts, n, new, 1.0)
                    else:
                        comp = bench.hf(m, prompts, n, new, 1.0)
            dist.barrier()
            dt = time.perf_counter() - t0
            if rnd == 0:
                continue
            secs[m] += dt
            toks[m] += int(useful_lengths(comp, bench.eos).sum())
            if m == "shardgen":
                after = bench.sg.stats()
                for k in sg_keys:
                    sg_stats[k] += after[k] - before[k]
                sg_stats["wall_s"] += dt
            else:
                fwd[m] += bench.forwards
    return secs, toks, fwd, sg_stats


def summed(values: list[float]) -> list[float]:
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


def report(name, n, methods, secs, toks, fwd, sg_stats, off_stats, prompts, rows_p, args, world):
    """Rank 0's table lines for one workload and n (all ranks' numbers already summed)."""
    tok_s = {m: toks[m] / secs[m] for m in methods}
    base = tok_s.get("hybrid")
    lines = [f"\n{name}, n={n}, {world} ranks x {len(prompts)} prompts, {args.rounds} rounds"]
    lines.append("| method | useful tokens/s | x hybrid | prompt tokens prefilled | forwards |")
    lines.append("|---|---|---|---|---|")
    for m in methods:
        ratio = f"{tok_s[m] / base:.2f}x" if base else "-"
        if m == "shardgen":
            pre = f"{sg_stats['prefill_tokens']:.0f} (off: {off_stats['prefill_tokens']:.0f})"
            fw = f"{sg_stats['forwards']:.0f} (off: {off_stats['forwards']:.0f})"
        else:
            pre, fw = f"{rows_p:.0f}", f"{fwd[m]:.0f}"
        lines.append(f"| {m} | {tok_s[m]:.1f} | {ratio} | {pre} | {fw} |")
    if "shardgen" in methods:  # where shardgen's wall time went, per rollout, mean rank
        st = {k: v / world for k, v in sg_stats.items()}
        rest = st["wall_s"] - st["forward_s"] - st["control_s"]
        lines.append(
            f"shardgen per rollout (mean rank): wall {st['wall_s']:.2f} s = forwards {st['forward_s']:.2f} s "
            f"({st['forwards']:.0f} + {st['shadow_forwards']:.0f} shadow) + tick "
            f"{st['control_s']:.2f} s + the rest {rest:.2f} s"
        )
    return lines, tok_s


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import shardgen
    from shardgen.toy import toy_model_path

    torch.set_num_threads(1)
    shardgen.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    results, lines = {}, []
    toy_names = [w for w in args.workloads if w in ("toy", "long")]
    plans = []  # (bench builder, workloads, ns, methods, new tokens, oracle)
    if toy_names:
        tok = AutoTokenizer.from_pretrained(toy_model_path())
        toy = lambda: AutoModelForCausalLM.from_pretrained(toy_model_path()).eval()  # noqa: E731
        work = toy_workloads(tok, rank, toy_names)
        plans.append((lambda: Bench(args, toy(), tok, tok.eos_token_id, tok.pad_token_id), work,
                      args.ns, args.methods, 26, toy))  # fmt: skip
    if "medium" in args.workloads:
        g = torch.Generator().manual_seed(rank)
        count = args.medium_prompts
        prompts = [torch.randint(3, args.vocab, (16,), generator=g).tolist() for _ in range(count)]
        mtok = SimpleNamespace(pad_token_id=0, eos_token_id=2)
        build = lambda: medium_model(args.hidden, args.vocab)  # noqa: E731
        plans.append((lambda: Bench(args, build(), mtok, 2, 0), {"medium": prompts}, [4],
                      args.medium_methods, args.medium_tokens, build))  # fmt: skip
    for make, work, ns, methods, new, oracle_model in plans:
        bench = make()
        oracle = oracle_model() if "medium" not in work else None
        if rank == 0:
            policy = bench.sg.gather_policy
            lines.append(f"\nshardgen max_batch_size: {bench.sg_batch} (per rank), gather: {policy}")
        if "hybrid" in methods and not results.get("shared_prefill_tried"):
            results["shared_prefill_tried"] = True
            # Caught inside the block: an exception that leaves paused() fails the engine on every
            # rank (faults/leaving.py), and the refusal is what this line reports.
            with bench.sg.paused():
                try:
                    bench.hybrid(next(iter(work.values()))[:2], 2, 2, 1.0, shared=True)
                    said = "ran"
                except Exception as e:  # noqa: BLE001 - reported, not hidden
                    said = f"{type(e).__name__}: {e}"
            if rank == 0:
                lines.append(f"HybridEngineRollout(use_shared_prefill=True) on ZeRO-3: {said}")
        for name, prompts in work.items():
            for n in ns:
                if name != "medium":  # random weights: the check is the toy model's
                    greedy_check(bench, name, prompts, n, new, oracle)
                out = run_workload(bench, name, prompts, n, new, methods, args.rounds)
                results[f"{name}|n={n}"] = (prompts, n, methods, out)
        bench.sg.close()
        off = shardgen.Engine(bench.ds, bench.sg_tok, backend="deepspeed", share_prefill=False,
                              max_batch_size=bench.sg_batch)  # fmt: skip
        keys = ("prefill_tokens", "prefill_forwards", "forwards")
        for name, prompts in work.items():
            for n in ns:
                before = off.stats()
                bench.shardgen(prompts, n, new, 1.0, seed=7, engine=off)
                after = off.stats()
                off_stats = dict(zip(keys, summed([after[k] - before[k] for k in keys]), strict=True))
                prompts_, n_, methods_, (secs, toks, fwd, sg_stats) = results.pop(f"{name}|n={n}")
                secs_all = {m: max(summed([secs[m]])[0] / world, 1e-9) for m in methods_}  # mean rank
                toks_all = dict(zip(methods_, summed([toks[m] for m in methods_]), strict=True))
                fwd_all = dict(zip(methods_, summed([fwd[m] / args.rounds for m in methods_]), strict=True))
                sg_keys = list(sg_stats)
                sg_all = dict(zip(sg_keys, summed([sg_stats[k] / args.rounds for k in sg_keys]), strict=True))
                rows_p = summed([len(prompts) * n * max(map(len, prompts))])[0]
                table, tok_s = report(name, n, methods_, secs_all, toks_all, fwd_all, sg_all, off_stats,
                                      prompts, rows_p, args, world)  # fmt: skip
                lines += table
                results[f"{name}|n={n}"] = {
                    "useful_tok_s": tok_s, "shardgen": sg_all, "shardgen_off": off_stats,
                    "hf_forwards": fwd_all, "hf_prefill_tokens": rows_p,
                }  # fmt: skip
        off.close()
    if rank == 0:
        print("\n".join(lines), flush=True)
        write_json(args.json, {"results": results, "config": vars(args)})
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument(
        "--workloads", nargs="+", default=["toy", "long", "medium"], choices=("toy", "long", "medium")
    )
    p.add_argument("--ns", nargs="+", type=int, default=[4, 8], help="samples per prompt (toy, long)")
    p.add_argument("--methods", nargs="+", default=[*HF_METHODS, "shardgen"], help="toy and long")
    p.add_argument("--medium-methods", nargs="+", default=["hybrid", "shardgen"])
    p.add_argument("--batch", type=int, default=None, help="shardgen max_batch_size (default: the engine's)")
    p.add_argument("--gather", default=None, help="shardgen's gather policy (default: the engine's, auto)")
    p.add_argument("--hidden", type=int, default=512, help="medium model")
    p.add_argument("--medium-prompts", type=int, default=64, help="medium: prompts per rank (n = 4)")
    p.add_argument("--medium-tokens", type=int, default=64, help="medium: most new tokens")
    p.add_argument("--vocab", type=int, default=16, help="medium model")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args(script_args())
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    run_as_ranks(__file__, args.nproc, rank_main, args)


if __name__ == "__main__":
    main()
