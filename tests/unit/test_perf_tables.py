"""scripts/perf_tables.py against docs/PERFORMANCE.md and benchmarks/headline.sh: the doc's tables
are the script's, and the headline's commands are the ones headline.sh runs."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("perf_tables", ROOT / "scripts" / "perf_tables.py")
assert spec is not None and spec.loader is not None
perf_tables = importlib.util.module_from_spec(spec)
sys.modules["perf_tables"] = perf_tables  # dataclasses look their module up there
spec.loader.exec_module(perf_tables)

MARK = re.compile(r"<!-- perf_tables: ([^>]*?) -->")


def test_every_marked_block_names_a_table_and_a_headline_file():
    doc = (ROOT / "docs" / "PERFORMANCE.md").read_text(encoding="utf-8")
    marks = [m.split() for m in MARK.findall(doc)]
    assert ["headline"] in marks
    files = {c.file for c in perf_tables.HEADLINE}
    for m in marks:
        if m != ["headline"]:
            assert m[0] in perf_tables.TABLES, m
            assert m[1].removesuffix(".json") in files, m  # headline.sh writes it
    assert doc.count("<!-- /perf_tables -->") == len(marks)


def test_headline_commands_are_the_ones_headline_sh_runs():
    script = (ROOT / "benchmarks" / "headline.sh").read_text(encoding="utf-8").replace("\\\n", " ")
    steps = {m.group(1): m.group(2) for m in re.finditer(r"^step (\w+)\s+\$PY (.*)$", script, re.M)}
    for c in perf_tables.HEADLINE:
        assert c.file in steps, c.file
        run = steps[c.file].replace("-m shardgen ", "shardgen ")
        # every flag of the headline's command is on headline.sh's line for that step
        for word in c.command.split():
            assert word in run.split(), (c.file, word, run)


def test_fill_rewrites_marked_blocks_and_keeps_the_ones_without_json(tmp_path):
    (tmp_path / "overhead.json").write_text(
        json.dumps({"hf_synced_gpus_tok_s": 100.0, "shardgen_tok_s": 102.0, "ratio": 1.02}), encoding="utf-8"
    )
    doc = (
        "a\n<!-- perf_tables: overhead overhead.json -->\nold table\n<!-- /perf_tables -->\n"
        "b\n<!-- perf_tables: skew skew.json -->\nkept\n<!-- /perf_tables -->\n"
    )
    out = perf_tables.fill(doc, str(tmp_path))
    assert "old table" not in out and "| shardgen `Engine` | 102.0 |" in out and "**1.02**" in out
    assert "kept" in out
    assert perf_tables.fill(out, str(tmp_path)) == out  # idempotent


def test_headline_says_not_run_for_a_missing_file(tmp_path):
    table = perf_tables.headline(str(tmp_path))
    assert table.count("not run") == len(perf_tables.HEADLINE)
