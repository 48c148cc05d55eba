"""Partial rollouts against the plain loop, side by side: GRPO on the toy task with long-tailed
answer lengths (one prompt in four asks for an answer about five times longer than the rest).

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 examples/partial_rollouts.py --backend fsdp2
    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 examples/partial_rollouts.py \
        --backend deepspeed

Two arms, each from the same initial weights, the same prompts and the same number of steps:

- ``plain``: ``engine.rollout(prompts, n=4)`` waits for every group, the longest answers included;
- ``quota``: ``engine.rollout(prompts, n=4, groups=K, max_staleness=1, stale="finish")`` returns
  once K groups are whole (K = 3/4 of the groups in flight; new prompts top them up, and held
  groups are served first); the others stay held, decode in the background
  while the reward is computed, park during the training step (``paused()`` does not wait for
  them) and resume under the new weights; the next step serves them first.

Each step: reward per sample (``toy.answer_reward``), advantages within each prompt's group, one
policy-gradient step inside ``paused()`` (a rank with no rows steps on a dummy token). Rank 0
prints, per step, the reward, the rollout's wall time and its share of the step, and the
staleness of the step's tokens (``engine.version - batch.versions``); then both arms' totals over
the first ``--steps`` steps, and both arms' rewards over the same number of samples trained (the
quota arm trains on fewer samples a step, so it runs until it has trained on as many as the
plain arm's ``--steps``).
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
from shardgen.generation.partial import held_groups


def token_logprobs(model, b, temperature: float) -> torch.Tensor:
    """[R, G] log p of each response token under softmax(logits / T) (as ``rl_rollout.py``)."""
    pos = (b.attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=pos).logits
    p = b.prompt_width
    lp = torch.log_softmax(logits[:, p - 1 : -1].float() / temperature, dim=-1)
    return lp.gather(-1, b.response_ids[..., None]).squeeze(-1)


def tasks(count: int, seed: int) -> list[str]:
    """Long-tailed: every fourth prompt counts 16 to 22 numbers, the others 3 to 5."""
    rng = random.Random(seed)
    return [toy.format_prompt(*toy.sample_task(rng, rng.randint(16, 22) if i % 4 == 3 else rng.randint(3, 5)))
            for i in range(count)]  # fmt: skip


def run_arm(
    args: argparse.Namespace, quota: bool, rank: int, world: int, target: float | None = None
) -> dict:
    """One arm; with ``target``, it goes on past ``--steps`` until it has trained on that many
    samples (all ranks), so that both arms' rewards compare over the same samples."""
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(toy.toy_model_path())
    model = AutoModelForCausalLM.from_pretrained(toy.toy_model_path())
    if args.backend == "deepspeed":
        import deepspeed

        config = {"train_micro_batch_size_per_gpu": 1, "zero_allow_untested_optimizer": True,
                  "zero_optimization": {"stage": 3}}  # fmt: skip
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
        policy, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
        engine = shardgen.Engine(policy, tok, backend="deepspeed")
    else:
        engine = shardgen.Engine(model, tok, backend="fsdp2")
        policy = model
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    kw = dict(n=args.samples, temperature=args.temperature, max_new_tokens=64)
    rollout_s, step_s, useful, rewards, stale = 0.0, 0.0, 0, [], []
    trained, history, step = 0.0, [], 0
    t_start = time.perf_counter()
    with engine:
        while step < args.steps or (target is not None and trained < target):
            t0 = time.perf_counter()
            if quota:  # a step trains on 3/4 of the groups in flight (APRIL): held ones first
                k = args.prompts * 3 // 4
                mine = tasks(args.prompts - held_groups(engine), seed=1000 * step + rank)
                b = engine.rollout(mine, groups=k, max_staleness=1, stale="finish", seed=step, **kw)
            else:
                mine = tasks(args.prompts, seed=1000 * step + rank)
                b = engine.rollout(mine, seed=step, **kw)
            t1 = time.perf_counter()
            prompts = [p for p in b.prompts for _ in range(args.samples)]
            r = torch.tensor([toy.answer_reward(p, t) for p, t in zip(prompts, b.texts or [], strict=True)])
            per = r.view(-1, args.samples) if len(r) else r.view(0, args.samples)
            adv = (per - per.mean(-1, keepdim=True)).view(-1)
            age = (engine.version - b.versions)[b.response_mask.bool()].float()
            stats = torch.tensor([r.sum().item(), float(len(r)), float(b.response_mask.sum()),
                                  float(age.sum()), float(len(age))], dtype=torch.float64)  # fmt: skip
            with engine.paused():
                dist.all_reduce(stats)
                policy.train()
                if len(b):
                    lp = token_logprobs(policy, b, args.temperature)
                    loss = -(adv[:, None] * lp * b.response_mask).sum() * world / max(stats[2].item(), 1.0)
                else:
                    dummy = torch.zeros((1, 1), dtype=torch.long)
                    loss = policy(input_ids=dummy).logits.sum() * 0.0
                if args.backend == "deepspeed":
                    policy.backward(loss)
                    policy.step()
                else:
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                policy.eval()
            t2 = time.perf_counter()
            if step < args.steps:  # the time figures: the same steps in both arms
                rollout_s += t1 - t0
                step_s += t2 - t0
                useful += int(stats[2].item())
                spent = time.perf_counter() - t_start
            rewards.append(stats[0].item() / max(stats[1].item(), 1.0))
            stale.append(stats[3].item() / max(stats[4].item(), 1.0))
            trained += stats[1].item()
            history.append((trained, rewards[-1]))
            if rank == 0:
                print(f"{'quota' if quota else 'plain'} step {step:2d}  reward {rewards[-1]:.3f}  "
                      f"rollout {t1 - t0:.2f}s ({(t1 - t0) / (t2 - t0):.0%} of the step)  "
                      f"staleness {stale[-1]:.2f}", flush=True)  # fmt: skip
            step += 1
    last = rewards[-3:]
    return {"rollout_s": rollout_s / args.steps, "share": rollout_s / step_s, "tokens_per_s": useful / spent,
            "reward": sum(last) / len(last), "staleness": sum(stale) / len(stale),
            "history": history}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=("fsdp2", "deepspeed"), default="fsdp2")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=8, help="new prompts per step, per rank")
    ap.add_argument("--samples", type=int, default=4, help="samples per prompt (n)")
    ap.add_argument("--temperature", type=float, default=2.0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--local-rank", "--local_rank", type=int, default=0)
    args = ap.parse_args()
    rank, world = shardgen.init()
    out = {"plain": run_arm(args, False, rank, world)}
    # The quota arm trains on fewer samples a step: it runs until it has trained on as many.
    out["quota"] = run_arm(args, True, rank, world, target=out["plain"]["history"][-1][0])
    if rank == 0:
        for arm, o in out.items():
            print(f"{arm}: rollout {o['rollout_s']:.2f}s a step ({o['share']:.0%} of the step), "
                  f"{o['tokens_per_s']:.0f} useful tokens/s, reward (last 3 steps) {o['reward']:.3f}, "
                  f"staleness {o['staleness']:.2f}", flush=True)  # fmt: skip
        quota = out["quota"]["history"]
        for seen, reward in out["plain"]["history"]:  # the quota arm's reward once it trained on as many
            q = next((r for n, r in quota if n >= seen), quota[-1][1])
            print(f"at {seen:.0f} samples trained: reward plain {reward:.3f}  quota {q:.3f}", flush=True)
        ratio = out["quota"]["rollout_s"] / out["plain"]["rollout_s"]
        print(f"rollout wall time per step, quota / plain: {ratio:.2f}x", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
