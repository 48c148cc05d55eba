"""On-policy self-distillation (OPSD) with a privileged teacher prompt, on one DeepSpeed ZeRO-3 engine.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 examples/opsd.py
    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 deepspeed --num_gpus 2 examples/opsd.py
    ... examples/opsd.py --teacher PATH      # another (frozen) teacher model, sharded the same way
    ... examples/opsd.py --top-k 8           # the teacher's top-k log-probs instead of full logits
    ... examples/opsd.py --teacher self      # the student's own moving weights (it collapses: below)

The student is shardgen's shipped toy model (``shardgen.toy``: "count from 7 to 12 :" ->
"7 8 9 10 11 12" then EOS), one ``deepspeed.initialize`` ZeRO-3 engine, asked the bare question:
DeepSpeed's request holds the ids the trainer gives, here without the BOS the toy model was
trained with. Without it the student knows the numbers but not where to stop: it counts on to
``--max-new-tokens`` and gets no answer right at first. The teacher is the same model with
privileged context: its prompt states the answer (BOS, the question, its answer, the question
again), so it stops where the answer ends. The teacher is a frozen copy of the student's
starting weights, a second engine sharded on the same ranks (``--teacher PATH``: another model).
Every step, on every rank:

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

Rank 0 prints, per step and over all ranks, the loss (the student's divergence from its teacher
per response token), the task score (exact answers, EOS included, out of all samples) and the
response tokens; at the end, the first and last steps' means and whether both improved.

A run, the defaults (2 CPU ranks, 20 steps of 12 prompts x 2 samples, temperature 1.5,
``--lr 5e-4``, beta 0.5, 12 new tokens; the first command above): step 0 loss 0.0796, 0/24
right, 278 response tokens (nearly every sample counts on to the limit); 21/24 at step 6; first 5
steps' means loss 0.0665, 8.4/24 right, 232 tokens -> last 5 steps 0.0217, 16.6/24, 146
tokens: both improved. ``--seed`` 1, 2, 3: 5.4 -> 15.2, 9.0 -> 20.4, 5.0 -> 17.8 of 24, loss
0.069 -> 0.030, 0.051 -> 0.002, 0.066 -> 0.026; 40 steps hold at 16-18/24 and 0.017. The
score settles near the teacher's own: its greedy answer starts at the wrong number on 3 of
seed 0's 12 prompts, so about 18/24 is what it can teach. 0.2-0.3 s a step, about 15 s a run.

Why the teacher is frozen: with ``--teacher self`` (the student's own weights, as this example
once ran) the teacher moves with every step. The score reaches 19/24 at step 6, then falls to
2/24 from step 12, about one number an answer, 278 response tokens -> about 50, while the loss
of the last 5 steps (0.043) is below the first 5 (0.068). Both sides of the divergence move,
and stopping at once is a state where they agree; a lone EOS is also one easy token, so the
per-token loss can fall while the task is lost (the example's first recipe, ``--lr 1e-3`` and
the answer-first teacher prompt: 15/24 at step 3, then 2/24, 278 -> 44 tokens, the loss 0.110
-> 0.035). Hence the score and the token count beside the loss. A frozen teacher keeps
saying where each answer ends.
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

MIN_LENGTH, MAX_LENGTH = 3, 8  # numbers per answer of the example's prompts


def privileged(prompt: str) -> str:
    """The teacher's prompt: the question, its answer, then the question again (the tokenizer
    puts BOS first). The toy model reads this form best of those tried: after the answer alone
    (the example's first form) it puts 78% of its probability on the right middle numbers, and
    a frozen teacher of that form took seed 0 only from 6.2 to 7.4 of 24; here 99.5%."""
    return f"{prompt} {toy.expected_answer(prompt)} {prompt}"


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


def correct(tok, b, prompts: list[str]) -> int:
    """How many of ``b``'s rows (``b.n`` per prompt) answer exactly and then stop (EOS)."""
    ok = 0
    for i in range(len(b)):
        ids = b.response_ids[i][b.response_mask[i].bool()].tolist()
        text = tok.decode(ids, skip_special_tokens=True)
        ok += b.finish_reasons[i] == "eos" and toy.check_answer(prompts[i // b.n], text)
    return ok


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=12, help="prompts per step, all ranks together")
    ap.add_argument("--samples", type=int, default=2, help="samples per prompt (n)")
    ap.add_argument("--temperature", type=float, default=1.5, help="the rollout's sampling temperature")
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--beta", type=float, default=0.5, help="generalized JSD: 0 forward KL, 1 reverse KL")
    ap.add_argument("--top-k", type=int, default=0, help="score only the teacher's top-k (0: full logits)")
    ap.add_argument(
        "--teacher",
        default=None,
        help="a teacher model PATH (default: a frozen copy of the student's starting weights); "
        "'self': the student's own, moving, weights (it collapses: see the module docstring)",
    )
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument(
        "--numerics",
        choices=["invariant", "fast"],
        default="invariant",
        help="invariant: the student's training forward gives the rollout's logits bit for bit (on-policy)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--local-rank", "--local_rank", type=int, default=0)  # the DeepSpeed launcher's
    args = ap.parse_args()
    for name in ("steps", "prompts", "samples"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.max_new_tokens < MAX_LENGTH + 1:  # else no answer could be right
        raise ValueError(
            f"--max-new-tokens must be >= {MAX_LENGTH + 1} (answers of up to {MAX_LENGTH} numbers, "
            f"then EOS), got {args.max_new_tokens}"
        )
    return args


def summary(history: list[tuple[float, float, float]], rows: int) -> list[str]:
    """Rank 0's last lines: the first and last steps' means of the loss, the score and the
    tokens, and whether both the loss and the score improved."""
    k = max(1, min(5, len(history) // 2))

    def mean(col: int, part: list[tuple[float, float, float]]) -> float:
        return sum(h[col] for h in part) / len(part)

    (l0, c0, t0), (l1, c1, t1) = ([mean(c, part) for c in range(3)] for part in (history[:k], history[-k:]))
    fell, rose = l1 < l0, c1 > c0
    verdict = "both improved" if fell and rose else "NOT both improved"
    return [
        f"loss: first {k} steps {l0:.4f} -> last {k} steps {l1:.4f}",
        f"correct: first {k} steps {c0:.1f}/{rows} -> last {k} steps {c1:.1f}/{rows}",
        f"tokens: first {k} steps {t0:.0f} -> last {k} steps {t1:.0f}",
        f"{verdict}: the loss {'fell' if fell else 'did not fall'}, "
        f"the task score {'rose' if rose else 'did not rise'}",
    ]


def main() -> None:
    args = parse_args()

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
    # collective; instead of HybridEngineRollout. numerics="invariant": a row's logits are its own bits,
    # so the training forward below (inside shardgen.invariant_numerics()) is the sampler's, exactly
    rollout = ShardgenRollout(student, tok, seed=args.seed, numerics=args.numerics)
    # The teacher: by default the student's starting checkpoint again, in an engine of its own
    # (collective: every rank opens it), never trained; scoring on it is not collective.
    teacher = None
    if args.teacher != "self":
        teacher = shardgen.Engine.from_pretrained(args.teacher or toy.toy_model_path(), backend="deepspeed")

    rng = random.Random(args.seed)
    pad = tok.pad_token_id
    history: list[tuple[float, float, float]] = []  # per step: loss, correct, tokens (all ranks)
    # The same prompts every step (a fixed seed), so one step's figures compare with the next.
    tasks = [
        toy.format_prompt(*toy.sample_task(rng, rng.randint(MIN_LENGTH, MAX_LENGTH)))
        for _ in range(args.prompts)
    ]
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
        sampling = SamplingConfig(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            n_samples_per_prompt=args.samples,
        )
        rollout.generate(RolloutRequest(ids, mask), sampling)
        b = rollout.last_batch  # shardgen's rows of the same batch: response ids, mask, logprobs

        # 2. the teacher scores the student's responses under its privileged prompts, one per row
        teacher_prompts = [privileged(p) for p in mine for _ in range(args.samples)]
        opts = {"top_k": args.top_k} if args.top_k else {"logits": True}
        scorer = rollout if teacher is None else teacher
        scored = scorer.score(b, prompts=teacher_prompts, temperature=1.0, **opts)

        # 3. the training step: every rank one forward and one backward (ZeRO-3 collectives)
        tokens = torch.tensor([float(b.response_mask.sum())], dtype=torch.float64)
        dist.all_reduce(tokens)  # one loss scale on every rank: all ranks' response tokens
        student.train()
        if len(b):
            with shardgen.invariant_numerics(args.numerics == "invariant"):
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

        # every rank's loss sum and exact answers, in one all-reduce (every rank, every step)
        totals = torch.tensor([float(loss_sum.detach()), float(correct(tok, b, mine))], dtype=torch.float64)
        dist.all_reduce(totals)
        history.append((totals[0].item() / max(tokens.item(), 1.0), totals[1].item(), tokens.item()))
        if rank == 0:
            print(
                f"step {step:3d}  loss {history[-1][0]:.4f}  correct {int(totals[1])}/"
                f"{args.prompts * args.samples}  tokens {int(tokens.item())}  rows here {len(b)}  "
                f"{time.perf_counter() - t0:.1f}s",
                flush=True,
            )

    if teacher is not None:
        teacher.close()  # collective
    rollout.shutdown()  # collective
    if rank == 0:
        print("\n".join(summary(history, args.prompts * args.samples)), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
