"""On-policy self-distillation (OPSD) on one DeepSpeed ZeRO-3 engine: the second report's loop.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 examples/opsd.py
    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 deepspeed --num_gpus 2 examples/opsd.py
    ... examples/opsd.py --teacher PATH      # a separate (frozen) teacher model, sharded the same way
    ... examples/opsd.py --top-k 8           # the teacher's top-k log-probs instead of full logits

The student is shardgen's shipped toy model (``shardgen.toy``: "count from 7 to 12 :" ->
"7 8 9 10 11 12"), one ``deepspeed.initialize`` ZeRO-3 engine. The teacher is the same sharded
weights with privileged context: the expected answer written before the question (or, with
``--teacher``, another model). Every step, on every rank:

1. a rollout: ``ShardgenRollout.generate`` (DeepSpeed's ``RolloutEngine`` interface) samples the
   student's answers to this rank's prompts. Ranks hold uneven shares, and rank ``world - 1``
   has none at all on odd steps: it still calls ``generate`` and gets zero rows back;
2. the teacher scores the student's response tokens under its own prompts: ``score(...,
   prompts=teacher_prompts, logits=True)``, full ``[R, G, V]`` logits kept as DeepSpeed's OPSD
   teacher keeps them (or ``top_k``: only the teacher's top-k);
3. a training step on the student (the engine is paused between rollouts, so this is
   DeepSpeed's own forward / backward / step): ``generalized_jsd_loss`` between the student's
   logits and the teacher's on the response tokens, normalised by all ranks' tokens. A rank
   with no rows joins the step with one dummy token and a zero loss: ZeRO-3's forward and
   backward are collectives, so every rank runs one of each per step.

Rank 0 prints the loss per step (the student's divergence from its teacher, all ranks' tokens)
and, at the end, the first and last steps' mean: on a fixed seed it falls.
"""

from __future__ import annotations

import argparse
import random
import time
import warnings

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer

import shardgen
from shardgen import toy


def privileged(prompt: str) -> str:
    """The teacher's prompt: the expected answer, then the question."""
    return f"{toy.expected_answer(prompt)} {prompt}"


def student_logits(model, b) -> torch.Tensor:
    """[R, G, V] the student's logits predicting each response token of shardgen's batch ``b``
    (prompts left-padded: positions count from each row's first real token)."""
    pos = (b.attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=pos).logits
    return logits[:, b.prompt_width - 1 : -1]


def jsd_top_k(
    student: torch.Tensor, top_ids: torch.Tensor, top_lp: torch.Tensor, beta: float
) -> torch.Tensor:
    """[R, G] generalized JSD restricted to the teacher's top-k ids (both renormalised there),
    as ``generalized_jsd_loss(teacher_top_k=k)`` computes it from full logits."""
    s = torch.log_softmax(student.float().gather(-1, top_ids), dim=-1)
    t = torch.log_softmax(top_lp.float(), dim=-1)
    if beta == 0.0:
        return (t.exp() * (t - s)).sum(-1)
    if beta == 1.0:
        return (s.exp() * (s - t)).sum(-1)
    m = torch.logaddexp(s + torch.log1p(torch.tensor(-beta)), t + torch.log(torch.tensor(beta)))
    return (beta * t.exp() * (t - m) + (1 - beta) * s.exp() * (s - m)).sum(-1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=12, help="prompts per step, all ranks together")
    ap.add_argument("--samples", type=int, default=2, help="samples per prompt (n)")
    ap.add_argument("--temperature", type=float, default=1.5)
    ap.add_argument("--beta", type=float, default=0.5, help="generalized JSD: 0 forward KL, 1 reverse KL")
    ap.add_argument("--top-k", type=int, default=0, help="score only the teacher's top-k (0: full logits)")
    ap.add_argument("--teacher", default=None, help="a separate teacher model (default: the student itself)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--local-rank", "--local_rank", type=int, default=0)  # the DeepSpeed launcher's
    args = ap.parse_args()

    import deepspeed
    from deepspeed.runtime.rollout import RolloutRequest, SamplingConfig, generalized_jsd_loss

    from shardgen.integrations.deepspeed import ShardgenRollout

    # DeepSpeed's own training collectives call torch's deprecated names: one warning per call
    warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use", category=FutureWarning)
    rank, world = shardgen.init()
    torch.manual_seed(args.seed)  # the same dropout streams and initial weights on every rank
    tok = AutoTokenizer.from_pretrained(toy.toy_model_path())
    model = AutoModelForCausalLM.from_pretrained(toy.toy_model_path())
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": 3},
    }
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    student, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    rollout = ShardgenRollout(student, tok, seed=args.seed)  # collective; instead of HybridEngineRollout
    # The teacher: the student's own rollout engine (the same sharded weights), or another model
    # in an engine of its own, opened on the same ranks; scoring on either is not collective.
    teacher = shardgen.Engine.from_pretrained(args.teacher, backend="deepspeed") if args.teacher else None

    rng = random.Random(args.seed)
    pad = tok.pad_token_id
    history: list[float] = []
    # The same prompts every step (a fixed seed), so the loss of one step compares with the next.
    tasks = [toy.format_prompt(*toy.sample_task(rng, rng.randint(3, 8))) for _ in range(args.prompts)]
    for step in range(args.steps):
        t0 = time.perf_counter()
        # Uneven shares (rank 0 the most); the last rank has none on odd steps.
        weights = [2] + [1] * (world - 1)
        if world > 1 and step % 2 == 1:
            weights[-1] = 0
        bounds = [round(args.prompts * sum(weights[:r]) / sum(weights)) for r in range(world + 1)]
        mine = tasks[bounds[rank] : bounds[rank + 1]]

        # 1. the rollout: DeepSpeed's request layout (left-padded prompt ids and their mask)
        rows = [tok(p, add_special_tokens=False)["input_ids"] for p in mine]
        width = max((len(r) for r in rows), default=1)
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], dtype=torch.long).view(-1, width)
        mask = (torch.arange(width)[None] >= width - torch.tensor([len(r) for r in rows]).view(-1, 1)).long()
        rollout.generate(
            RolloutRequest(ids, mask),
            SamplingConfig(
                max_new_tokens=12, temperature=args.temperature, n_samples_per_prompt=args.samples
            ),
        )
        b = rollout.last_batch  # shardgen's rows of the same batch: response ids, mask, logprobs

        # 2. the teacher scores the student's responses under its privileged prompts, one per row
        teacher_prompts = [privileged(p) for p in mine for _ in range(args.samples)]
        opts = {"top_k": args.top_k} if args.top_k else {"logits": True}
        if teacher is None:
            scored = rollout.score(b, prompts=teacher_prompts, temperature=1.0, **opts)
        else:
            scored = teacher.score(b, prompts=teacher_prompts, temperature=1.0, **opts)

        # 3. the training step: every rank one forward and one backward (ZeRO-3 collectives)
        tokens = torch.tensor([float(b.response_mask.sum())], dtype=torch.float64)
        dist.all_reduce(tokens)  # one loss scale on every rank: all ranks' response tokens
        student.train()
        if len(b):
            logits = student_logits(student, b)
            if args.top_k:
                per_token = jsd_top_k(logits, scored.top_ids, scored.top_logprobs, args.beta)
                loss_sum = (per_token * b.response_mask).sum()
            else:
                out = generalized_jsd_loss(
                    logits.float(),
                    scored.logits.to(logits.device).float(),
                    b.response_mask.bool(),
                    beta=args.beta,
                )
                loss_sum = out.loss_sum
        else:  # no rows here: one dummy token joins the step's collectives with a zero loss
            loss_sum = student(input_ids=torch.full((1, 1), pad, dtype=torch.long)).logits.sum() * 0.0
        loss = loss_sum * world / tokens.clamp_min(1).item()  # the gradient all-reduce averages
        student.backward(loss)
        student.step()
        student.eval()

        total = torch.tensor([float(loss_sum.detach())], dtype=torch.float64)
        dist.all_reduce(total)
        history.append(total.item() / max(tokens.item(), 1.0))
        if rank == 0:
            print(
                f"step {step:3d}  loss {history[-1]:.4f}  rows here {len(b)}  "
                f"tokens {int(tokens.item())}  {time.perf_counter() - t0:.1f}s",
                flush=True,
            )

    if teacher is not None:
        teacher.close()  # collective
    rollout.shutdown()  # collective
    if rank == 0:
        k = max(1, min(5, len(history) // 2))
        first, last = sum(history[:k]) / k, sum(history[-k:]) / k
        print(f"loss: first {k} steps {first:.4f} -> last {k} steps {last:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
