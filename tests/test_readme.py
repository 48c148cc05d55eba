"""The README's three scripts, each run as its block says (``torchrun --nproc-per-node 2 NAME.py``).

A file of its own beside tests/test_examples.py (both launch through tests/example_runs.py), so that the
suite's workers share the example runs (``make test`` runs one file per worker at a time).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from example_runs import HAS_DEEPSPEED, RANK_LINE, ROOT, RUN_TIMEOUT_S, launcher, run
from ports import free_port

from shardgen import toy

pytestmark = [pytest.mark.slow, pytest.mark.multirank]


# ------------------------------------------------ the README's examples, as written

README = ROOT / "README.md"
README_SCRIPT = re.compile(r"```python\n(# torchrun --nproc-per-node 2 (\w+\.py)[^\n]*\n.*?)```", re.S)


def readme_scripts() -> dict[str, str]:
    """``{name: code}`` of every README block that starts ``# torchrun --nproc-per-node 2 NAME.py``."""
    return {m.group(2): m.group(1) for m in README_SCRIPT.finditer(README.read_text(encoding="utf-8"))}


def test_readme_has_its_three_scripts():
    assert set(readme_scripts()) == {"quickstart.py", "zero3.py", "rl.py"}


def _run_readme_script(name: str, tmp_path: Path, timeout: float = RUN_TIMEOUT_S) -> str:
    script = tmp_path / name
    script.write_text(readme_scripts()[name], encoding="utf-8")  # exactly the README's text
    cmd = [*launcher("torchrun", "torch.distributed.run"), "--nproc-per-node", "2",
           "--master-port", str(free_port()), str(script)]  # fmt: skip
    rc, out, _ = run(cmd, timeout=timeout)
    assert rc == 0, f"exit code {rc}\n--- output ---\n{out}"
    assert "FutureWarning" not in out or name == "zero3.py", out  # the user's own from_pretrained may warn
    return out


def test_readme_quickstart(tmp_path):
    out = _run_readme_script("quickstart.py", tmp_path)
    answers = re.findall(RANK_LINE + r"(\d): '([^']*)' \((\w+)\)", out)
    assert sorted(r for r, _, _ in answers) == ["0", "1", "1"], out  # rank r asked r + 1 prompts
    prompts = ["count from 1 to 5 :", "count down from 9 to 7 :"]
    by_rank = {"0": [], "1": []}
    for r, text, reason in answers:
        by_rank[r].append((text, reason))
    for r, got in by_rank.items():
        for p, (text, reason) in zip(prompts, got, strict=False):
            assert toy.check_answer(p, text) and reason == "eos", (r, p, text, reason)
    assert "[shardgen rank" not in out, out  # nothing logged at the default level


# In `make fuzz`, not `make test`: a DeepSpeed launch; the README's other scripts run here.
@pytest.mark.long
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="needs deepspeed")
def test_readme_zero3_hf_deepspeed_config(tmp_path):
    out = _run_readme_script("zero3.py", tmp_path, timeout=2 * RUN_TIMEOUT_S)
    answers = re.findall(RANK_LINE + r"(\d): '([^']*)'", out)
    assert sorted(r for r, _ in answers) == ["0", "1", "1"], out
    assert all(toy.check_answer("count from 4 to 8 :", t) for _, t in answers), out


def test_readme_rl_loop(tmp_path):
    out = _run_readme_script("rl.py", tmp_path)
    steps = re.findall(RANK_LINE + r"(\d) step (\d): reward ([\d.]+)", out)
    assert sorted((r, s) for r, s, _ in steps) == [(r, s) for r in "01" for s in "012"], out
    bars = [x for x in re.split(r"[\r\n]", out) if "Loading weights" in x and "100%" in x]
    assert len(bars) == 1, out  # transformers' bar, on rank 0 only
