"""A tiny chat model that calls a tool: Qwen2.5's chat template, a byte-level BPE tokenizer and a
2-layer Llama, overfit in a few seconds on fixed conversations, for TRL's ``tools=`` loop.

    path = shipped()               # the model as built and saved under tests/helpers/assets/tool-model
    path = build(tmp_dir)          # the same, trained again (about 40 s on one CPU core)

The tests load the shipped copy (``shipped`` checks that it still answers as trained, on the
running CPU, with one teacher-forced forward); ``python tests/helpers/tool_model.py`` rebuilds it.

Each user question of ``CONVERSATIONS`` is answered after 0, 1 or 2 calls of ``add``, so a rank
given one kind of question takes a different number of tool turns than a rank given another.
The training sequences are built as TRL's tool loop builds them (``GRPOTrainer._tool_call_loop``):
the prompt's ids, then each completion's ids, then the tool reply's ids from TRL's own
``_get_tool_suffix_ids``, concatenated (never re-tokenized). The model is overfit until each
answer token has probability > 0.999, so sampling at temperature 1 gives the greedy answer.
Nothing is downloaded; built deterministically from a seed on CPU.
"""

from __future__ import annotations

import json
import os
import time
import types
from pathlib import Path

#: (question, the add() calls the model makes, in turn order, then its final answer)
CONVERSATIONS: tuple[tuple[str, tuple[tuple[int, int], ...], str], ...] = (
    ("Say hi.", (), "hi"),
    ("Say bye.", (), "bye"),
    ("What is 3 plus 4?", ((3, 4),), "7"),
    ("What is 2 plus 5?", ((2, 5),), "7"),
    ("What is 3 plus 4 plus 5?", ((3, 4), (7, 5)), "12"),
    ("What is 1 plus 2 plus 6?", ((1, 2), (3, 6)), "9"),
)
TOOL_TURNS = {q: len(calls) for q, calls, _ in CONVERSATIONS}
ANSWERS = {q: a for q, _, a in CONVERSATIONS}
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL_S = 0.05  # what a call of the tool takes (a real tool's: a sandbox, a search); engines tick meanwhile


def add(a: int, b: int) -> int:
    """
    Adds two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The sum of a and b.
    """
    time.sleep(TOOL_S)
    return a + b


class AddEnv:
    """The same tool as an environment (TRL's ``environment_factory``): its public methods are the
    tools, ``reset`` starts an episode (the prompt unchanged), ``calls`` counts its tool calls."""

    def __init__(self) -> None:
        self.calls = 0

    def reset(self, **_: object) -> None:
        self.calls = 0

    def add(self, a: int, b: int) -> int:
        """
        Adds two integers.

        Args:
            a: The first integer.
            b: The second integer.

        Returns:
            The sum of a and b.
        """
        self.calls += 1
        return add(a, b)


def prompt(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def call_text(a: int, b: int) -> str:
    """The assistant's tool call, as Qwen2.5's template renders one."""
    return '<tool_call>\n{"name": "add", "arguments": ' + json.dumps({"a": a, "b": b}) + "}\n</tool_call>"


def _chat_template() -> str:
    from trl.chat_template_utils import qwen2_5_chat_template

    return qwen2_5_chat_template


def _tokenizer(corpus: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=_chat_template(),
        padding_side="left",
    )


def _suffix_ids(tok, tool_messages: list[dict]) -> list[int]:
    """TRL's own tool-reply ids (``GRPOTrainer._get_tool_suffix_ids``) for this tokenizer."""
    from trl import GRPOTrainer
    from trl.chat_template_utils import get_training_chat_template, is_chat_template_prefix_preserving

    template = None if is_chat_template_prefix_preserving(tok) else get_training_chat_template(tok)
    me = types.SimpleNamespace(
        processing_class=tok, _tokenizer=tok, chat_template=template, chat_template_kwargs={}, _is_vlm=False
    )
    return GRPOTrainer._get_tool_suffix_ids(me, tool_messages)


def sequence(tok, question: str) -> tuple[list[int], list[int]]:
    """One conversation's ids as TRL's tool loop concatenates them, and its tool mask (TRL's
    ``tool_mask`` over the whole sequence: 1 on the model's tokens, 0 on the prompt and replies)."""
    from trl.chat_template_utils import get_training_chat_template, is_chat_template_prefix_preserving

    template = None if is_chat_template_prefix_preserving(tok) else get_training_chat_template(tok)
    ids = list(
        tok.apply_chat_template(
            prompt(question), tools=[add], chat_template=template, add_generation_prompt=True, tokenize=True,
            return_dict=True,
        )["input_ids"]
    )  # fmt: skip
    own = [0] * len(ids)
    calls = next(c for q, c, _ in CONVERSATIONS if q == question)
    for a, b in calls:
        said = tok(call_text(a, b) + "<|im_end|>", add_special_tokens=False)["input_ids"]
        reply = _suffix_ids(tok, [{"role": "tool", "name": "add", "content": str(add(a, b))}])
        ids, own = ids + said + reply, own + [1] * len(said) + [0] * len(reply)
    said = tok(ANSWERS[question] + "<|im_end|>", add_special_tokens=False)["input_ids"]
    return ids + said, own + [1] * len(said)


def _least_likely(model, input_ids, mask, labels) -> float:
    """The smallest probability the model gives to one of its own tokens (teacher forced)."""
    import torch

    model.eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=input_ids, attention_mask=mask.long()).logits[:, :-1], -1)
    target = labels[:, 1:]
    picked = logp.gather(-1, target.clamp(min=0)[..., None]).squeeze(-1)[target != -100]
    return float(picked.min().exp())


SHIPPED = Path(__file__).parent / "assets" / "tool-model"


def _training_rows(tok) -> tuple:
    """The conversations as one padded batch: input ids, mask, labels (-100 off the model's tokens)."""
    import torch

    rows = [sequence(tok, q) for q, _, _ in CONVERSATIONS]
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), tok.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    for i, (ids, own) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(ids)] = torch.where(
            torch.tensor(own) == 1, torch.tensor(ids), -100
        )  # the model's tokens
    mask = torch.arange(width) < torch.tensor([len(ids) for ids, _ in rows])[:, None]
    return input_ids, mask, labels


def shipped() -> str:
    """The path of the shipped model, after checking that it gives each of its own answer tokens
    probability > 0.999 on this CPU (one forward), as ``build`` left it."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(SHIPPED)
    model = LlamaForCausalLM.from_pretrained(SHIPPED)
    worst = _least_likely(model, *_training_rows(tok))
    if worst <= 0.999:
        raise RuntimeError(
            f"the shipped tool model at {SHIPPED} gives an answer token p={worst:.4f} (<= 0.999) on this "
            "CPU or these library versions: rebuild it with `python tests/helpers/tool_model.py`"
        )
    return str(SHIPPED)


def build(out_dir: str | os.PathLike, max_steps: int = 1500, seed: int = 0) -> str:
    """Build, train and save the tokenizer and model under ``out_dir``; returns the path."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    bootstrap = _tokenizer(["x"])  # renders the template; the real vocabulary is learned below
    corpus = []
    for q, calls, answer in CONVERSATIONS:
        corpus.append(
            bootstrap.apply_chat_template(prompt(q), tools=[add], add_generation_prompt=True, tokenize=False)
        )
        corpus += [
            call_text(a, b) + f"<|im_end|>\n<|im_start|>user\n<tool_response>\n{a + b}\n</tool_response>"
            for a, b in calls
        ]
        corpus.append(answer + "<|im_end|>")
    tok = _tokenizer(corpus * 4)
    input_ids, mask, labels = _training_rows(tok)

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    worst = 0.0
    for step in range(max_steps):
        model.train()
        loss = model(input_ids=input_ids, attention_mask=mask.long(), labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 49:
            worst = _least_likely(model, input_ids, mask, labels)
            if worst > 0.999:
                break
    if worst <= 0.999:
        raise RuntimeError(f"tool model underfit after {max_steps} steps: an answer token has p={worst:.4f}")
    model.eval()
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.bos_token_id = None
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


if __name__ == "__main__":
    print(build(SHIPPED))
