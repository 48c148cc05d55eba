"""Every ```python block of README.md and docs/*.md is accounted for: a program that
tests/multirank/test_readme.py runs (``# torchrun --nproc-per-node 2 NAME.py``), a block another test file
runs (``RUN_ELSEWHERE``: that file must quote the block's first line), a fragment run here in a
harness that defines its free names (``FRAGMENTS`` in this process, ``WORLD_FRAGMENTS`` on 2 ranks:
an undefined name or a wrong call fails here), or listed in ``NOT_RUN_YET`` with why; a new block in
none of them fails the inventory.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import doc_scenarios
import pytest
import torch
from doc_blocks import ROOT, blocks
from transformers import AutoTokenizer
from vlm import image, prompt, tiny_qwen2_vl

import shardgen
from shardgen.toy import toy_model_path

PROGRAMS = {"quickstart.py", "zero3.py", "rl.py", "opsd.py"}  # tests/multirank/test_readme.py runs them
PLANT = "undefined_in_the_docs"


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


def _score_fragment(code: str) -> None:
    """USAGE, scoring: every call on a tiny Qwen2-VL (text rows, a rollout's rows, a teacher's
    prompts, and an image row beside a text row); the toy tokenizer's ids lie below its image ids."""
    tok = AutoTokenizer.from_pretrained(toy_model_path())
    prompts = ["count from 1 to 3 :", "count down from 6 to 4 :"]
    responses = [tok(r, add_special_tokens=False)["input_ids"] for r in (" 1 2 3", " 6 5")]
    mask = torch.tensor([[1] * len(r) + [0] * (3 - len(r)) for r in responses])
    response_ids = torch.tensor([r + [0] * (3 - len(r)) for r in responses])
    x = image(2, 2, seed=0)
    with (
        shardgen.Engine(tiny_qwen2_vl(0), tokenizer=tok, backend="local") as engine,
        shardgen.Engine(tiny_qwen2_vl(1), tokenizer=tok, backend="local") as teacher,
    ):
        batch = engine.rollout(prompts, n=2, max_new_tokens=3, seed=0)
        names: dict[str, Any] = {
            "engine": engine, "teacher": teacher, "prompts": prompts, "responses": responses,
            "response_ids": response_ids, "mask": mask, "batch": batch,
            "teacher_prompts": [f"{p} again" for p in prompts for _ in range(2)],
            "image_prompts": [prompt([5, 6], x), [9, 10, 11]],
            "pv": x["pixel_values"], "grid": x["image_grid_thw"],
        }  # fmt: skip
        exec(compile(code, "USAGE.md score", "exec"), names)
    sb = names["sb"]  # the last call's: the image row and the text row
    assert sb.logprobs.shape == (2, 3) and sb.mask.tolist() == mask.tolist(), sb.mask
    assert bool(torch.isfinite(sb.logprobs).all()) and bool((sb.logprobs <= 0).all()), sb.logprobs


FRAGMENTS: dict[tuple[str, str], Callable[[str], None]] = {
    ("README.md", "def step_fn(row, completion):"): _tool_fragment,
    ("USAGE.md", "sb = engine.score(prompts, responses)             "): _score_fragment,
}

# Fragments that need ranks: their harness in tests/helpers/doc_scenarios.py, run on 2 DeepSpeed-ready ranks.
WORLD_FRAGMENTS: dict[tuple[str, str], str] = {
    ("USAGE.md", 'engine = shardgen.Engine(model, tokenizer=tok, bac'): "api_summary",
    ("USAGE.md", 'ref = shardgen.Engine(ref_model, backend="fsdp2") '): "ref_kl",
    ("USAGE.md", "# torchrun --nnodes 8 --nproc-per-node 8 my_script"): "hsdp",
    ("USAGE.md", "# shardgen partitions a plain model:"): "ds_engines",
    ("USAGE.md", "from deepspeed.runtime.rollout import RolloutReque"): "ds_rollout",
    ("README.md", "from trl import GRPOConfig"): "trl_tools",
    ("USAGE.md", "from trl import GRPOConfig"): "trl",
    ("README.md", "for step in range(steps):"): "partial_loop",
}  # fmt: skip

# Blocks another test file runs, and the text of the block's first line that file finds it by.
RUN_ELSEWHERE: dict[tuple[str, str], tuple[str, str]] = {
    ("USAGE.md", "# Qwen-VL images without a processor: model (Qwen2"):
        ("test_vlm_by_hand.py", "# Qwen-VL images without a processor"),
}  # fmt: skip

# Blocks no test runs yet, and why (none today: a new one needs a real reason).
NOT_RUN_YET: dict[tuple[str, str], str] = {}


def test_every_doc_block_is_accounted_for():
    found = blocks()
    programs = {k for k, code in found.items() if re.match(r"# torchrun --nproc-per-node 2 (\w+\.py)", k[1])}
    assert {re.search(r"(\w+\.py)", k[1]).group(1) for k in programs} == PROGRAMS  # type: ignore[union-attr]
    rest = set(found) - programs
    listed = [set(FRAGMENTS), set(WORLD_FRAGMENTS), set(RUN_ELSEWHERE), set(NOT_RUN_YET)]
    unknown = rest - set().union(*listed)
    assert not unknown, f"python blocks no test runs: {sorted(unknown)}"
    assert not set().union(*listed) - rest, "listed blocks the docs no longer have"
    assert sum(map(len, listed)) == len(set().union(*listed)), "a block listed twice"


@pytest.mark.parametrize("key", sorted(RUN_ELSEWHERE), ids=lambda k: f"{k[0]}:{k[1][:30]}")
def test_blocks_run_elsewhere_are_found_by_their_test(key):
    """The other test file names the doc and the block's first line: renaming either breaks this."""
    test_file, marker = RUN_ELSEWHERE[key]
    assert blocks()[key].startswith(marker), (key, marker)
    path = next((ROOT / "tests").glob(f"*/{test_file}"))  # tests/unit or tests/multirank
    text = path.read_text(encoding="utf-8")
    assert marker in text and key[0] in text, f"{path} no longer finds {key}"


@pytest.mark.parametrize("key", sorted(FRAGMENTS), ids=lambda k: f"{k[0]}:{k[1][:30]}")
def test_doc_fragment_runs(key):
    FRAGMENTS[key](blocks()[key])


@pytest.mark.parametrize("key", sorted(FRAGMENTS), ids=lambda k: f"{k[0]}:{k[1][:30]}")
def test_a_fragment_naming_an_undefined_symbol_fails(key):
    code = blocks()[key]
    with pytest.raises(NameError, match=PLANT):
        FRAGMENTS[key](f"{code}\n{PLANT}\n")  # after the whole block ran


def test_doc_fragments_on_two_ranks(ds_world2):
    """Every WORLD_FRAGMENTS block on the same 2 ranks, one after another; then each harness given
    its block with an undefined name planted at the top raises the NameError naming it."""
    found = blocks()
    for key, harness in WORLD_FRAGMENTS.items():
        out = ds_world2.run(doc_scenarios.run_block, harness, found[key], timeout=300)
        assert out[0] is not None, (key, out)
    for key, harness in WORLD_FRAGMENTS.items():
        said = ds_world2.run(doc_scenarios.planted, harness, f"{PLANT}\n{found[key]}", PLANT, timeout=120)
        assert all(PLANT in s for s in said), (key, said)
