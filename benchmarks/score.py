"""Scoring (teacher forcing) on DeepSpeed ZeRO-3: shardgen ``score()`` vs the engine's own forward.

    python benchmarks/score.py                              # 2 gloo ranks on CPU
    python benchmarks/score.py --rows 64 --prompt-len 128 --response-len 128 --rounds 3 --json out.json

Every rank scores ``--rows`` rows of ``--prompt-len + --response-len`` tokens (random ids, the
same count on every rank: the only way DeepSpeed's own forward runs without hanging) on a
``deepspeed.initialize`` ZeRO-3 engine built from the same weights, one engine per method:

- ``ds_forward``: ``engine(input_ids, attention_mask).logits`` in micro-batches of ``--batch``
  rows, then ``log_softmax`` of the full ``[B, T, V]`` logits and a gather at the response
  tokens (what DeepSpeed's OPSD teacher does);
- ``shardgen``: ``Engine(engine, backend="deepspeed", gather=...).score(prompts, responses)``
  (batches of ``--batch`` rows, the head on the response positions only), once per ``--gather``.

Then shared prompts: ``--rows / 8`` prompts x n = 8 responses each, ``share_prefill`` on and off
(shardgen, ``--gather``'s first policy). Reports rows/s (all ranks) per method, the ratio to
``ds_forward``, and the largest logprob difference between ``ds_forward`` and shardgen.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import reset_peak, run_as_ranks, script_args, vm_hwm_mb, write_json  # noqa: E402


def rank_main(args: argparse.Namespace) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, LlamaConfig

    import shardgen

    torch.set_num_threads(1)
    shardgen.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 2,
        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
        max_position_embeddings=args.prompt_len + args.response_len + 8,
    )  # fmt: skip

    def ds_engine():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg).eval()
        zero = {"stage": 3, "memory_efficient_linear": False}
        eng, *_ = deepspeed.initialize(
            model=model, config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero}
        )
        eng.module.eval()
        return eng

    g = torch.Generator().manual_seed(100 + rank)
    prompts = torch.randint(3, args.vocab, (args.rows, args.prompt_len), generator=g)
    responses = torch.randint(3, args.vocab, (args.rows, args.response_len), generator=g)
    shared_p = prompts[: args.rows // 8].repeat_interleave(8, 0)  # n = 8 rows per prompt

    def ds_forward(eng) -> torch.Tensor:
        out = []
        p = args.prompt_len
        for i in range(0, args.rows, args.batch):
            ids = torch.cat([prompts[i : i + args.batch], responses[i : i + args.batch]], 1)
            with torch.no_grad():
                logits = eng(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
            lp = torch.log_softmax(logits[:, p - 1 : -1].float(), -1)
            out.append(lp.gather(-1, ids[:, p:, None]).squeeze(-1))
        return torch.cat(out)

    def timed(fn, *a):
        dist.barrier()
        t0 = time.perf_counter()
        res = fn(*a)
        dist.barrier()
        return time.perf_counter() - t0, res

    ds = ds_engine()
    engines = {
        f"shardgen_{gather}": shardgen.Engine(
            ds_engine(), backend="deepspeed", gather=gather, max_batch_size=args.batch
        )
        for gather in args.gather
    }
    first = args.gather[0]
    share = {
        on: shardgen.Engine(
            ds_engine(), backend="deepspeed", gather=first, max_batch_size=args.batch, share_prefill=on
        )
        for on in (True, False)
    }
    secs: dict[str, float] = {}
    diff = 0.0
    for rnd in range(args.rounds + 1):  # round 0 warms up
        dt, ref = timed(ds_forward, ds)
        res = {"ds_forward": dt}
        for name, eng in engines.items():
            dt, sb = timed(eng.score, prompts.tolist(), responses.tolist())
            res[name] = dt
            diff = max(diff, (sb.logprobs - ref).abs().max().item())
        for on, eng in share.items():
            res[f"shared_n8_{'on' if on else 'off'}"] = timed(
                eng.score, shared_p.tolist(), responses.tolist()
            )[0]
        if rnd:
            for k, v in res.items():
                secs[k] = secs.get(k, 0.0) + v
    # Memory: each method once more, from a fresh peak (VmHWM growth, MiB, the worst rank).
    eng0 = engines[f"shardgen_{first}"]
    peaks: dict[str, float] = {}
    for name, fn in (
        ("ds_forward", lambda: ds_forward(ds)),
        (f"shardgen_{first}", lambda: eng0.score(prompts.tolist(), responses.tolist())),
        (f"shardgen_{first}_logits", lambda: eng0.score(prompts.tolist(), responses.tolist(), logits=True)),
    ):
        dist.barrier()
        base = reset_peak()
        out = fn()
        grown = torch.tensor([vm_hwm_mb() - base], dtype=torch.float64)
        del out
        dist.all_reduce(grown, op=dist.ReduceOp.MAX)
        peaks[name] = grown.item()
    for eng in [*engines.values(), *share.values()]:
        eng.close()
    total_rows = args.rows * world * args.rounds
    rows_s = {k: total_rows / v for k, v in secs.items()}
    if rank == 0:
        shape = f"{world} ranks x {args.rows} rows x ({args.prompt_len} + {args.response_len}) tokens"
        print(f"\n{shape}, batch {args.batch}, {args.rounds} rounds; max |logprob diff| {diff:.2e}")
        print("| method | rows/s | vs ds_forward |\n|---|---|---|")
        for k, v in rows_s.items():
            print(f"| {k} | {v:.2f} | {v / rows_s['ds_forward']:.2f}x |")
        full = args.rows * args.response_len * args.vocab * 4 / 2**20
        print(f"\npeak memory growth of one pass, MiB (worst rank; a rank's full fp32 logits: {full:.0f})")
        print("| method | MiB |\n|---|---|")
        for k, v in peaks.items():
            print(f"| {k} | {v:.0f} |")
        write_json(
            args.json, {"rows_s": rows_s, "max_logprob_diff": diff, "peak_mib": peaks, "config": vars(args)}
        )
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--rows", type=int, default=64, help="rows per rank (a multiple of 8)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--response-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="rows per forward, both sides")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--gather", nargs="+", default=["per-layer", "auto"], help="shardgen's gather policies")
    p.add_argument("--json", default=None)
    args = p.parse_args(script_args())
    if args.rows % 8:
        p.error(f"--rows must be a multiple of 8, got {args.rows}")
    run_as_ranks(__file__, args.nproc, rank_main, args)


if __name__ == "__main__":
    main()
