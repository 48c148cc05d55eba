"""End to end: ``shardgen run`` as a user runs it, on the shipped toy model: a reference job, a job
SIGKILLed then resumed, torchrun. The launcher's --max-restarts and --shard-size are in
test_cli_launcher.py; bad input, the DeepSpeed job's output and the demo in test_cli_demo.py
(files of their own so that the suite's workers share the end-to-end jobs).

Every command runs in its own session (``start_new_session``) under a hard timeout; on
timeout the test kills that process group (by its pgid, nothing else) and fails with the
command's output. Ranks spawned by torch's launcher live in sessions of their own; they
die with their parent (``PR_SET_PDEATHSIG``), which the kill tests check.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import runpy
import signal
import sys
from pathlib import Path

import pytest
from cli_jobs import (
    SAMPLED,
    Job,
    assert_no_orphans,
    assert_results_agree,
    journal_lines,
    processes_mentioning,
    read_results,
    run,
    run_reference,
    wait_for_journals,
    write_toy_prompts,
)

from shardgen import toy

pytestmark = [pytest.mark.slow, pytest.mark.multirank]


# ---------------------------------------------------------------- a small 2-rank job, the reference run


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return write_toy_prompts(tmp_path_factory.mktemp("cli"))


@pytest.fixture(scope="module")
def reference_job(workdir: Path) -> Job:
    """An uninterrupted 2-rank run of prompts.jsonl."""
    return run_reference(workdir)


@pytest.fixture(scope="module")
def reference(reference_job: Job, workdir: Path) -> list[dict]:
    return read_results(workdir / "ref.jsonl")


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


# In `make fuzz`, not `make test` (two 2-rank launches): a killed job's resume runs at 3 ranks in
# tests/multirank/test_cli_launcher.py.
@pytest.mark.long
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
    assert_results_agree(read_results(out), reference, f"resumed\n{again.output()}")
    summary = json.loads((workdir / "resumed.json").read_text())
    assert summary["resumed"] >= 8 and summary["resumed"] + summary["completed"] == len(reference)


# ---------------------------------------------------------------- Ctrl-C and SIGTERM: one line, then --resume


def _interrupt(args: list[str], workdir: Path, name: str, out: Path, at: int, send) -> Job:
    """A 2-rank job ``shardgen ARGS``, ``send(job, out)`` once ``at`` results are journaled; returns
    the job (ended)."""
    job = Job(args, workdir, name=name)
    wait_for_journals(job, out, at)
    send(job, out)
    job.wait(90)
    assert_no_orphans(out)
    assert not out.exists(), "the job finished before it was interrupted: give it more prompts"
    return job


def _one_line(job: Job, args: list[str], out: Path, reference: list[dict], signame: str) -> int:
    """stderr is one line: the signal, how many prompts are journaled, the exact ``--resume``
    command (the job's own, ``--resume`` once); returns the number journaled."""
    lines = [x for x in job.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, job.output()
    resume = "shardgen " + " ".join([*args, *([] if "--resume" in args else ["--resume"])])
    m = re.fullmatch(
        rf"shardgen run: interrupted by {signame}: (\d+) of {len(reference)} prompts are journaled, "
        rf"the journals are intact; resume with: {re.escape(resume)}",
        lines[0],
    )
    assert m, job.output()
    journaled = int(m.group(1))
    assert journaled == journal_lines(out), job.output()
    return journaled


# Three launched jobs in a row: 110 s in a suite on a quiet machine, 225-270 s on a loaded one; each
# job's own waits are bounded, this bounds the whole.
@pytest.mark.timeout(600)
def test_ctrl_c_then_sigterm_are_one_line_each_then_resume(workdir: Path, reference: list[dict]) -> None:
    """SIGINT to the job's process group and to every rank at once (a terminal's Ctrl-C, where the
    ranks share its group): exit code 130, one line, no traceback. Its ``--resume``, stopped by
    SIGTERM to the ``shardgen run`` process alone (a scheduler's stop): exit code 143, the same
    line. The next ``--resume`` answers the rest, each prompt once, none twice. (One job
    interrupted twice: two launches fewer than a job per signal.)"""
    out = workdir / "interrupted.jsonl"
    args = [
        "run",
        "--prompts",
        "prompts.jsonl",
        "--out",
        str(out),
        "--nproc",
        "2",
        "--quiet",
        "--batch-size",
        "1",
    ]

    def ctrl_c(job: Job, out: Path) -> None:
        ranks = processes_mentioning(str(out))
        os.killpg(job.pgid, signal.SIGINT)
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGINT)

    job = _interrupt(args, workdir, "ctrl-c", out, 4, ctrl_c)
    assert job.proc.returncode == 130, job.output()
    first = _one_line(job, args, out, reference, "SIGINT")
    assert first >= 4, job.output()

    resume = [*args, "--resume"]
    term = lambda job, out: os.kill(job.proc.pid, signal.SIGTERM)  # noqa: E731
    job = _interrupt(resume, workdir, "sigterm", out, first + 4, term)
    assert job.proc.returncode == 143, job.output()
    journaled = _one_line(job, resume, out, reference, "SIGTERM")
    assert journaled >= first + 4, job.output()

    again = run([*resume, "--json-summary", "interrupted.summary.json"], workdir, timeout=240)
    assert_results_agree(read_results(out), reference, f"resumed\n{again.output()}")
    summary = json.loads((workdir / "interrupted.summary.json").read_text())
    assert (summary["resumed"], summary["completed"]) == (journaled, len(reference) - journaled)


# In `make fuzz`, not `make test`: a third interrupted launch (the job above, interrupted twice, is
# in `make test`).
@pytest.mark.long
def test_ctrl_c_under_torchrun_is_one_line_from_the_ranks(workdir: Path) -> None:
    """Under torchrun its agent gets the Ctrl-C and passes it on: the ranks say one line (rank 0,
    with the torchrun command that resumes the job); torchrun's own lines remain."""
    out = workdir / "torchrun-ctrl-c.jsonl"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    args = ["-m", "shardgen", "run", "--prompts", "prompts.jsonl", "--out", str(out), "--quiet"]
    job = Job([*args, "--batch-size", "1"], workdir, "torchrun-ctrl-c", command=torchrun)
    wait_for_journals(job, out, 4)
    os.killpg(job.pgid, signal.SIGINT)
    job.wait(90)
    assert_no_orphans(out)
    ours = [x for x in job.stderr.splitlines() if "shardgen" in x]
    resume = " ".join([*torchrun, *args, "--batch-size", "1", "--resume"])
    want = f"prompts are journaled, the journals are intact; resume with: {resume}"
    assert len(ours) == 1 and ours[0].endswith(want), job.output()
    for noise in ("KeyboardInterrupt", "terminate called", "[rank"):
        assert noise not in job.stderr, job.output()


def test_python_m_shardgen_help(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """``python -m shardgen run --help`` (the package's __main__, run here as the interpreter would)."""
    monkeypatch.setattr(sys, "argv", ["shardgen", "run", "--help"])
    with pytest.raises(SystemExit) as info:
        runpy.run_module("shardgen", run_name="__main__", alter_sys=True)
    helped = capsys.readouterr().out
    assert info.value.code == 0 and "--max-batch-size" in helped and "exit codes:" in helped, helped


def test_a_failed_rank_says_its_one_line_before_any_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    """README: errors are one line on stderr. A rank whose job fails while running prints its
    ``shardgen run: error:`` line first; a peer's failure (a ShardgenError, which names the
    rank) stops there, anything else adds its traceback after the line, for a bug report."""
    from shardgen.cli.run import say_rank_failed
    from shardgen.errors import PeerStalledError

    def raised(e: Exception) -> Exception:
        try:
            raise e
        except Exception as caught:
            return caught

    say_rank_failed(raised(PeerStalledError("rank 1 sent no heartbeat for 30.0 s")), 0)
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "shardgen run: error: rank 0 failed: PeerStalledError: rank 1 sent no heartbeat for 30.0 s "
        "(results so far are in the journals; rerun with --resume)"
    ]
    say_rank_failed(raised(RuntimeError("boom")), 1)
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("shardgen run: error: rank 1 failed: RuntimeError: boom (results"), err
    assert err[1] == "Traceback (most recent call last):" and err[-1] == "RuntimeError: boom", err
    # The job's store gone with its host (rank 0 failed first, say): one line, no traceback.
    from torch.distributed import DistNetworkError

    say_rank_failed(raised(DistNetworkError("Connection reset by peer")), 2)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1, err
    assert "rank 2 failed: DistNetworkError: Connection reset by peer: a connection" in err[0], err
