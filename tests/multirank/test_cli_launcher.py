"""End to end, the launcher's options: ``--max-restarts`` (a rank killed, torch's agent restarts the
group, the job resumes) and ``--shard-size`` (replicas claiming from one prompts file). Each job's
results are those of an uninterrupted 2-rank run of the same prompts (the reference job, as in
test_cli.py; a file of its own so that two workers share the end-to-end jobs).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from cli_jobs import (
    Job,
    assert_no_orphans,
    assert_results_agree,
    assert_summary_only,
    processes_mentioning,
    read_results,
    reference_results,
    run,
    wait_for_journals,
    write_toy_prompts,
)

pytestmark = [pytest.mark.slow, pytest.mark.multirank]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return write_toy_prompts(tmp_path_factory.mktemp("cli-launcher"))


@pytest.fixture(scope="module")
def reference(workdir: Path) -> list[dict]:
    """The results of an uninterrupted 2-rank run of prompts.jsonl (tests/multirank/test_cli.py's run's)."""
    return reference_results(workdir)


# In `make fuzz`, not `make test`: two 2-rank launches; a killed rank's one line (and, in `make
# fuzz`, its resume at 3 ranks) below.
@pytest.mark.long
def test_rank_killed_then_elastic_restart_resumes(workdir: Path, reference: list[dict]) -> None:
    out = workdir / "restarted.jsonl"
    args = ["run", "--prompts", "prompts.jsonl", "--out", str(out), "--nproc", "2", "--max-restarts", "1"]
    job = Job([*args, "--batch-size", "1", "--quiet", "--json-summary", "restarted.json"], workdir, "restart")
    wait_for_journals(job, out, 8)
    ranks = [pid for pid in processes_mentioning(str(out)) if b"RANK=1\0" in _environ(pid)]
    assert ranks, f"no rank 1 found\n{job.output()}"
    os.kill(ranks[0], signal.SIGKILL)  # one rank dies; torch's agent restarts the group
    assert job.wait(150) == 0, job.output()
    assert_results_agree(read_results(out), reference, "restarted")
    assert json.loads((workdir / "restarted.json").read_text())["resumed"] >= 8
    assert_no_orphans(out)


def _kill_rank_1(workdir: Path, name: str) -> tuple[list[str], Path]:
    """A 3-rank job whose rank 1 is killed (SIGKILL, by pid) once 6 prompts are journaled, no
    restarts: stderr names rank 1 and the signal, says the journals are intact and gives the
    exact command; no torch traceback. -> the job's arguments and its ``--out``."""
    out = workdir / f"{name}.jsonl"
    args = ["run", "--prompts", "prompts.jsonl", "--out", str(out), "--nproc", "3"]
    args += ["--batch-size", "1", "--quiet"]
    job = Job(args, workdir, name)
    wait_for_journals(job, out, 6)
    ranks = [pid for pid in processes_mentioning(str(out)) if b"RANK=1\0" in _environ(pid)]
    assert ranks, f"no rank 1 found\n{job.output()}"
    os.kill(ranks[0], signal.SIGKILL)
    assert job.wait(150) != 0, job.output()
    err = job.stderr
    want = f"rank 1 (pid {ranks[0]}) was killed by signal 9 (SIGKILL); the other ranks were stopped."
    assert want in err, job.output()
    resume = "shardgen " + " ".join(args) + " --resume"
    assert f"Results so far are in the journals, which are intact: resume with: {resume}" in err, job.output()
    assert "Traceback" not in err and "ChildFailedError" not in err, job.output()
    assert_no_orphans(out)
    return args, out


def test_a_killed_rank_is_one_line_and_its_journals_are_intact(workdir: Path, reference: list[dict]) -> None:
    """The killed job's journals hold what a resume starts from (read as ``--resume`` reads them):
    the prompts answered before the kill, each as the reference answered it. (Its resume command,
    run: below, in `make fuzz`; a resume after a signal runs in test_cli.py.)"""
    from shardgen.jobs.journal import id_key, load_results

    _, out = _kill_rank_1(workdir, "killed")
    done = load_results(str(out), include_out=False)
    assert 6 <= len(done) < len(reference), (len(done), len(reference))
    ref = [r for r in reference if id_key(r["id"]) in done]
    assert len(ref) == len(done), sorted(done)
    assert_results_agree([done[id_key(r["id"])] for r in ref], ref, "journaled before the kill")


# In `make fuzz`, not `make test`: a second 3-rank launch (the test above reads the journals it
# resumes from; test_cli.py runs a resume to the end).
@pytest.mark.long
def test_a_killed_rank_then_its_resume_command_finishes_the_job(workdir: Path, reference: list[dict]) -> None:
    args, out = _kill_rank_1(workdir, "killed-resumed")
    again = run([*args, "--resume"], workdir, timeout=240)
    assert_results_agree(read_results(out), reference, f"resumed\n{again.output()}")


# In `make fuzz`, not `make test`: a 4-rank launch (about 25 CPU-s); the per-replica summary
# is checked in tests/unit/test_jobs.py.
@pytest.mark.long
def test_replicas_claim_from_one_prompts_file(workdir: Path, reference: list[dict]) -> None:
    """``--nproc 4 --shard-size 2``: two replicas sharded 2 ways, one prompts file, the same results."""
    args = ["run", "--prompts", "prompts.jsonl", "--out", "replicas.jsonl", "--nproc", "4"]
    args += ["--shard-size", "2"]
    job = run([*args, "--json-summary", "replicas.json"], workdir, timeout=240)
    assert_results_agree(read_results(workdir / "replicas.jsonl"), reference, f"replicas\n{job.output()}")
    summary = json.loads((workdir / "replicas.json").read_text())
    reps = summary["replicas"]
    assert [r["ranks"] for r in reps] == [[0, 1], [2, 3]] and summary["shard_size"] == 2
    # which replica serves how many depends on timing (a replica that loads late may find none left)
    assert sum(r["prompts"] for r in reps) == len(reference)
    assert "prompts per replica" in job.stdout and "2 x 2 ranks" in job.stdout, job.output()
    assert_summary_only(job)


def _environ(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return b""
