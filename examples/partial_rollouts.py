"""Partial rollouts against the plain loop, side by side: GRPO on the toy task with long-tailed
answer lengths (one prompt in four asks for an answer about five times longer than the rest).

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 examples/partial_rollouts.py --backend fsdp2
    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 examples/partial_rollouts.py \
        --backend deepspeed

Two arms, each from the same initial weights, the same prompts and the same number of steps:

- ``plain``: ``engine.rollout(prompts, n=4)`` waits for every group, the longest answers included;
- ``quota``: ``engine.rollout(prompts, n=4, groups=K, max_staleness=1, stale="finish")`` returns
  once K groups are whole (K = ``--quota`` of the groups in flight, 3/4 by default; new prompts
  top them up, and held groups are served first); the others stay held, decode in the background
  while the reward is computed, park during the training step (``paused()`` does not wait for
  them) and resume under the new weights; the next step serves them first.

Each step: reward per sample (``toy.answer_reward``), advantages within each prompt's group, one
policy-gradient step inside ``paused()`` (a rank with no rows steps on a dummy token). Its loss
(``--loss decoupled``, both arms alike) is AReaL's decoupled PPO objective with TRL's truncated
importance sampling: each token weighs ``min(exp(logp - behaviour logp), --is-cap)``, the
behaviour logprob being the batch's (under the weights that drew the token), so a token the
older weights drew a step ago counts as much as the current policy would have drawn it (1 for
the plain arm's tokens, all of the current weights); ``--loss on-policy`` drops the weight. Each
arm first runs one untimed generation: neither arm's time counts the process's warm-up. Rank 0
prints, per step, the reward, the rollout's wall time and its share of the step, the staleness
of the step's tokens (``engine.version - batch.versions``) and their mean weight; then both arms'
totals over the first ``--steps`` steps, and both arms' rewards over the same number of samples
trained (the quota arm trains on fewer samples a step, so it runs until it has trained on as
many as the plain arm's ``--steps``).
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


def decoupled_loss(
    lp: torch.Tensor, behaviour: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, cap: float, clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed loss, summed weights) of AReaL's decoupled PPO objective over ``[R, G]`` tokens.

    Two policies besides the one trained: the behaviour one that drew each token (its logprob
    ``behaviour``, the batch's) and the proximal one, here the weights of now (one update per
    batch: ``lp`` detached). The weight ``min(exp(proximal - behaviour), cap)`` (truncated, as
    TRL's ``token_truncate`` importance sampling) corrects for tokens drawn by older weights; the
    PPO ratio to the proximal policy is clipped to ``1 +- clip`` (1 at a single update, where the
    gradient is the weighted policy gradient)."""
    prox = lp.detach()
    w = torch.exp(prox - behaviour).clamp(max=cap) * mask
    ratio = torch.exp(lp - prox)
    a = adv[:, None]
    surrogate = torch.minimum(ratio * a, ratio.clamp(1.0 - clip, 1.0 + clip) * a)
    return -(w * surrogate).sum(), w.sum()


def tasks(count: int, seed: int) -> list[str]:
    """Long-tailed: every fourth prompt counts 16 to 22 numbers, the others 3 to 5."""
    rng = random.Random(seed)
    return [toy.format_prompt(*toy.sample_task(rng, rng.randint(16, 22) if i % 4 == 3 else rng.randint(3, 5)))
            for i in range(count)]  # fmt: skip


def quota_groups(args: argparse.Namespace) -> int:
    """The quota arm's groups a step: ``--quota`` of the ``--prompts`` groups in flight."""
    k = int(args.prompts * args.quota)
    if not 1 <= k <= args.prompts:
        p = args.prompts
        raise ValueError(f"--quota {args.quota} of --prompts {p} is {k} groups a step: 1 to {p} work")
    return k


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
    k = quota_groups(args)
    rollout_s, step_s, useful, rewards, stale = 0.0, 0.0, 0, [], []
    trained, history, step = 0.0, [], 0
    with engine:
        engine.generate(tasks(1, seed=-1), max_new_tokens=4)  # untimed: the first call's one-off costs
        t_start = time.perf_counter()
        while step < args.steps or (target is not None and trained < target):
            t0 = time.perf_counter()
            if quota:  # a step trains on k of the groups in flight (APRIL): held ones first
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
            with engine.paused():
                policy.train()
                if len(b):
                    lp, mask = token_logprobs(policy, b, args.temperature), b.response_mask.float()
                    if args.loss == "decoupled":
                        behaviour, cap = b.behaviour_logprobs, args.is_cap
                        loss, weights = decoupled_loss(lp, behaviour, adv, mask, cap, args.clip)
                    else:
                        loss, weights = -(adv[:, None] * lp * mask).sum(), mask.sum()
                else:
                    dummy = torch.zeros((1, 1), dtype=torch.long)
                    loss, weights = policy(input_ids=dummy).logits.sum() * 0.0, torch.zeros(())
                stats = torch.tensor([r.sum().item(), float(len(r)), float(b.response_mask.sum()),
                                      float(age.sum()), float(len(age)), weights.item()],
                                     dtype=torch.float64)  # fmt: skip
                dist.all_reduce(stats)
                loss = loss * world / max(stats[2].item(), 1.0)  # a mean over every rank's tokens
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
            weight = stats[5].item() / max(stats[2].item(), 1.0)
            trained += stats[1].item()
            history.append((trained, rewards[-1]))
            if rank == 0:
                print(f"{'quota' if quota else 'plain'} step {step:2d}  reward {rewards[-1]:.3f}  "
                      f"rollout {t1 - t0:.2f}s ({(t1 - t0) / (t2 - t0):.0%} of the step)  "
                      f"staleness {stale[-1]:.2f}  weight {weight:.3f}", flush=True)  # fmt: skip
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
    ap.add_argument("--quota", type=float, default=0.75, help="the quota arm's share of the groups in flight")
    ap.add_argument("--loss", choices=("decoupled", "on-policy"), default="decoupled")
    ap.add_argument("--is-cap", type=float, default=3.0, help="importance weights truncated here (TRL's)")
    ap.add_argument("--clip", type=float, default=0.2, help="PPO clip of the ratio to the proximal policy")
    ap.add_argument("--local-rank", "--local_rank", type=int, default=0)
    args = ap.parse_args()
    quota_groups(args)  # a ValueError before anything starts
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
