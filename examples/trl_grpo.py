"""GRPO on the toy counting task with TRL's trainer, generation on shardgen.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 examples/trl_grpo.py --backend fsdp2
    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 deepspeed --num_gpus 2 examples/trl_grpo.py --backend deepspeed

The same task as examples/rl_rollout.py (the shipped toy model sampled hot, reward = the fraction
of the expected numbers it got right), through ``shardgen.integrations.trl.GRPOTrainer``: TRL's
own ``GRPOTrainer`` with one import changed. FSDP2: transformers shards the model at load
(``distributed_config=DistributedConfig(fsdp_size=world)``); DeepSpeed: ZeRO-3 through the
``deepspeed`` field of ``GRPOConfig`` (accelerate's DeepSpeed engine). Rank 0 prints TRL's logs
(reward per step) and a summary line. ``--speculate K`` drafts each row's next tokens from what the
engine has seen (the other samples of its prompt, earlier rollouts of it) and prints the drafts'
acceptance and tokens per decode forward (docs/PERFORMANCE.md 22).
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time

import torch
import torch.distributed as dist
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig

import shardgen
from shardgen import toy
from shardgen.integrations.trl import GRPOTrainer


def reward(prompts: list[str], completions: list[str], **_: object) -> list[float]:
    """TRL reward function: partial credit per completion (``shardgen.toy.answer_reward``)."""
    return [toy.answer_reward(p, c) for p, c in zip(prompts, completions, strict=True)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=("fsdp2", "deepspeed"), default="fsdp2")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompts-per-rank", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4, help="samples per prompt (num_generations)")
    ap.add_argument("--temperature", type=float, default=2.5)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument(
        "--speculate",
        type=int,
        default=0,
        metavar="K",
        help="draft up to K tokens per row from what the engine has seen (0: off)",
    )
    ap.add_argument("--local-rank", "--local_rank", type=int, default=0)  # the DeepSpeed launcher's
    args = ap.parse_args()

    rank, world = shardgen.init()
    path = toy.toy_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    rng = random.Random(0)
    prompts = [toy.format_prompt(*toy.sample_task(rng, rng.randint(3, 8))) for _ in range(64)]

    ds_config = None
    if args.backend == "deepspeed":
        model = AutoModelForCausalLM.from_pretrained(path)
        ds_config = {
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "zero_optimization": {"stage": 3},
        }
    else:
        from transformers.distributed import DistributedConfig

        model = AutoModelForCausalLM.from_pretrained(
            path, distributed_config=DistributedConfig(fsdp_size=world)
        )

    config = GRPOConfig(
        output_dir=os.path.join(tempfile.gettempdir(), "shardgen-trl-grpo"),
        per_device_train_batch_size=args.prompts_per_rank * args.samples,  # completions per rank and step
        num_generations=args.samples,
        max_completion_length=12,
        temperature=args.temperature,
        learning_rate=args.lr,
        max_steps=args.steps,
        beta=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        bf16=False,  # TRL's default; CPUs here run fp32
        gradient_checkpointing=False,
        deepspeed=ds_config,
        seed=0,
        disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),  # on CPU: accelerate's MULTI_CPU (gloo) state
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]),
        processing_class=tok,
        shardgen_config={"speculate": args.speculate},
    )
    t0 = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - t0
    if rank == 0:
        history = trainer.state.log_history
        rewards = [h["reward"] for h in history if "reward" in h]
        k = max(1, min(5, len(rewards) // 2))
        first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
        print(f"reward: first {k} steps {first:.3f} -> last {k} steps {last:.3f}")
        if args.speculate:  # TRL's logs: per step, all ranks summed
            drafted = sum(h.get("shardgen/drafted", 0.0) for h in history)
            accepted = sum(h.get("shardgen/accepted", 0.0) for h in history)
            per = [h["shardgen/tokens_per_forward"] for h in history if "shardgen/tokens_per_forward" in h]
            rate, tpf = accepted / max(drafted, 1.0), sum(per) / max(len(per), 1)
            print(
                f"speculation: drafted {drafted:.0f}  accepted {accepted:.0f} ({rate:.2f})  "
                f"tokens per forward {tpf:.2f}"
            )
        gen = sum(h.get("shardgen/generate_seconds", 0.0) for h in history)
        print(f"train: {len(rewards)} steps in {seconds:.1f} s, generation {gen:.1f} s of it")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
