"""A two-agent torchrun job (as on two nodes) exits 0 by itself, with no C++ ``terminate``.

Each run is ~10-50 s on a 2-core machine, so two runs here; ``make fuzz`` runs ten in a
row (tests/two_agents.py). Every process also reports the Python threads still alive at
interpreter exit: none may be (a daemon thread inside a store or gloo call at
finalization is how a clean job ends in ``terminate called without an active exception``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from two_agents import run_once

from shardgen import toy

pytestmark = [pytest.mark.slow, pytest.mark.multirank]


def test_two_agent_job_exits_zero_with_no_thread_left(tmp_path: Path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in toy.make_prompts(12, seed=2)))
    for _ in range(2):
        res = run_once(tmp_path, prompts)
        out = "\n".join(t[-3000:] for t in res["outputs"])
        assert res["codes"] == [0, 0], out
        assert not res["terminate"], out
        assert res["rows"] == 12, out
        assert sum("EXIT-THREADS" in t for t in res["outputs"]) >= 4, out  # 2 agents + 2 ranks reported
        assert not res["threads_at_exit"], out
