"""The toy "counter" model shipped with shardgen, and the synthetic task it was trained on.

The task: given a prompt such as ``"count from 7 to 19 :"`` the answer is
``"7 8 9 10 11 12 13 14 15 16 17 18 19"`` followed by EOS; given
``"count down from 19 to 7 :"`` the answer is ``"19 18 17 ... 7"``. Numbers lie in
``0..MAX_NUMBER`` and an answer holds ``1..MAX_ANSWER_NUMBERS`` numbers, so the answer
length (and the step at which EOS comes) depends on the prompt, and every answer can be
checked exactly with :func:`check_answer`.

The model itself (a tiny ``LlamaForCausalLM`` plus a word-level tokenizer) lives in
``assets/toy-counter`` next to this file and is built by ``scripts/train_toy_model.py``.
This module has no torch dependency: it only knows paths, prompts and answers.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

__all__ = [
    "MAX_ANSWER_NUMBERS",
    "MAX_NUMBER",
    "TOY_MODEL_PATH",
    "VOCAB_WORDS",
    "answer_length",
    "answer_reward",
    "check_answer",
    "expected_answer",
    "format_prompt",
    "make_prompts",
    "sample_task",
    "toy_model_path",
]

#: Folder holding the shipped toy model (``config.json``, ``model.safetensors``,
#: ``generation_config.json``) and its tokenizer files.
TOY_MODEL_PATH: Path = Path(__file__).resolve().parent / "assets" / "toy-counter"

#: Largest number that appears in a prompt or an answer (numbers are 0..MAX_NUMBER).
MAX_NUMBER: int = 62
#: Largest number of numbers in one answer (an answer holds 1..MAX_ANSWER_NUMBERS numbers).
MAX_ANSWER_NUMBERS: int = 25

#: The non-special words of the tokenizer, in vocabulary order (after the special tokens).
VOCAB_WORDS: tuple[str, ...] = ("count", "down", "from", "to", ":") + tuple(
    str(i) for i in range(MAX_NUMBER + 1)
)

_PROMPT_RE = re.compile(r"^count (down )?from (\d+) to (\d+) :$")


def toy_model_path() -> str:
    """The shipped toy model folder as a string, ready for ``from_pretrained``."""
    return str(TOY_MODEL_PATH)


def format_prompt(start: int, end: int) -> str:
    """The prompt asking to count from ``start`` to ``end`` (down when ``end < start``)."""
    if not (0 <= start <= MAX_NUMBER and 0 <= end <= MAX_NUMBER):
        raise ValueError(f"numbers must lie in 0..{MAX_NUMBER}, got {start} and {end}")
    if abs(end - start) + 1 > MAX_ANSWER_NUMBERS:
        raise ValueError(f"an answer holds at most {MAX_ANSWER_NUMBERS} numbers, got {start}..{end}")
    if end < start:
        return f"count down from {start} to {end} :"
    return f"count from {start} to {end} :"


def _parse(prompt: str) -> tuple[int, int]:
    m = _PROMPT_RE.match(" ".join(prompt.split()))
    if m is None:
        raise ValueError(f"not a toy-counter prompt: {prompt!r}")
    down, start, end = m.group(1) is not None, int(m.group(2)), int(m.group(3))
    if start > MAX_NUMBER or end > MAX_NUMBER:
        raise ValueError(f"numbers must lie in 0..{MAX_NUMBER}: {prompt!r}")
    if (down and end > start) or (not down and end < start):
        raise ValueError(f"direction does not match the numbers: {prompt!r}")
    return start, end


def expected_answer(prompt: str) -> str:
    """The exact answer to a toy prompt: the numbers from start to end, separated by single spaces.

    Raises ``ValueError`` when ``prompt`` is not a well-formed toy-counter prompt.
    """
    start, end = _parse(prompt)
    step = 1 if end >= start else -1
    return " ".join(str(i) for i in range(start, end + step, step))


def answer_length(prompt: str) -> int:
    """How many numbers (= answer tokens before EOS) the answer to ``prompt`` holds."""
    start, end = _parse(prompt)
    return abs(end - start) + 1


def check_answer(prompt: str, answer: str) -> bool:
    """True when ``answer`` (after ``.strip()``) is exactly :func:`expected_answer` of ``prompt``."""
    return answer.strip() == expected_answer(prompt)


def answer_reward(prompt: str, answer: str) -> float:
    """Partial credit for RL: the fraction of the expected numbers that ``answer`` gives in order
    from the start, over the longer of both (1.0 exactly when :func:`check_answer` holds)."""
    want, got = expected_answer(prompt).split(), answer.split()
    k = 0
    while k < min(len(want), len(got)) and want[k] == got[k]:
        k += 1
    return k / max(len(want), len(got))


def sample_task(rng: random.Random, length: int | None = None, down: bool | None = None) -> tuple[int, int]:
    """Draw ``(start, end)`` from the task distribution.

    The answer length is uniform in ``1..MAX_ANSWER_NUMBERS`` unless given, the direction is
    a fair coin unless given, and the start is uniform among the valid ones.
    """
    if length is None:
        length = rng.randint(1, MAX_ANSWER_NUMBERS)
    if not 1 <= length <= MAX_ANSWER_NUMBERS:
        raise ValueError(f"length must lie in 1..{MAX_ANSWER_NUMBERS}, got {length}")
    if down is None:
        down = rng.random() < 0.5
    low = rng.randint(0, MAX_NUMBER - length + 1)
    high = low + length - 1
    return (high, low) if down else (low, high)


def make_prompts(n: int, seed: int = 0, *, skew: bool = False) -> list[dict]:
    """``n`` prompts ``{"id": str, "prompt": str}``, deterministic for a given ``seed``.

    Without ``skew`` the answer lengths are uniform in ``1..MAX_ANSWER_NUMBERS``. With
    ``skew=True`` they are strongly skewed: about 85% of the prompts have short answers
    (1..4 numbers) and the rest long ones (20..MAX_ANSWER_NUMBERS numbers), so some
    sequences finish much later than others. For ``n >= 2`` a skewed set always holds at
    least one short and one long prompt, and the long ones sit at random positions.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(f"shardgen-toy-{seed}-{int(skew)}")
    lengths: list[int | None]
    if skew:
        n_long = max(1, min(n - 1, round(0.15 * n))) if n >= 2 else 0
        long_at = set(rng.sample(range(n), n_long))
        lengths = [
            rng.randint(20, MAX_ANSWER_NUMBERS) if i in long_at else rng.randint(1, 4) for i in range(n)
        ]
    else:
        lengths = [None] * n
    out = []
    for i, length in enumerate(lengths):
        start, end = sample_task(rng, length)
        out.append({"id": f"toy-{seed}-{i:05d}", "prompt": format_prompt(start, end)})
    return out
