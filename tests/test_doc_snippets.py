"""Every ```python block of README.md and docs/*.md is accounted for: a program that
tests/test_readme.py runs (``# torchrun --nproc-per-node 2 NAME.py``), or a fragment this module
runs in a harness that defines its free names (an undefined name or a wrong call fails here), or
listed in ``NOT_RUN_YET`` with why; a new block in none of them fails the inventory.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import shardgen
from shardgen.toy import toy_model_path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^( *)```python\n(.*?)^\1```", re.S | re.M)
PROGRAMS = {"quickstart.py", "zero3.py", "rl.py", "opsd.py"}  # tests/test_readme.py runs them


def blocks() -> dict[tuple[str, str], str]:
    """``{(file, its first line's first 50 characters): code}`` of every python block, dedented."""
    out = {}
    for path in DOCS:
        for m in BLOCK.finditer(path.read_text(encoding="utf-8")):
            code = textwrap.dedent(m.group(2))
            out[(path.name, code.splitlines()[0].strip()[:50])] = code
    return out


def _tool_fragment(code: str) -> None:
    """README, multi-turn: ``step_fn`` and the rollout that calls it, on the toy model (a "tool"
    the toy's counting answers call: one reply, then the row ends)."""
    with shardgen.Engine.from_pretrained(toy_model_path(), backend="local") as engine:
        calls: list[str] = []

        def parse_tool_call(text: str) -> str | None:
            calls.append(text)
            return None if len(calls) > 2 else text.split()[-1] if text.split() else "0"

        names: dict[str, Any] = {
            "engine": engine, "tok": engine.tokenizer, "my_prompts": ["count from 2 to 4 :"], "step": 0,
            "parse_tool_call": parse_tool_call, "run_tool": lambda call: f"{call} :",
        }  # fmt: skip
        exec(compile(code, "README.md step_fn", "exec"), names)
        batch = names["batch"]
        assert len(batch) == 4 and len(batch.turns) == 4 and max(batch.turns) >= 2, batch.turns


FRAGMENTS: dict[tuple[str, str], Callable[[str], None]] = {
    ("README.md", "def step_fn(row, completion):"): _tool_fragment,
}

# Blocks no test runs yet, and why: each needs its own harness (left for a follow-up).
NOT_RUN_YET: dict[tuple[str, str], str] = {
    ("README.md", "from shardgen.integrations.trl import GRPOTrainer "):
        "TRL trainer with GRPOConfig(...) placeholders",
    ("USAGE.md", 'engine = shardgen.Engine(model, tokenizer=tok, bac'):
        "API summary: fsdp2 engines, needs a world",
    ("USAGE.md", 'engine = shardgen.Engine(model, tok, backend="deep'):
        "DeepSpeed engines: needs a DeepSpeed world",
    ("USAGE.md", "# torchrun --nnodes 8 --nproc-per-node 8 my_script"):
        "HSDP on an 8 x 8 CUDA mesh",
    ("USAGE.md", "sb = engine.score(prompts, responses)             "):
        "score calls; the last one needs a VLM engine",
    ("USAGE.md", 'ref = shardgen.Engine(ref_model, backend="fsdp2") '):
        "reference-model KL step: fsdp2 inside paused(), needs a world",
    ("USAGE.md", "from shardgen.integrations.trl import GRPOTrainer "):
        "TRL trainer with GRPOConfig(...) placeholders",
    ("USAGE.md", "from deepspeed.runtime.rollout import RolloutReque"):
        "ShardgenRollout: needs a DeepSpeed world",
    ("DEEPSPEED.md", "deepspeed.zero.Init(module=model, data_parallel_gr"):
        "what shardgen calls inside DeepSpeed, with placeholders (<model dtype>): not user code",
}  # fmt: skip


def test_every_doc_block_is_accounted_for():
    found = blocks()
    programs = {k for k, code in found.items() if re.match(r"# torchrun --nproc-per-node 2 (\w+\.py)", k[1])}
    assert {re.search(r"(\w+\.py)", k[1]).group(1) for k in programs} == PROGRAMS  # type: ignore[union-attr]
    rest = set(found) - programs
    unknown = rest - set(FRAGMENTS) - set(NOT_RUN_YET)
    assert not unknown, f"python blocks no test runs: {sorted(unknown)}"
    assert not (set(FRAGMENTS) | set(NOT_RUN_YET)) - rest, "listed blocks the docs no longer have"


@pytest.mark.parametrize("key", sorted(FRAGMENTS), ids=lambda k: f"{k[0]}:{k[1][:30]}")
def test_doc_fragment_runs(key):
    FRAGMENTS[key](blocks()[key])


def test_a_fragment_naming_an_undefined_symbol_fails():
    key = ("README.md", "def step_fn(row, completion):")
    code = blocks()[key].replace("max_turns=8", "max_turns=undefined_in_the_docs")
    with pytest.raises(NameError, match="undefined_in_the_docs"):
        FRAGMENTS[key](code)
