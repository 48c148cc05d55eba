"""``shardgen bench`` at a tiny size (2 ranks, few prompts, five methods: the test keeps
its name of four, which docs/RELIABILITY.md cites), and its pure parts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from example_runs import RUN_TIMEOUT_S, run_forked

from shardgen.bench import command as bench
from shardgen.core import timeline


def test_timeline_merges_runs_of_one_kind_and_totals():
    tl = timeline.Timeline(enabled=True)
    tl.add(0.0, 1.0, "idle")
    tl.add(1.0, 2.0, "idle")  # continues the idle span
    tl.add(2.0, 2.5, "decode")
    tl.add(3.0, 3.5, "decode")  # a gap: a new span
    assert tl.spans == [(0.0, 2.0, "idle"), (2.0, 2.5, "decode"), (3.0, 3.5, "decode")]
    assert timeline.totals(tl.spans) == {"idle": 2.0, "decode": 1.0}
    off = timeline.Timeline()
    off.add(0.0, 1.0, "idle")
    assert off.spans == []


def _outcome(method, rank, wall, error=None, useful=100, fwd=10, wasted=0):
    return {"method": method, "rank": rank, "wall_s": wall, "forwards": fwd, "wasted_forwards": wasted,
            "useful_tokens": useful, "peak_param_bytes": 2**20, "wrong": 0, "error": error,
            "spans": [[0.0, wall, "decode"]]}  # fmt: skip


def test_summary_takes_the_slowest_rank_and_divides_by_the_floor():
    raw = {
        "world": 2,
        "methods": ["hf_synced", "local", "sg_ds"],
        "ranks": [
            [_outcome("hf_synced", 0, 3, wasted=4), _outcome("local", 0, 1.0), _outcome("sg_ds", 0, 0, "x")],
            [_outcome("hf_synced", 1, 4, wasted=2), _outcome("local", 1, 0.5), _outcome("sg_ds", 1, 0)],
        ],
    }
    s = bench.summarize(raw)["methods"]
    assert s["hf_synced"]["wall_s"] == 4.0 and s["hf_synced"]["useful_tok_s"] == 50.0
    assert s["hf_synced"]["wasted_forwards"] == 6 and s["hf_synced"]["x_floor"] == 4.0
    assert s["local"]["x_floor"] == 1.0 and s["sg_ds"] == {"error": "x"}
    table = bench.format_table({"worlds": {"2": {"methods": s}}})
    assert "n/a: x" in table and "4.00" in table
    # A name wider than the column's default keeps every row's columns under the header's.
    s["sg_fsdp2_stationary"] = dict(s["local"])
    lines = bench.format_table({"worlds": {"2": {"methods": s}}}).splitlines()
    head = next(x for x in lines if x.startswith("method"))
    rows = [x for x in lines if x.startswith(("local", "sg_fsdp2_stationary"))]
    assert len(rows) == 2 and all(len(x) == len(head) for x in rows), "\n".join(lines)


@pytest.mark.slow
@pytest.mark.multirank
def test_bench_two_ranks_four_methods(tmp_path: Path):
    pytest.importorskip("matplotlib")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    methods = ["hf_synced", "sg_fsdp2", "sg_fsdp2_stationary", "sg_fsdp2_spec", "local"]
    cmd = [sys.executable, "-m", "shardgen", "bench", "--world-sizes", "2", "--prompts-per-rank", "4",
           "--batch-size", "2", "--methods", *methods,
           "--json", "b.json", "--timeline", "b.png", "--quiet"]  # fmt: skip
    # the bound of every launched run here: 120 s was too short beside two busy processes
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-4000:]
    res = json.loads((tmp_path / "b.json").read_text())["worlds"]["2"]["methods"]
    assert list(res) == methods
    for name, r in res.items():
        assert r["wrong_answers"] == 0 and r["useful_tok_s"] > 0 and r["forwards"] > 0, (name, r)
        assert set(r["spans"]) == {"0", "1"}
        kinds = {k for spans in r["spans"].values() for _, _, k in spans}
        assert "decode" in kinds, (name, kinds)
        assert all(0 <= t0 <= t1 <= r["wall_s"] + 1e-6 for s in r["spans"].values() for t0, t1, _ in s)
    assert res["local"]["x_floor"] == 1.0 and res["local"]["wasted_forwards"] == 0
    # 4 prompts a rank in batches of 2: the HF calls run to each batch's longest answer
    assert res["hf_synced"]["forwards"] >= res["sg_fsdp2"]["forwards"] - res["sg_fsdp2"]["wasted_forwards"]
    assert res["hf_synced"]["peak_param_mib"] < res["local"]["peak_param_mib"]  # sharded: less per rank
    # speculation: the same answers (checked above), never more forwards (timings decide how many fewer)
    assert res["sg_fsdp2_spec"]["forwards"] <= res["sg_fsdp2"]["forwards"], (
        res["sg_fsdp2_spec"],
        res["sg_fsdp2"],
    )
    assert "sg_fsdp2" in done.stdout and "x floor" in done.stdout
    # --quiet: the table, not the progress lines of the launcher ("N ranks, methods") or rank 0
    assert "shardgen bench:" not in done.stderr, done.stderr[-4000:]
    png = (tmp_path / "b-w2.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_gpu_check_script_runs_its_steps_on_the_cpu(tmp_path):
    """``make gpu``'s script, ``--smoke`` (CPU, tiny models): every gather mode of both backends
    equal to HF, the prefix cache, the decode figures, as JSON. One rank, started as
    ``torchrun --nproc-per-node=1`` starts it (forked: tests/helpers/example_runs.py)."""
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "gpu.json"
    script = root / "benchmarks" / "gpu_check.py"
    rc, output, _ = run_forked(script, "--smoke", "--rounds", "1", "--json", str(out), nproc=1)
    assert rc == 0, output
    res = json.loads(out.read_text())
    assert res["ok"] and len(res["modes"]) == 8, res
    assert all(m["control_plane"] == "gloo" and m["equal_hf"] for m in res["modes"]), res["modes"]
    assert res["prefix_cache"]["cached_tokens"] > 0 and res["decode"]["tok_s"]["shardgen"] > 0
