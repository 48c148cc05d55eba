"""``shardgen`` commands run as a user runs them, for the end-to-end tests (test_cli*.py).

Every command runs in its own session (``start_new_session``) under a hard timeout; on
timeout the test kills that process group (by its pgid, nothing else) and fails with the
command's output.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from ports import lost_port_race

from shardgen import toy

_SCRIPT = shutil.which("shardgen", path=os.path.dirname(sys.executable))
SHARDGEN = [_SCRIPT] if _SCRIPT else [sys.executable, "-m", "shardgen"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


class Job:
    """One ``shardgen`` command in its own process group, output to files."""

    def __init__(
        self, args: list[str], cwd: Path, name: str = "job", command: list[str] = SHARDGEN,
        env: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        self.args = args
        self.stdout_path, self.stderr_path = cwd / f"{name}.stdout", cwd / f"{name}.stderr"
        with open(self.stdout_path, "w") as out, open(self.stderr_path, "w") as err:
            self.proc = subprocess.Popen(
                command + args, cwd=cwd, env=ENV if env is None else env, stdout=out, stderr=err,
                start_new_session=True,
            )  # fmt: skip
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
    """Run ``shardgen args`` to its end. A job whose rank 0 lost the race for its store's port
    (torch's launcher picks a free port, then rank 0 binds it seconds later, after its imports:
    on a machine busy with the suite's connections another process may take it first) fails at
    start-up, before any journal: it runs again, up to three times in all."""
    for _ in range(3):
        job = Job(args, cwd)
        rc = job.wait(timeout)
        if rc == 0 or not lost_port_race(job.stderr) or "TCPStore" not in job.stderr:
            break
    if expect is not None:
        assert rc == expect, f"exit code {rc}, expected {expect}\n{job.output()}"
    return job


def read_results(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def comparable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "rank"} for r in rows]


def assert_results_agree(got: list[dict], ref: list[dict], what: str = "results") -> None:
    """A job's results against the reference run's (``write_toy_prompts``): the same ids in input
    order, errors equal, answers under the numeric promise (tests/helpers/numerics.py), since the rest of
    a resumed job, or another launch, is batched anew: tokens equal but at near-ties, logprobs
    within the tolerance; a row that agrees has every other field equal too."""
    from numerics import Row, assert_rows_agree
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardgen.config import SamplingParams

    got, ref = comparable(got), comparable(ref)
    assert [r["id"] for r in got] == [r["id"] for r in ref], what
    answered = [i for i, r in enumerate(ref) if "error" not in r]
    for a, b in zip(got, ref, strict=True):
        assert ("error" in a) == ("error" in b) and ("error" not in b or a == b), (what, a, b)
    tok = AutoTokenizer.from_pretrained(toy.toy_model_path())
    model = AutoModelForCausalLM.from_pretrained(toy.toy_model_path()).eval()

    def row(r: dict) -> Row:
        return Row(list(tok(r["prompt"])["input_ids"]), r["token_ids"], r.get("logprobs"), r.get("seed"))

    sampled = SamplingParams(do_sample=True, temperature=0.8)  # write_toy_prompts' sampled lines
    mine, theirs = [row(got[i]) for i in answered], [row(ref[i]) for i in answered]
    found = assert_rows_agree(mine, theirs, model=model, params=sampled, what=what)
    diverged = {answered[j] for j, _, _ in found.diverged}
    for i in answered:
        if i not in diverged:
            a, b = ({k: v for k, v in r[i].items() if k != "logprobs"} for r in (got, ref))
            assert a == b, (what, a, b)


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


# ------------------------------------------------ the reference job (test_cli.py, test_cli_launcher.py)

SAMPLED = {"toy-1-00004", "toy-1-00011", "toy-1-00030"}


def write_toy_prompts(d: Path) -> Path:
    """``d/prompts.jsonl``: 64 skewed toy prompts (three sampled at temperature 0.8), an empty one
    and one too long for the model's context; returns ``d``."""
    lines = []
    for p in toy.make_prompts(64, seed=1, skew=True):
        lines.append({**p, "temperature": 0.8} if p["id"] in SAMPLED else p)
    lines.insert(10, {"id": "empty", "prompt": ""})
    lines.insert(20, {"id": "too-long", "prompt": "count " * 120})
    (d / "prompts.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return d


REFERENCE = ["run", "--prompts", "prompts.jsonl", "--out", "ref.jsonl", "--nproc", "2", "--quiet"]


def run_reference(d: Path) -> Job:
    """An uninterrupted 2-rank run of ``d/prompts.jsonl`` into ``d/ref.jsonl``; its results are
    kept for :func:`reference_results` in the other test files of this pytest run."""
    with _shared_reference(d) as kept:
        job = run([*REFERENCE, "--json-summary", "ref-summary.json"], d)
        shutil.copy(d / "ref.jsonl", kept)
    return job


def reference_results(d: Path) -> list[dict]:
    """The reference run's results for ``d/prompts.jsonl``: those another test file of this pytest
    run (another xdist worker) kept, waiting for it when it is running, else run here. The run
    is a 2-rank job: about 20 s of the suite's CPU each time it is not run again."""
    with _shared_reference(d) as kept:
        if not kept.exists():
            run(REFERENCE, d)
            shutil.copy(d / "ref.jsonl", kept)
        return read_results(kept)


@contextlib.contextmanager
def _shared_reference(d: Path) -> Iterator[Path]:
    """The kept results' path for ``d/prompts.jsonl``, under an exclusive lock: in the root of this
    pytest run's temporary folders (xdist's workers each have one below it), keyed by the file."""
    root = d.parent.parent if d.parent.name.startswith("popen-gw") else d.parent
    digest = hashlib.sha1((d / "prompts.jsonl").read_bytes()).hexdigest()[:16]
    with open(root / f"shardgen-reference-{digest}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield root / f"shardgen-reference-{digest}.jsonl"


def wait_for_journals(job: Job, out: Path, lines: int, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while journal_lines(out) < lines:
        if job.proc.poll() is not None or time.monotonic() > deadline:
            job.kill() if job.proc.poll() is None else None
            pytest.fail(f"no {lines} journaled results (rc {job.proc.returncode})\n{job.output()}")
        time.sleep(0.02)
