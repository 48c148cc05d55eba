"""What ``make test`` leaves out, ``make fuzz`` runs: every test file with a ``long`` or ``bigworld``
case is named in the fuzz recipe (a case moved out of ``make test`` must not be dropped)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Files whose long cases run in ``make fuzz`` another way, and how.
ELSEWHERE = {
    "tests/multirank/test_clean_exit.py": "tests/helpers/two_agents.py runs its job ten times",
}


def _recipe(target: str) -> str:
    text = ROOT.joinpath("Makefile").read_text(encoding="utf-8").replace("\\\n", " ")
    m = re.search(rf"^{target}:[^\n]*\n((?:\t[^\n]*\n)+)", text, flags=re.M)
    assert m, f"no {target} target in the Makefile"
    return m.group(1)


def test_every_file_with_long_or_bigworld_cases_runs_in_make_fuzz():
    fuzz = _recipe("fuzz")
    marked = sorted(
        str(p.relative_to(ROOT))
        for p in ROOT.joinpath("tests").rglob("test_*.py")
        if re.search(r"pytest\.mark\.(long|bigworld)\b", p.read_text(encoding="utf-8"))
    )
    assert marked, "no long or bigworld case found: the search is broken"
    missing = [f for f in marked if f not in fuzz and f not in ELSEWHERE]
    assert not missing, f"long / bigworld cases that `make fuzz` never runs: {missing}"


def test_make_test_leaves_out_exactly_long_and_bigworld():
    assert '-m "not bigworld and not long"' in _recipe("test")
