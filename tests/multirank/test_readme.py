"""The README's scripts, each run as its block says (``torchrun --nproc-per-node 2 NAME.py``): all but
the DeepSpeed one in one job (tests/helpers/readme_programs.py), each as its own ``__main__``, its ranks
started as torchrun starts them (tests/helpers/example_runs.py ``run_forked``; the DeepSpeed one under
torchrun itself, in ``make fuzz``).

A file of its own beside tests/multirank/test_examples.py (both launch through
tests/helpers/example_runs.py), so that the suite's workers share the example runs (``make test`` runs
one file per worker at a time).
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
from example_runs import HAS_DEEPSPEED, RANK_LINE, ROOT, RUN_TIMEOUT_S, launcher, run, run_forked
from ports import free_port

from shardgen import toy

pytestmark = [pytest.mark.slow, pytest.mark.multirank]


# ------------------------------------------------ the README's examples, as written

README = ROOT / "README.md"
# A block that starts ``# torchrun --nproc-per-node 2 NAME.py``, at any indent (inside a list item).
README_SCRIPT = re.compile(
    r"^( *)```python\n\1(# torchrun --nproc-per-node 2 (\w+\.py)[^\n]*\n.*?)^\1```", re.S | re.M
)
# Run together in one job (tests/helpers/readme_programs.py); zero3.py needs DeepSpeed, alone.
TOGETHER = ["quickstart.py", "rl.py", "opsd.py"]


def readme_scripts() -> dict[str, str]:
    """``{name: code}`` of every README block that starts ``# torchrun --nproc-per-node 2 NAME.py``."""
    text = README.read_text(encoding="utf-8")
    return {m.group(3): textwrap.dedent(m.group(1) + m.group(2)) for m in README_SCRIPT.finditer(text)}


def test_readme_has_its_scripts():
    assert set(readme_scripts()) == {"quickstart.py", "zero3.py", "rl.py", "opsd.py"}


def _write(names: list[str], tmp_path: Path) -> list[Path]:
    scripts = readme_scripts()
    for name in names:
        (tmp_path / name).write_text(scripts[name], encoding="utf-8")  # exactly the README's text
    return [tmp_path / name for name in names]


def _run_readme_script(name: str, tmp_path: Path, timeout: float = RUN_TIMEOUT_S) -> str:
    (script,) = _write([name], tmp_path)
    cmd = [*launcher("torchrun", "torch.distributed.run"), "--nproc-per-node", "2",
           "--master-port", str(free_port()), str(script)]  # fmt: skip
    rc, out, _ = run(cmd, timeout=timeout)
    assert rc == 0, f"exit code {rc}\n--- output ---\n{out}"
    assert "FutureWarning" not in out or name == "zero3.py", out  # the user's own from_pretrained may warn
    return out


@pytest.fixture(scope="module")
def together(tmp_path_factory) -> dict[str, str]:
    """``{name: its output}`` of the README programs run in one job of 2 ranks."""
    scripts = _write(TOGETHER, tmp_path_factory.mktemp("readme"))
    rc, out, _ = run_forked(ROOT / "tests" / "helpers" / "readme_programs.py", *map(str, scripts))
    assert rc == 0, f"exit code {rc}\n--- output ---\n{out}"
    assert "FutureWarning" not in out, out
    parts = re.split(r"=== done (\w+\.py)\n", out)
    got = {name: parts[2 * i] for i, name in enumerate(parts[1::2])}  # a program's lines precede its marker
    assert list(got) == TOGETHER, out
    return got


def test_readme_quickstart(together):
    out = together["quickstart.py"]
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


def test_readme_rl_loop(together):
    out = together["rl.py"]
    steps = re.findall(RANK_LINE + r"(\d) step (\d): (\d+) rows, reward ([\d.]+)", out)
    assert sorted((r, s) for r, s, _, _ in steps) == [(r, s) for r in "01" for s in "012"], out
    empty = sorted((r, s) for r, s, rows, _ in steps if rows == "0")
    assert empty == [("0", "0"), ("1", "2")], out  # a rank with no prompts took the step too
    bars = [x for x in re.split(r"[\r\n]", out) if "Loading weights" in x and "100%" in x]
    assert len(bars) == 1, out  # transformers' bar, on rank 0 only


def test_readme_opsd_loop(together):
    out = together["opsd.py"]
    steps = re.findall(RANK_LINE + r"(\d) step (\d): (\d+) rows, KL ([\d.]+)", out)
    assert sorted((r, s, rows) for r, s, rows, _ in steps) == [
        ("0", "0", "4"),
        ("0", "1", "4"),
        ("1", "0", "2"),
        ("1", "1", "0"),
    ], out  # rank 1: no prompts at step 1, one dummy forward and backward
    kl = {(r, s): float(v) for r, s, _, v in steps}
    assert kl[("1", "1")] == 0.0 and all(v > 0 for k, v in kl.items() if k != ("1", "1")), out
