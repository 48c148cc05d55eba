"""The journal under disk faults (issue: reliability beyond rank faults, item 3).

A 2-rank ``shardgen run`` meets a fault (tests/helpers/journal_fault_rank.py injects it): the out folder
fills up (ENOSPC on a write, leaving a torn line, or on an fsync), a rank's journal is deleted
mid-run, rank 0 is SIGKILLed while merging (temp file half written, or ``--out`` in place but the
journals not yet removed). The job fails with exit code 1 (journals intact) or finishes; then
``--resume`` answers every prompt exactly once, with the results of an uninterrupted run, and
``--out`` is never half-written. The first cases run in ``make test``; every case in ``make fuzz``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardgen import toy
from shardgen.jobs.journal import Journal, atomic_write_text, read_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.multirank]

HERE = Path(__file__).resolve().parents[1] / "helpers"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
ARGS = ["--prompts", "prompts.jsonl", "--batch-size", "1", "--quiet"]
# fault: (rank that meets it, results it journals first, exit codes the faulty run may end with)
FAULTS = {
    "remove": (1, 2, {1}),
    "kill-merge-replaced": (0, 0, {0, 1}),  # out is complete; the journals stay behind
    "enospc-write": (1, 2, {1}),
    "enospc-fsync": (1, 2, {1}),
    "kill-merge-tmp": (0, 0, {1}),
}
IN_MAKE_TEST = ("remove",)  # the others, SIGKILL in the merge included, in `make fuzz`


def shell(cmd: list[str], cwd: Path, env: dict, timeout: float = 180) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:  # subprocess.run killed the launcher; ranks die with it
        pytest.fail(f"{' '.join(cmd)} timed out after {timeout}s\n{e.stdout}\n{e.stderr}")


def results(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "rank"} for r in rows]


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> tuple[Path, list[dict]]:
    """The prompts, and an uninterrupted one-process run of them (tokens do not depend on rank)."""
    d = tmp_path_factory.mktemp("journal")
    prompts = toy.make_prompts(16, seed=3)
    lines = [{**p, "temperature": 0.7} if i % 5 == 0 else p for i, p in enumerate(prompts)]
    (d / "prompts.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    ref = shell([sys.executable, "-m", "shardgen", "run", *ARGS, "--out", "ref.jsonl"], d, ENV)
    assert ref.returncode == 0, ref.stderr
    return d, results(d / "ref.jsonl")


def _case(fault: str) -> object:
    marks = [] if fault in IN_MAKE_TEST else [pytest.mark.long]
    return pytest.param(fault, marks=marks)


@pytest.mark.parametrize("fault", [_case(f) for f in FAULTS])
def test_disk_fault_then_resume_answers_each_prompt_once(job, fault: str) -> None:
    d, reference = job
    out = d / f"{fault}.jsonl"
    rank, after, codes = FAULTS[fault]
    env = {**ENV, "SHARDGEN_FAULT": fault, "SHARDGEN_FAULT_RANK": str(rank)}
    env["SHARDGEN_FAULT_AFTER"] = str(after)
    hit = shell([*TORCHRUN, str(HERE / "journal_fault_rank.py"), "run", *ARGS, "--out", str(out)], d, env)
    said = f"--- faulty run (rc {hit.returncode})\n{hit.stdout[-3000:]}\n{hit.stderr[-6000:]}"
    assert hit.returncode in codes, said
    if out.exists():  # never half-written: either absent or a complete merge
        assert results(out) == reference, said
    if fault != "kill-merge-tmp":  # a SIGKILL may leave the temp file (never --out); resume replaces it
        assert not (d / f"{fault}.jsonl.tmp").exists(), said
    if fault.startswith("enospc") or fault == "remove":
        assert f"rank {rank} failed" in hit.stderr, said  # the rank that met the fault is named
    again = shell([sys.executable, "-m", "shardgen", "run", *ARGS, "--out", str(out), "--resume"], d, ENV)
    assert again.returncode == 0, f"{said}\n--- resume\n{again.stderr[-4000:]}"
    # every prompt exactly once, as uninterrupted; bit for bit: at --batch-size 1 a prompt is
    # computed alone in both runs, the same shapes (tests/helpers/numerics.py covers other batches)
    assert results(out) == reference, said
    assert not list(d.glob(f"{fault}.jsonl.*")), "journals or a temp file left behind"


# ------------------------------------------------------------------ the same faults, one process


def test_a_removed_journal_fails_its_next_append(tmp_path: Path) -> None:
    j = Journal(str(tmp_path / "j.jsonl"))
    j.append({"id": 1})
    os.remove(tmp_path / "j.jsonl")
    with pytest.raises(OSError, match="was removed while the job ran"):
        j.append({"id": 2})
    j.close()


def test_a_torn_line_is_cut_off_when_the_journal_reopens(tmp_path: Path) -> None:
    path = tmp_path / "j.jsonl"
    j = Journal(str(path))
    j.append({"id": 1})
    j.close()
    with open(path, "a") as f:
        f.write('{"id": 2, "te')  # ENOSPC half-way through a line
    j = Journal(str(path))
    j.append({"id": 3})
    j.close()
    assert [r["id"] for r in read_jsonl(str(path))] == [1, 3]


def test_a_failed_atomic_write_keeps_the_old_file_and_no_temp(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    path.write_text("old\n")

    def lines():
        yield "new 1\n"
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        atomic_write_text(str(path), lines())
    assert path.read_text() == "old\n" and not (tmp_path / "out.jsonl.tmp").exists()
