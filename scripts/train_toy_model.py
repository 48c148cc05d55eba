#!/usr/bin/env python
"""Train the tiny "toy-counter" causal LM that shardgen ships, on CPU, reproducibly.

The task (see ``shardgen.toy``): ``"count from 7 to 19 :"`` -> ``"7 8 ... 19"`` + EOS and
``"count down from 19 to 7 :"`` -> ``"19 18 ... 7"`` + EOS, numbers in ``0..MAX_NUMBER``,
answers of ``1..MAX_ANSWER_NUMBERS`` numbers. The model is a small ``LlamaForCausalLM``
built with ``AutoModelForCausalLM.from_config``; the tokenizer is a word-level
``tokenizers`` tokenizer (built offline) wrapped as ``PreTrainedTokenizerFast``.

Same command -> same weights: every random draw is seeded, torch runs single-threaded
with deterministic algorithms, and there is no dropout.

Usage::

    OMP_NUM_THREADS=1 python scripts/train_toy_model.py            # -> src/shardgen/assets/toy-counter
    OMP_NUM_THREADS=1 python scripts/train_toy_model.py --out /tmp/toy
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parent.parent
try:
    from shardgen import toy
except ImportError:  # running from a checkout without the package installed
    sys.path.insert(0, str(REPO / "src"))
    from shardgen import toy

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    PreTrainedTokenizerFast,
)

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIALS = (PAD, BOS, EOS, UNK)  # ids 0, 1, 2, 3
MAX_NEW_TOKENS = toy.MAX_ANSWER_NUMBERS + 1  # the longest answer plus its EOS


def build_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate(SPECIALS + toy.VOCAB_WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # WordPiece decoding with a prefix that never occurs = join the words with single spaces.
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, vocab[BOS])]
    )
    tok.add_special_tokens(list(SPECIALS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=128,
    )


def build_model(tokenizer: PreTrainedTokenizerFast, args: argparse.Namespace) -> torch.nn.Module:
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        attention_dropout=0.0,
        initializer_range=0.02,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        use_cache=True,
    )
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def make_batch(
    rng: random.Random, tokenizer: PreTrainedTokenizerFast, batch_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and next-token ``targets`` (-100 = no loss).

    Each row is ``<s> prompt answer </s>``; the loss is on the answer words and the EOS.
    """
    vocab = tokenizer.get_vocab()
    bos, eos, pad = tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
    rows: list[tuple[list[int], int]] = []
    for _ in range(batch_size):
        prompt = toy.format_prompt(*toy.sample_task(rng))
        p_ids = [bos] + [vocab[w] for w in prompt.split()]
        a_ids = [vocab[w] for w in toy.expected_answer(prompt).split()] + [eos]
        rows.append((p_ids + a_ids, len(p_ids)))
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((batch_size, width), pad, dtype=torch.long)
    mask = torch.zeros((batch_size, width), dtype=torch.long)
    targets = torch.full((batch_size, width), -100, dtype=torch.long)
    for r, (ids, n_prompt) in enumerate(rows):
        input_ids[r, : len(ids)] = torch.tensor(ids)
        mask[r, : len(ids)] = 1
        # position t predicts token t+1; answer tokens start at index n_prompt
        targets[r, n_prompt - 1 : len(ids) - 1] = torch.tensor(ids[n_prompt:])
    return input_ids, mask, targets


def lr_at(step: int, args: argparse.Namespace) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.05 + 0.95 * 0.5 * (1.0 + math.cos(math.pi * progress)))


@torch.no_grad()
def greedy_accuracy(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, prompts: list[str], batch_size: int = 256
) -> tuple[float, list[tuple[str, str]]]:
    """Exact-match accuracy of HF greedy ``generate`` on left-padded batches; also the failures."""
    model.eval()
    ok, failures = 0, []
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i : i + batch_size]
        enc = tokenizer(chunk, return_tensors="pt", padding=True)
        out = model.generate(
            **enc,
            do_sample=False,
            max_new_tokens=MAX_NEW_TOKENS,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        for prompt, text in zip(chunk, texts, strict=True):
            if toy.check_answer(prompt, text):
                ok += 1
            else:
                failures.append((prompt, text))
    return ok / max(1, len(prompts)), failures


def all_prompts() -> list[str]:
    """Every prompt of the task (both directions, every valid start and length)."""
    out = []
    for length in range(1, toy.MAX_ANSWER_NUMBERS + 1):
        for low in range(0, toy.MAX_NUMBER - length + 2):
            high = low + length - 1
            out.append(toy.format_prompt(low, high))
            if length > 1:
                out.append(toy.format_prompt(high, low))
    return out


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--out", type=Path, default=toy.TOY_MODEL_PATH, help="output folder (default: %(default)s)"
    )
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--eval-prompts", type=int, default=1000, help="random prompts for the final greedy eval")
    ap.add_argument("--min-accuracy", type=float, default=0.95, help="exit 1 below this greedy accuracy")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--log-every", type=int, default=100)
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    tokenizer = build_tokenizer()
    model = build_model(tokenizer, args)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters; vocab {len(tokenizer)}", flush=True)
    print(model.config.to_json_string(use_diff=True), flush=True)

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.98),
    )
    data_rng = random.Random(args.seed)
    t0 = time.perf_counter()
    model.train()
    running = 0.0
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        input_ids, mask, targets = make_batch(data_rng, tokenizer, args.batch_size)
        logits = model(input_ids=input_ids, attention_mask=mask).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        running += loss.item()
        if (step + 1) % args.log_every == 0:
            print(
                f"step {step + 1:5d}  loss {running / args.log_every:.4f}  lr {lr_at(step, args):.2e}  "
                f"{time.perf_counter() - t0:6.1f}s",
                flush=True,
            )
            running = 0.0
    train_s = time.perf_counter() - t0
    print(f"training: {args.steps} steps in {train_s:.1f}s", flush=True)

    # Final greedy evaluation, through HF generate with left-padded batches (as users will run it).
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
        max_new_tokens=MAX_NEW_TOKENS,
    )
    eval_prompts = [p["prompt"] for p in toy.make_prompts(args.eval_prompts, seed=10_000 + args.seed)]
    acc, fails = greedy_accuracy(model, tokenizer, eval_prompts)
    print(f"greedy exact-match accuracy on {len(eval_prompts)} random prompts: {acc:.4f}", flush=True)
    skew_prompts = [p["prompt"] for p in toy.make_prompts(200, seed=20_000 + args.seed, skew=True)]
    skew_acc, _ = greedy_accuracy(model, tokenizer, skew_prompts)
    print(f"greedy exact-match accuracy on {len(skew_prompts)} skewed prompts: {skew_acc:.4f}", flush=True)
    every = all_prompts()
    all_acc, all_fails = greedy_accuracy(model, tokenizer, every)
    print(f"greedy exact-match accuracy on all {len(every)} task prompts: {all_acc:.4f}", flush=True)
    for prompt, text in all_fails[:10]:
        print(f"  FAIL {prompt!r} -> {text!r}", flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    print(f"saved to {args.out} ({dir_size(args.out) / 1e6:.2f} MB)", flush=True)
    print(f"total time {time.perf_counter() - t0:.1f}s", flush=True)
    if acc < args.min_accuracy:
        print(f"ERROR: accuracy {acc:.4f} < {args.min_accuracy}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
