"""On-policy RL on a sharded model: rollout, reward, policy-gradient step, repeat.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 examples/rl_rollout.py --backend fsdp2
    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 deepspeed --num_gpus 2 examples/rl_rollout.py --backend deepspeed

The policy is shardgen's shipped toy model (``shardgen.toy``: "count from 7 to 12 :" ->
"7 8 9 10 11 12", an answer checked exactly), sampled at a deliberately hot temperature
(``--temperature 2.5``), where it only gets about 60% of its samples right: the RL loop
sharpens it. Every step:

1. ``engine.rollout_iter(prompts, n=...)`` (NOT collective): rank r has its own, uneven, share
   of the prompts (rank 0 the most; the last rank none on odd steps), n samples each, streamed
   one prompt's group at a time as each is done (its prompt prefilled once for the n samples);
2. reward per sample, computed as each group arrives: the fraction of the expected numbers it
   got right, in order (1.0 when exact); advantage = reward - the mean reward of the same
   prompt's n samples (GRPO-style); ``shardgen.rollout.concat`` joins the groups into the
   batch ``engine.rollout()`` would have returned. A prompt whose n samples all score alike
   has zero advantages and teaches nothing: at the temperatures the toy model was trained for
   it answers every prompt right (all 1.0), hence the hot default; each step prints the share
   of such "flat" prompts;
3. inside ``with engine.paused():`` (collective), a policy-gradient step on the SAME sharded
   model: -advantage * log p(response token) under ``softmax(logits / T)``, masked by
   ``response_mask``; the next rollout uses the new weights. A rank with no rows joins the
   step with one forward and backward on a dummy token and a zero loss: inside ``paused()`` the
   step is ZeRO-3's, and every rank must run its collectives.

FSDP2: shardgen shards the model and the torch optimizer steps its DTensor shards. DeepSpeed:
``deepspeed.initialize`` (ZeRO-3, a torch optimizer) and ``ds_engine.backward`` / ``step``.
Rank 0 prints the reward (all ranks' samples) per step; it rises over a few dozen steps.
"""

from __future__ import annotations

import argparse
import random
import time

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer

import shardgen
from shardgen import toy


def token_logprobs(model, b, temperature: float) -> torch.Tensor:
    """[R, G] log p of each response token under softmax(logits / T): the training-side twin of
    ``b.logprobs``. Positions count from each row's first real token (prompts are left-padded)."""
    pos = (b.attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=pos).logits
    p = b.prompt_width
    lp = torch.log_softmax(logits[:, p - 1 : -1].float() / temperature, dim=-1)
    return lp.gather(-1, b.response_ids[..., None]).squeeze(-1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=("fsdp2", "deepspeed"), default="fsdp2")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--prompts", type=int, default=16, help="prompts per step, all ranks together")
    ap.add_argument("--samples", type=int, default=4, help="samples per prompt (n)")
    ap.add_argument("--temperature", type=float, default=2.5)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--local-rank", "--local_rank", type=int, default=0)  # the DeepSpeed launcher's
    args = ap.parse_args()

    rank, world = shardgen.init()
    torch.manual_seed(0)  # the same initial weights on every rank
    tok = AutoTokenizer.from_pretrained(toy.toy_model_path())
    model = AutoModelForCausalLM.from_pretrained(toy.toy_model_path())
    model.generation_config.do_sample = True

    rng = random.Random(0)
    tasks = [toy.format_prompt(*toy.sample_task(rng, rng.randint(3, 8))) for _ in range(args.prompts)]

    def my_share(step: int) -> list[str]:
        """Uneven shares: rank 0 takes about twice the others'; the last rank none on odd steps."""
        weights = [2] + [1] * (world - 1)
        if world > 1 and step % 2 == 1:
            weights[-1] = 0
        bounds = [round(args.prompts * sum(weights[:r]) / sum(weights)) for r in range(world + 1)]
        return tasks[bounds[rank] : bounds[rank + 1]]

    if args.backend == "deepspeed":
        import deepspeed

        config = {
            "train_micro_batch_size_per_gpu": 1,
            "zero_allow_untested_optimizer": True,
            "zero_optimization": {"stage": 3},
        }
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
        policy, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
        engine = shardgen.Engine(policy, tok, backend="deepspeed")  # collective
    else:
        engine = shardgen.Engine(model, tok, backend="fsdp2")  # collective: shards the model
        policy = model
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)  # the shards

    history: list[float] = []
    with engine:
        for step in range(args.steps):
            t0 = time.perf_counter()
            mine = my_share(step)
            # Each prompt's group of n samples as soon as it is done: scored while the rest decode.
            groups, scores = {}, {}
            for i, g in engine.rollout_iter(
                mine, n=args.samples, temperature=args.temperature, max_new_tokens=12, seed=step
            ):
                groups[i], scores[i] = g, [toy.answer_reward(mine[i], t) for t in g.texts or []]
            b = shardgen.rollout.concat([groups[i] for i in range(len(mine))])  # = engine.rollout(...)
            r = torch.tensor([x for i in range(len(mine)) for x in scores[i]])
            per_prompt = r.view(-1, args.samples)
            adv = (per_prompt - per_prompt.mean(-1, keepdim=True)).view(-1)
            # prompts whose samples all scored alike: zero advantages
            flat = (per_prompt.max(-1).values == per_prompt.min(-1).values).sum().item()
            tokens = torch.tensor([b.response_mask.sum().item()], dtype=torch.float64)
            stats = torch.tensor([r.sum().item(), float(len(r)), flat, len(per_prompt)], dtype=torch.float64)
            with engine.paused():  # collective: every rank, once per step
                dist.all_reduce(tokens)  # normalize by ALL ranks' tokens: one loss scale everywhere
                dist.all_reduce(stats)
                policy.train()
                if len(b):
                    lp = token_logprobs(policy, b, args.temperature)
                    loss = -(adv[:, None] * lp * b.response_mask).sum() * world / tokens.item()
                else:  # no rows here: ZeRO-3's forward and backward are collectives, so this rank
                    # still runs one of each, on a dummy token, with a zero loss
                    dummy = torch.full((1, 1), tok.pad_token_id or 0, dtype=torch.long)
                    loss = policy(input_ids=dummy).logits.sum() * 0.0
                if args.backend == "deepspeed":
                    policy.backward(loss)
                    policy.step()
                else:
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                policy.eval()
            history.append(stats[0].item() / stats[1].item())
            if rank == 0:
                recent = history[-5:]
                samples, flat, n_groups = (int(x) for x in stats[1:].tolist())
                print(
                    f"step {step:3d}  reward {history[-1]:.3f}  (last 5: {sum(recent) / len(recent):.3f})  "
                    f"samples {samples}  flat prompts {flat}/{n_groups}  {time.perf_counter() - t0:.1f}s",
                    flush=True,
                )
    if rank == 0:
        k = max(1, min(5, len(history) // 2))
        first, last = sum(history[:k]) / k, sum(history[-k:]) / k
        print(f"reward: first {k} steps {first:.3f} -> last {k} steps {last:.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
