"""End to end, the launcher's side: bad input refused before any rank starts (message, exit code,
nothing written), what a DeepSpeed job prints, and ``shardgen demo``. A file of its own so that
the suite's workers share the end-to-end jobs (``make test`` runs one file per worker at a time).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from cli_jobs import Job, assert_summary_only, only_progress_bar, read_results, run, write_toy_prompts

pytestmark = [pytest.mark.slow, pytest.mark.multirank]


# ------------------------------------------------ bad input: message, exit code, nothing written

GOOD = '{"id": 1, "prompt": "count from 1 to 3 :"}\n'
BAD_CASES = {
    # name: (prompts file text or None for a missing file, extra args, exit code, words in the message)
    "missing-file": (None, [], 3, ["not found"]),
    "empty-file": ("\n", [], 3, ["empty"]),
    "malformed-json": (GOOD + '{"id": 2, "prompt": "x",}\n', [], 4, ["p.jsonl:2:", "malformed JSON"]),
    "missing-prompt": (GOOD + '{"id": 2}\n', [], 4, ["p.jsonl:2:", "missing 'prompt'"]),
    "non-string-prompt": (GOOD + '{"id": 2, "prompt": ["x"]}\n', [], 4, ["p.jsonl:2:", "must be a string"]),
    "duplicate-ids": (GOOD + GOOD, [], 4, ["p.jsonl:2:", "duplicate id 1"]),
    "unknown-fields": (GOOD + '{"id": 2, "prompt": "x", "tempo": 1}\n', [], 4, ["p.jsonl:2:", "'tempo'"]),
    "bad-model": (GOOD, ["--model", "no/such/model/dir"], 5, ["model path no/such/model/dir does not exist"]),
    "bad-flag-value": (GOOD, ["--batch-size", "0"], 2, ["--batch-size must be an integer >= 1"]),
    "unwritable-summary": (GOOD, ["--json-summary", "no/such/dir/s.json"], 2, ["not a writable folder"]),
    # validated in the launcher, before torch's launcher starts any rank
    "launcher-validates": (GOOD + '{"id": 2}\n', ["--nproc", "2"], 4, ["p.jsonl:2:", "missing 'prompt'"]),
    "stale-journals": (GOOD, ["--nproc", "2"], 2, ["pass --resume"]),
    "shard-size": (GOOD, ["--nproc", "4", "--shard-size", "3"], 2, ["--shard-size 3 must divide the world"]),
}


# One launch per exit code (and both of 2's paths: a flag's value, the launcher's journal check)
# as a user runs it; every case, these too, through ``main`` in this process (test_bad_input).
LAUNCHED = ("missing-file", "launcher-validates", "bad-model", "bad-flag-value", "stale-journals")


def case_dir(d: Path, name: str) -> Path:
    text = BAD_CASES[name][0]
    if text is not None:
        (d / "p.jsonl").write_text(text)
    if name == "stale-journals":
        (d / "o.jsonl.rank1.journal.jsonl").write_text('{"id": 1, "text": "x"}\n')
    return d


def assert_refused(case: str, rc: int, stderr: str, d: Path, shown: str) -> None:
    """Exit code, one line naming the problem, nothing written."""
    _, _, code, words = BAD_CASES[case]
    assert rc == code, shown
    lines = [x for x in stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("shardgen run: error: "), shown
    for w in words:
        assert w in lines[0], shown
    assert not (d / "o.jsonl").exists() and not list(d.glob("*.tmp"))
    if case != "stale-journals":
        assert not list(d.glob("*.journal.jsonl"))


def _no_rank(*_, **__) -> None:
    raise AssertionError("bad input reached a rank or the launch of ranks")


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_input(case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """The command's ``main`` in this process, as the console script calls it: refused before
    ``run_rank`` or ``launch_job`` (either fails the test), the same message and exit code."""
    from shardgen.cli import command
    from shardgen.cli import run as cli_run

    monkeypatch.chdir(case_dir(tmp_path, case))
    for name in ("RANK", "TORCHELASTIC_RESTART_COUNT"):  # a user's shell, not a rank
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(cli_run, "launch_job", _no_rank)
    monkeypatch.setattr(cli_run, "run_rank", _no_rank)
    rc = command.main(["run", "--prompts", "p.jsonl", "--out", "o.jsonl", *BAD_CASES[case][1]])
    err = capsys.readouterr().err
    assert_refused(case, rc, err, tmp_path, err)


@pytest.fixture(scope="module")
def bad_runs(tmp_path_factory) -> dict[str, tuple[Job, Path, int]]:
    """Start every launched case at once (each costs a Python + torch start), then wait for all."""
    jobs = {}
    for name in LAUNCHED:
        d = case_dir(tmp_path_factory.mktemp(name), name)
        jobs[name] = (Job(["run", "--prompts", "p.jsonl", "--out", "o.jsonl", *BAD_CASES[name][1]], d), d)
    return {name: (job, d, job.wait(300)) for name, (job, d) in jobs.items()}


@pytest.mark.parametrize("case", LAUNCHED)
def test_bad_input_launched(bad_runs, case: str) -> None:
    """The shardgen command itself: its exit status, and nothing else on stderr (no import warnings)."""
    job, d, rc = bad_runs[case]
    assert_refused(case, rc, job.stderr, d, job.output())


# ---------------------------------------------------------------- the DeepSpeed job's output


# In `make fuzz`, not `make test`: a DeepSpeed launch of `shardgen run` (about 15 CPU-s).
@pytest.mark.long
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")
def test_deepspeed_job_prints_the_bar_and_the_summary_only(tmp_path: Path) -> None:
    """DeepSpeed's gathers call torch's deprecated all_gather_into_tensor, and its comm layer
    prints a line per rank as shardgen starts it: neither shows."""
    lines = (write_toy_prompts(tmp_path) / "prompts.jsonl").read_text().splitlines()[:8]
    (tmp_path / "small.jsonl").write_text("".join(x + "\n" for x in lines))
    args = ["run", "--prompts", "small.jsonl", "--out", "ds.jsonl", "--nproc", "2", "--backend", "deepspeed"]
    job = run(args, tmp_path, timeout=240)
    assert len(read_results(tmp_path / "ds.jsonl")) == 8
    assert_summary_only(job)


# ---------------------------------------------------------------- the demo


def test_demo_defaults() -> None:
    """``shardgen demo`` (``make demo``) with no flags: the 4 ranks and 256 prompts of docs/USAGE.md;
    the end-to-end run below differs only in its prompt count."""
    from shardgen.cli.command import make_parser
    from shardgen.cli.demo import DemoConfig
    from shardgen.flags import build

    cfg = build(DemoConfig, make_parser().parse_args(["demo"]))
    assert cfg == DemoConfig() and (cfg.nproc, cfg.prompts, cfg.away_s, cfg.timeout) == (4, 256, 3.0, 120.0)


def test_demo_checks_its_answers_and_does_not_hang(tmp_path: Path) -> None:
    """The demo on 3 ranks and 64 prompts: the skew, the idle last rank (2) and rank 1 stepping away
    are those of the default 4 ranks and 256 prompts (the time is mostly the start of the ranks,
    about 5 s of CPU each on 2 cores; the 4-rank default runs in ``make fuzz``)."""
    args = ["demo", "--nproc", "3", "--prompts", "64", "--keep", str(tmp_path / "demo")]
    job = run(args, tmp_path, timeout=300)
    _check_demo(job, tmp_path / "demo", idle=2)


def _check_demo(job: Job, keep: Path, idle: int) -> None:
    assert "answers correct" in job.stdout and f"rank {idle} served 0 prompts" in job.stdout, job.output()
    assert f"rank {idle} claims none, rank 1 steps away" in job.stdout, job.output()
    # the bar, the demo's own lines and the job's summary, nothing else (no warnings, no logs)
    assert only_progress_bar(job.stderr), job.output()
    for line in job.stdout.splitlines():
        assert line.startswith(("shardgen demo: ", "  ")) or line.split() == [] or line.split()[0] in (
            "prompts", "generated", "wall", "tokens/s", "ticks", "shadow-forward", "busy", "ranks",
            "results", "rank", "0", "1", "2", "3",
        ), (line, job.output())  # fmt: skip
    assert "[shardgen rank" not in job.stdout + job.stderr and "Warning" not in job.stderr, job.output()
    summary = json.loads((keep / "summary.json").read_text())
    assert len(summary["ranks"]) == idle + 1, summary
    assert summary["ranks"][idle]["prompts"] == 0 and summary["ranks"][idle]["shadow_forwards"] > 0


# In `make fuzz`, not `make test`: the default 4 ranks (3 above).
@pytest.mark.long
def test_demo_at_its_default_4_ranks(tmp_path: Path) -> None:
    job = run(["demo", "--prompts", "64", "--keep", str(tmp_path / "demo")], tmp_path, timeout=300)
    _check_demo(job, tmp_path / "demo", idle=3)


# In `make fuzz`, not `make test`: a second 4-rank demo; --quiet is checked on a job in
# tests/multirank/test_cli.py.
@pytest.mark.long
def test_demo_quiet_prints_nothing(tmp_path: Path) -> None:
    job = run(["demo", "--quiet", "--nproc", "2", "--prompts", "16", "--away-s", "0"], tmp_path, timeout=300)
    assert job.stdout == "" and job.stderr == "", job.output()
