"""ZeRO-Inference through shardgen: the DeepSpeedExamples ``zero_inference/run_model.py`` benchmark,
with ranks that diverge (the DeepSpeed hang report) and still finish.

The original runs ``model.generate()`` on a ZeRO-3 model on every rank in lockstep; as soon as one
rank makes fewer ``generate()`` calls, or is busy elsewhere, the others hang in the next all-gather.
Here generation goes through ``shardgen.Engine`` (backend ``deepspeed`` by default): every rank may
run a different number of batches (``--uneven``: rank r runs ``loops + r``), and one rank may be
away doing something else (``--away-rank R --away-s S``: it sleeps S seconds before its batches);
the engine pairs the missing forwards with shadow forwards, so nobody waits forever.

Launch (2 ranks; any N works the same way)::

    # DeepSpeed launcher, GPUs
    deepspeed --num_gpus 2 examples/zero_inference.py --cpu-offload
    deepspeed --num_nodes 1 --num_gpus 2 examples/zero_inference.py --uneven --away-rank 1 --away-s 3
    # DeepSpeed launcher, CPU only: the same flag (--num_accelerators is its alias); with
    # DS_ACCELERATOR=cpu the launcher starts that many CPU processes. (--include localhost:0,1 does
    # not work on CPU: the CPU accelerator reports one slot.)
    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 deepspeed --num_gpus 2 examples/zero_inference.py \\
        --uneven --away-rank 1 --away-s 3 --loops 2 --gen-len 8
    # the seed report's setup: the user calls deepspeed.initialize (stage 3, offload_param cpu)
    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 deepspeed --num_gpus 2 examples/zero_inference.py \\
        --user-partitioned --cpu-offload --uneven --away-rank 1 --away-s 3
    # torchrun
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 examples/zero_inference.py --uneven --away-rank 1 --away-s 3
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 examples/zero_inference.py --backend fsdp2 --uneven

(add ``--master_port P`` / ``--master-port P`` when 29500 is taken.)

Model: ``--model`` is a Hugging Face causal-LM folder; the default is shardgen's shipped toy model,
for which the prompts are the toy counting task (answers checked). With another model, or with
``--dummy`` (random weights from the model's config, no checkpoint load), prompts are random token
ids of ``--prompt-len`` tokens and EOS is ignored, so every row generates exactly ``--gen-len``.

Loading (``--load``): ``sharded`` (default) reads only each rank's shard from the checkpoint,
as ``Engine.from_pretrained`` does; ``hf-zero3`` is the original script's path,
``HfDeepSpeedConfig(ds_config)`` then ``from_pretrained`` (transformers partitions under
``zero.Init``; needs ``accelerate``, in ``shardgen[deepspeed]``), and shardgen adopts the model;
``full`` loads the whole model on every rank first.

Timing, as in the original: each batch is run once with ``max_new_tokens=1`` (prefill latency,
i.e. time to the first token) and once with ``max_new_tokens=gen_len`` (total latency); decode
latency = total - prefill. Rank 0 prints its last batch's numbers (the original prints the last
loop), then every rank's batches done and the throughput of all ranks together.
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import sys
import time

import torch
import torch.distributed as dist

import shardgen
from shardgen import toy


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=toy.toy_model_path(), help="HF model folder (default: the toy model)")
    p.add_argument("--dummy", action="store_true", help="random weights from the model's config")
    p.add_argument(
        "--load",
        choices=("sharded", "hf-zero3", "full"),
        default="sharded",
        help="sharded: each rank reads only its shard (shardgen.loading, as Engine.from_pretrained); "
        "hf-zero3: the original script's HfDeepSpeedConfig(ds_config) + from_pretrained (transformers "
        "partitions under zero.Init; needs accelerate); full: every rank loads the whole model first",
    )
    p.add_argument("--loops", type=int, default=3, help="batches per rank (before --uneven)")
    p.add_argument("--batch-size", type=int, default=1, help="prompts per batch, on each rank")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (synthetic prompts)")
    p.add_argument("--gen-len", type=int, default=32, help="tokens to generate per prompt")
    p.add_argument("--cpu-offload", action="store_true", help="ZeRO-3 offload_param: {device: cpu}")
    p.add_argument("--backend", choices=("deepspeed", "fsdp2"), default="deepspeed")
    p.add_argument(
        "--user-partitioned",
        action="store_true",
        help="call deepspeed.initialize (stage 3) here and pass its engine to shardgen",
    )
    p.add_argument("--gather", choices=("per-layer", "once", "stationary", "auto"), default="per-layer")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto")
    p.add_argument("--uneven", action="store_true", help="rank r runs loops + r batches")
    p.add_argument("--away-rank", type=int, default=None, help="this rank does something else first")
    p.add_argument("--away-s", type=float, default=0.0, help="seconds the away rank spends elsewhere")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--verbose", type=int, default=1, help="2: print the outputs of rank 0's last batch")
    # The DeepSpeed launcher passes --local_rank=N (torchrun passes nothing); LOCAL_RANK is in the env.
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.loops < 1 or args.batch_size < 1 or args.gen_len < 1 or args.prompt_len < 1:
        p.error("--loops, --batch-size, --gen-len and --prompt-len must be >= 1")
    if args.backend == "fsdp2" and (args.cpu_offload or args.user_partitioned or args.load == "hf-zero3"):
        p.error("--cpu-offload, --user-partitioned and --load hf-zero3 need --backend deepspeed")
    if args.user_partitioned and args.load == "sharded":
        args.load = "full"  # deepspeed.initialize partitions a model the user loaded
    if args.away_s < 0:
        p.error("--away-s must be >= 0")
    return args


def log0(*parts: object) -> None:
    if dist.get_rank() == 0:
        print(*parts, flush=True)


def model_dtype(args: argparse.Namespace, config) -> torch.dtype:
    if args.dtype != "auto":
        return getattr(torch, args.dtype)
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if dtype == torch.float16 and not torch.cuda.is_available():
        dtype = torch.float32  # fp16 matmuls on CPU: slow or missing
    return dtype


def zero3_config(args: argparse.Namespace, config, dtype: torch.dtype) -> dict:
    """The original script's ds_config (shardgen forces prefetch, reuse and persistence to 0)."""
    hidden = int(getattr(config, "hidden_size", 1024))
    zero: dict = {
        "stage": 3,
        "stage3_prefetch_bucket_size": 2 * hidden * hidden,
        "stage3_param_persistence_threshold": hidden,
        "stage3_max_live_parameters": 2 * hidden * hidden,
    }
    if args.cpu_offload:
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    return {
        "fp16": {"enabled": dtype == torch.float16},
        "bf16": {"enabled": dtype == torch.bfloat16},
        "zero_optimization": zero,
        "train_micro_batch_size_per_gpu": args.batch_size,
        "steps_per_print": 2000,
        "wall_clock_breakdown": False,
    }


_KEEP: list = []  # the HfDeepSpeedConfig must stay alive while transformers loads (a weakref)


def load_model(args: argparse.Namespace):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(args.model)
    dtype = model_dtype(args, config)
    if args.dummy:
        torch.manual_seed(args.seed)  # the same weights on every rank (rank 0's are broadcast anyway)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    elif args.load == "sharded":
        # A skeleton (parameters on the meta device): the engine reads each rank's shard from the
        # checkpoint once its groups exist; no rank ever holds the whole model.
        from shardgen.loading.pretrained import pretrained

        model, _ = pretrained(args.model, dtype=dtype)
    elif args.load == "hf-zero3":
        # The original run_model.py: with an HfDeepSpeedConfig alive, from_pretrained builds the model
        # under zero.Init (partitioned at load, on the default group); shardgen then moves its traffic.
        from transformers.integrations import HfDeepSpeedConfig

        _KEEP.append(HfDeepSpeedConfig(zero3_config(args, config, dtype)))
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    model.eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    except (OSError, ValueError):
        tokenizer = None
    return config, dtype, model, tokenizer


def build_engine(args: argparse.Namespace, config, dtype, model, tokenizer) -> shardgen.Engine:
    common = dict(backend=args.backend, gather=args.gather, max_batch_size=args.batch_size)
    if args.backend == "fsdp2":
        return shardgen.Engine(model, tokenizer, **common)
    ds_config = zero3_config(args, config, dtype)
    if not args.user_partitioned:
        # shardgen partitions the plain model itself (or loads the skeleton, or adopts the model
        # partitioned by --load hf-zero3, whose ZeRO settings are those it was built with: no
        # ds_config), on its private process group.
        if args.load == "hf-zero3" and not args.dummy:
            return shardgen.Engine(model, tokenizer, **common)
        return shardgen.Engine(model, tokenizer, ds_config=ds_config, **common)
    import deepspeed  # DS_ACCELERATOR is set in main() before this import

    # The seed report's setup: the user partitions the model with deepspeed.initialize (on the
    # default group); shardgen moves its parameter traffic to a private group, shards in place.
    ds_engine, *_ = deepspeed.initialize(model=model, config=ds_config)
    ds_engine.module.eval()
    return shardgen.Engine(ds_engine, tokenizer, **common)


def make_batches(args: argparse.Namespace, n_batches: int, vocab: int, special: set[int], toy_prompts: bool):
    rank = dist.get_rank()
    if toy_prompts:
        prompts = toy.make_prompts(n_batches * args.batch_size, seed=args.seed * 1000 + rank)
        texts = [p["prompt"] for p in prompts]
        return [texts[i * args.batch_size : (i + 1) * args.batch_size] for i in range(n_batches)]
    rng = random.Random(f"{args.seed}-{rank}")
    allowed = [t for t in range(vocab) if t not in special]
    return [
        torch.tensor([[rng.choice(allowed) for _ in range(args.prompt_len)] for _ in range(args.batch_size)])
        for _ in range(n_batches)
    ]


def run_batch(engine: shardgen.Engine, batch, gen_len: int, toy_prompts: bool):
    """Two runs of one batch: (prefill_s, total_s, prompt_tokens, generated_tokens, outputs)."""
    if toy_prompts:
        t0 = time.perf_counter()
        engine.generate(batch, max_new_tokens=1)
        t1 = time.perf_counter()
        outs = engine.generate(batch, max_new_tokens=gen_len)
        t2 = time.perf_counter()
        prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
        return t1 - t0, t2 - t1, prompt_tokens, sum(len(o.token_ids) for o in outs), outs
    options = dict(eos_token_id=[])  # no EOS: every row generates exactly gen_len tokens
    mask = torch.ones_like(batch)
    t0 = time.perf_counter()
    engine.generate_ids(batch, attention_mask=mask, max_new_tokens=1, **options)
    t1 = time.perf_counter()
    out = engine.generate_ids(batch, attention_mask=mask, max_new_tokens=gen_len, **options)
    t2 = time.perf_counter()
    assert out.shape == (batch.shape[0], batch.shape[1] + gen_len), tuple(out.shape)
    return t1 - t0, t2 - t1, batch.numel(), batch.shape[0] * gen_len, out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.backend == "deepspeed" and not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported
    rank, world = shardgen.init()
    if args.away_rank is not None and not 0 <= args.away_rank < world:
        raise SystemExit(f"--away-rank {args.away_rank} is not a rank of this world of {world}")

    config, dtype, model, tokenizer = load_model(args)
    is_toy = os.path.realpath(args.model) == os.path.realpath(toy.toy_model_path())
    toy_prompts = is_toy and not args.dummy and tokenizer is not None
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    n_ctx = getattr(config, "max_position_embeddings", None)
    if not toy_prompts and n_ctx is not None and args.prompt_len + args.gen_len > n_ctx:
        raise SystemExit(f"--prompt-len {args.prompt_len} + --gen-len {args.gen_len} > the model's {n_ctx}")

    t_load = time.perf_counter()
    engine = build_engine(args, config, dtype, model, tokenizer)  # collective
    log0(
        f"model: {args.model}{' (dummy weights)' if args.dummy else f' (load {args.load})'}, "
        f"{n_params / 1e6:.3f} M params "
        f"({n_params * torch.finfo(dtype).bits / 8 / 2**30:.3f} GB {str(dtype).removeprefix('torch.')}); "
        f"backend {args.backend}{' (user-partitioned)' if args.user_partitioned else ''}, "
        f"offload_param {'cpu' if args.cpu_offload else 'none'}, world {world}, "
        f"engine built in {time.perf_counter() - t_load:.2f} s"
    )

    n_batches = args.loops + (rank if args.uneven else 0)
    special = {
        t for t in (config.bos_token_id, config.eos_token_id, config.pad_token_id) if isinstance(t, int)
    }
    batches = make_batches(args, n_batches, config.vocab_size, special, toy_prompts)
    log0(
        f"benchmark, prompt_len = {'toy task' if toy_prompts else args.prompt_len}, "
        f"gen_len = {args.gen_len}, batch_size = {args.batch_size} per rank, "
        f"batches per rank = {[args.loops + (r if args.uneven else 0) for r in range(world)]}"
    )

    t_start = time.time()
    if rank == args.away_rank:
        # Busy elsewhere (the seed report: a rank that never reaches generate()). Its engine
        # thread keeps answering the other ranks' forwards with shadow forwards meanwhile.
        print(f"rank {rank}: away for {args.away_s:g} s, not generating", flush=True)
        time.sleep(args.away_s)
    results = []
    for batch in batches:
        results.append(run_batch(engine, batch, args.gen_len, toy_prompts))
    t_done = time.time()
    correct = finished = 0
    if toy_prompts:
        for batch, (*_, outs) in zip(batches, results, strict=True):
            for prompt, o in zip(batch, outs, strict=True):
                if o.finish_reason == "eos":
                    finished += 1
                    correct += toy.check_answer(prompt, o.text)
    print(f"rank {rank}: {len(results)} batches done at +{t_done - t_start:.2f} s", flush=True)

    # A default-group collective while other ranks may still be generating: safe, because the
    # engine's traffic runs on its own groups and our driver thread keeps serving the peers.
    mine = dict(
        rank=rank,
        batches=len(results),
        prompt_tokens=sum(r[2] for r in results),
        gen_tokens=sum(r[3] for r in results),
        start=t_start,
        done=t_done,
        correct=correct,
        finished=finished,
        peak_rss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    )
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    # Every rank is done now (no more forwards, real or shadow): the counters are final.
    stats: list = [None] * world
    dist.all_gather_object(stats, engine.stats())

    if rank == 0:
        prefill_s, total_s, prompt_tokens, gen_tokens, out = results[-1]
        decode_s = max(total_s - prefill_s, 1e-10)
        rows = args.batch_size
        prefill_tp = prompt_tokens / prefill_s
        decode_tp = max(gen_tokens - rows, 0) / decode_s
        total_tp = gen_tokens / total_s
        if torch.cuda.is_available():
            mem = f"peak gpu mem: {torch.cuda.max_memory_allocated() / 2**30:.3f} GB"
        else:
            mem = f"peak rss: {mine['peak_rss_gb']:.3f} GB"
        print("Summary (rank 0, last batch):")
        print(f"{mem}\tprefill latency: {prefill_s:.3f} s\tprefill throughput: {prefill_tp:.3f} token/s")
        print(f"decode latency: {decode_s:.3f} s\tdecode throughput: {decode_tp:.3f} token/s")
        print(f"total latency: {total_s:.3f} s\ttotal throughput: {total_tp:.3f} token/s")
        wall = max(e["done"] for e in everyone) - min(e["start"] for e in everyone)
        all_tokens = sum(e["gen_tokens"] for e in everyone)
        print(f"all ranks: {all_tokens} tokens generated in {wall:.3f} s: {all_tokens / wall:.3f} token/s")
        print("per-rank batches done: " + ", ".join(f"rank {e['rank']}: {e['batches']}" for e in everyone))
        print(
            "per-rank shadow forwards: "
            + ", ".join(f"rank {r}: {st['shadow_forwards']}" for r, st in enumerate(stats))
        )
        if toy_prompts:
            ok = sum(e["correct"] for e in everyone)
            fin = sum(e["finished"] for e in everyone)
            print(f"toy answers: {ok}/{fin} finished answers correct (the rest hit --gen-len)")
        if args.verbose >= 2:
            print("Outputs (rank 0, last batch):")
            if toy_prompts:
                for prompt, o in zip(batches[-1], out, strict=True):
                    print(f"  {prompt!r} -> {o.text!r} ({o.finish_reason})")
            else:
                for row in out.tolist():
                    print(f"  {row}")
        sys.stdout.flush()

    engine.close()  # collective join: returns once every rank is done
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
