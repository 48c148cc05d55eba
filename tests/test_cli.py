"""End to end: ``shardgen run`` / ``shardgen demo`` as a user runs them, on the shipped toy model.

Every command runs in its own session (``start_new_session``) under a hard timeout; on
timeout the test kills that process group (by its pgid, nothing else) and fails with the
command's output. Ranks spawned by torch's launcher live in sessions of their own; they
die with their parent (``PR_SET_PDEATHSIG``), which the kill tests check.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardgen import toy

pytestmark = [pytest.mark.slow, pytest.mark.multirank]

_SCRIPT = shutil.which("shardgen", path=os.path.dirname(sys.executable))
SHARDGEN = [_SCRIPT] if _SCRIPT else [sys.executable, "-m", "shardgen"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


class Job:
    """One ``shardgen`` command in its own process group, output to files."""

    def __init__(self, args: list[str], cwd: Path, name: str = "job", command: list[str] = SHARDGEN) -> None:
        self.args = args
        self.stdout_path, self.stderr_path = cwd / f"{name}.stdout", cwd / f"{name}.stderr"
        with open(self.stdout_path, "w") as out, open(self.stderr_path, "w") as err:
            self.proc = subprocess.Popen(
                command + args, cwd=cwd, env=ENV, stdout=out, stderr=err, start_new_session=True
            )
        self.pgid = os.getpgid(self.proc.pid)

    @property
    def stdout(self) -> str:
        return self.stdout_path.read_text()

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def output(self) -> str:
        return (
            f"$ shardgen {' '.join(self.args)}\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr[-6000:]}"
        )

    def kill(self) -> None:
        os.killpg(self.pgid, signal.SIGKILL)
        self.proc.wait()

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"timed out after {timeout:g}s (process group killed)\n{self.output()}")


def run(args: list[str], cwd: Path, timeout: float = 300, expect: int | None = 0) -> Job:
    job = Job(args, cwd)
    rc = job.wait(timeout)
    if expect is not None:
        assert rc == expect, f"exit code {rc}, expected {expect}\n{job.output()}"
    return job


def read_results(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def comparable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "rank"} for r in rows]


def journal_lines(out: Path) -> int:
    return sum(p.read_text().count('"id"') for p in out.parent.glob(out.name + ".rank*.journal.jsonl"))


def processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line contains ``text`` (a unique tmp path: our own ranks)."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if text in (d / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(d.name))
            except OSError:
                pass
    return found


def assert_no_orphans(out: Path, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while (left := processes_mentioning(str(out))) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"ranks outlived their job: {left}"


def wait_for_journals(job: Job, out: Path, lines: int, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while journal_lines(out) < lines:
        if job.proc.poll() is not None or time.monotonic() > deadline:
            job.kill() if job.proc.poll() is None else None
            pytest.fail(f"no {lines} journaled results (rc {job.proc.returncode})\n{job.output()}")
        time.sleep(0.02)


# ---------------------------------------------------------------- a small 2-rank job, the reference run

SAMPLED = {"toy-1-00004", "toy-1-00011", "toy-1-00030"}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("cli")
    lines = []
    for p in toy.make_prompts(64, seed=1, skew=True):
        lines.append({**p, "temperature": 0.8} if p["id"] in SAMPLED else p)
    lines.insert(10, {"id": "empty", "prompt": ""})
    lines.insert(20, {"id": "too-long", "prompt": "count " * 120})
    (d / "prompts.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return d


@pytest.fixture(scope="module")
def reference_job(workdir: Path) -> Job:
    """An uninterrupted 2-rank run of prompts.jsonl."""
    return run(["run", "--prompts", "prompts.jsonl", "--out", "ref.jsonl", "--nproc", "2", "--json-summary",
                "ref-summary.json", "--quiet"], workdir)  # fmt: skip


@pytest.fixture(scope="module")
def reference(reference_job: Job, workdir: Path) -> list[dict]:
    return read_results(workdir / "ref.jsonl")


def only_progress_bar(stderr: str, desc: str = "shardgen run") -> bool:
    """True when stderr holds nothing but tqdm's redraws of the progress bar ``desc``."""
    return all(not x.strip() or x.startswith(f"{desc}:") for x in re.split(r"[\r\n]", stderr))


def assert_summary_only(job: Job) -> None:
    """What a job prints: the progress bar (stderr) and the summary table (stdout), nothing else:
    no log lines, no third-party warnings, no per-rank output."""
    assert only_progress_bar(job.stderr), job.output()
    assert job.stdout.startswith("prompts ") and "results " in job.stdout, job.output()
    for noise in ("[shardgen rank", "Warning", "built successfully", "Loading weights"):
        assert noise not in job.stdout + job.stderr, (noise, job.output())


def test_quiet_prints_nothing(reference_job: Job) -> None:
    assert reference_job.stdout == "" and reference_job.stderr == "", reference_job.output()


def test_two_rank_job_answers_the_toy_task(workdir: Path, reference: list[dict]) -> None:
    prompts = [json.loads(x) for x in (workdir / "prompts.jsonl").read_text().splitlines()]
    assert [r["id"] for r in reference] == [p["id"] for p in prompts]  # each once, input order
    by_id = {r["id"]: r for r in reference}
    assert by_id["empty"]["error"].startswith("ValueError: empty prompt")
    assert "context of 128 tokens" in by_id["too-long"]["error"]
    for p in prompts:
        r = by_id[p["id"]]
        if p["id"] in SAMPLED:
            assert "seed" in r and r["finish_reason"] in ("eos", "length")
        elif "error" not in r:
            assert toy.check_answer(p["prompt"], r["text"]), (p, r)
    summary = json.loads((workdir / "ref-summary.json").read_text())
    assert summary["prompts"] == len(prompts) and summary["completed"] == len(prompts)
    assert summary["errors"] == 2 and summary["world_size"] == 2
    assert {r["rank"] for r in reference if "error" not in r} == {0, 1}  # both ranks served
    assert not list(workdir.glob("ref.jsonl.*"))  # journals merged away, no temp file left


def test_sigkill_mid_run_then_resume(workdir: Path, reference: list[dict]) -> None:
    out = workdir / "killed.jsonl"
    args = ["run", "--prompts", "prompts.jsonl", "--out", str(out), "--nproc", "2", "--quiet"]
    job = Job([*args, "--batch-size", "1"], workdir, name="killed")
    wait_for_journals(job, out, 8)
    job.kill()  # SIGKILL to the launcher's process group; the ranks die with their parents
    assert_no_orphans(out)
    assert not out.exists(), "the job finished before it was killed: give it more prompts"
    assert journal_lines(out) < len(reference)

    again = run([*args, "--resume", "--json-summary", "resumed.json"], workdir)
    assert comparable(read_results(out)) == comparable(reference), again.output()
    summary = json.loads((workdir / "resumed.json").read_text())
    assert summary["resumed"] >= 8 and summary["resumed"] + summary["completed"] == len(reference)


def test_rank_killed_then_elastic_restart_resumes(workdir: Path, reference: list[dict]) -> None:
    out = workdir / "restarted.jsonl"
    args = ["run", "--prompts", "prompts.jsonl", "--out", str(out), "--nproc", "2", "--max-restarts", "1"]
    job = Job([*args, "--batch-size", "1", "--quiet", "--json-summary", "restarted.json"], workdir, "restart")
    wait_for_journals(job, out, 8)
    ranks = [pid for pid in processes_mentioning(str(out)) if b"RANK=1\0" in _environ(pid)]
    assert ranks, f"no rank 1 found\n{job.output()}"
    os.kill(ranks[0], signal.SIGKILL)  # one rank dies; torch's agent restarts the group
    assert job.wait(150) == 0, job.output()
    assert comparable(read_results(out)) == comparable(reference)
    assert json.loads((workdir / "restarted.json").read_text())["resumed"] >= 8
    assert_no_orphans(out)


def test_replicas_claim_from_one_prompts_file(workdir: Path, reference: list[dict]) -> None:
    """``--nproc 4 --shard-size 2``: two replicas sharded 2 ways, one prompts file, the same results."""
    args = ["run", "--prompts", "prompts.jsonl", "--out", "replicas.jsonl", "--nproc", "4"]
    args += ["--shard-size", "2"]
    job = run([*args, "--json-summary", "replicas.json"], workdir, timeout=240)
    assert comparable(read_results(workdir / "replicas.jsonl")) == comparable(reference), job.output()
    summary = json.loads((workdir / "replicas.json").read_text())
    reps = summary["replicas"]
    assert [r["ranks"] for r in reps] == [[0, 1], [2, 3]] and summary["shard_size"] == 2
    # which replica serves how many depends on timing (a replica that loads late may find none left)
    assert sum(r["prompts"] for r in reps) == len(reference)
    assert "prompts per replica" in job.stdout and "2 x 2 ranks" in job.stdout, job.output()
    assert_summary_only(job)


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")
def test_deepspeed_job_prints_the_bar_and_the_summary_only(workdir: Path) -> None:
    """DeepSpeed's gathers call torch's deprecated all_gather_into_tensor, and its comm layer
    prints a line per rank as shardgen starts it: neither shows."""
    lines = (workdir / "prompts.jsonl").read_text().splitlines()[:8]
    (workdir / "small.jsonl").write_text("".join(x + "\n" for x in lines))
    args = ["run", "--prompts", "small.jsonl", "--out", "ds.jsonl", "--nproc", "2", "--backend", "deepspeed"]
    job = run(args, workdir, timeout=240)
    assert len(read_results(workdir / "ds.jsonl")) == 8
    assert_summary_only(job)


def test_python_m_shardgen_under_torchrun(workdir: Path, reference: list[dict]) -> None:
    """``torchrun ... -m shardgen run`` (the package's __main__) is the shardgen command."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    args = ["-m", "shardgen", "run", "--prompts", "prompts.jsonl", "--out", "torchrun.jsonl", "--quiet"]
    job = Job([*args, "--timeline", "timeline.png"], workdir, "torchrun", command=torchrun)
    assert job.wait(120) == 0, job.output()
    assert comparable(read_results(workdir / "torchrun.jsonl")) == comparable(reference)
    png = (workdir / "timeline.png").read_bytes()  # --timeline: one row per rank
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    helped = subprocess.run(
        [sys.executable, "-m", "shardgen", "run", "--help"], env=ENV, capture_output=True, text=True
    )
    assert helped.returncode == 0 and "--max-batch-size" in helped.stdout and "exit codes:" in helped.stdout


def _environ(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return b""


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
    "bad-flag-value": (GOOD, ["--batch-size", "0"], 2, ["--batch-size must be >= 1"]),
    "unwritable-summary": (GOOD, ["--json-summary", "no/such/dir/s.json"], 2, ["not a writable folder"]),
    # validated in the launcher, before torch's launcher starts any rank
    "launcher-validates": (GOOD + '{"id": 2}\n', ["--nproc", "2"], 4, ["p.jsonl:2:", "missing 'prompt'"]),
    "stale-journals": (GOOD, ["--nproc", "2"], 2, ["pass --resume"]),
    "shard-size": (GOOD, ["--nproc", "4", "--shard-size", "3"], 2, ["--shard-size 3 must divide the world"]),
}


@pytest.fixture(scope="module")
def bad_runs(tmp_path_factory) -> dict[str, tuple[Job, Path, int]]:
    """Start every bad-input case at once (each costs a Python + torch start), then wait for all."""
    jobs = {}
    for name, (text, extra, _, _) in BAD_CASES.items():
        d = tmp_path_factory.mktemp(name)
        if text is not None:
            (d / "p.jsonl").write_text(text)
        if name == "stale-journals":
            (d / "o.jsonl.rank1.journal.jsonl").write_text('{"id": 1, "text": "x"}\n')
        jobs[name] = (Job(["run", "--prompts", "p.jsonl", "--out", "o.jsonl", *extra], d), d)
    return {name: (job, d, job.wait(300)) for name, (job, d) in jobs.items()}


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_input(bad_runs, case: str) -> None:
    job, d, rc = bad_runs[case]
    _, _, code, words = BAD_CASES[case]
    assert rc == code, job.output()
    lines = [x for x in job.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("shardgen run: error: "), job.output()
    for w in words:
        assert w in lines[0], job.output()
    assert not (d / "o.jsonl").exists() and not list(d.glob("*.tmp"))
    if case != "stale-journals":
        assert not list(d.glob("*.journal.jsonl"))


# ---------------------------------------------------------------- the demo


def test_demo_checks_its_answers_and_does_not_hang(tmp_path: Path) -> None:
    job = run(["demo", "--keep", str(tmp_path / "demo")], tmp_path, timeout=300)
    assert "answers correct" in job.stdout and "rank 3 served 0 prompts" in job.stdout, job.output()
    # the bar, the demo's own lines and the job's summary, nothing else (no warnings, no logs)
    assert only_progress_bar(job.stderr), job.output()
    for line in job.stdout.splitlines():
        assert line.startswith(("shardgen demo: ", "  ")) or line.split() == [] or line.split()[0] in (
            "prompts", "generated", "wall", "tokens/s", "ticks", "shadow-forward", "busy", "ranks",
            "results", "rank", "0", "1", "2", "3",
        ), (line, job.output())  # fmt: skip
    assert "[shardgen rank" not in job.stdout + job.stderr and "Warning" not in job.stderr, job.output()
    summary = json.loads((tmp_path / "demo" / "summary.json").read_text())
    assert summary["ranks"][3]["prompts"] == 0 and summary["ranks"][3]["shadow_forwards"] > 0


def test_demo_quiet_prints_nothing(tmp_path: Path) -> None:
    job = run(["demo", "--quiet", "--nproc", "2", "--prompts", "16", "--away-s", "0"], tmp_path, timeout=300)
    assert job.stdout == "" and job.stderr == "", job.output()
