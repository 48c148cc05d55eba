"""``examples/slurm.sbatch`` as Slurm runs it, on this machine: stand-ins for ``srun`` (runs its
command) and ``scontrol`` (one host), a job of one node and 2 ranks; then a requeue (the job
killed mid-run and started again from the top) that resumes from the journals.

The script runs ``python -m torch.distributed.run ... -m shardgen run``: this is also the test of
the package's ``__main__`` under torchrun (``--timeline`` included), its results against an
uninterrupted ``shardgen run``'s."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from cli_jobs import (
    ENV,
    Job,
    assert_no_orphans,
    assert_results_agree,
    read_results,
    reference_results,
    wait_for_journals,
    write_toy_prompts,
)

pytestmark = [pytest.mark.slow, pytest.mark.multirank]

ROOT = Path(__file__).resolve().parents[2]
STUBS = {
    "srun": '#!/bin/bash\nwhile [[ $1 == --* ]]; do shift; done\nexec "$@"\n',
    "scontrol": "#!/bin/bash\necho localhost\n",
}


def _slurm(tmp: Path) -> list[str]:
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in STUBS.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return [str(bin_dir)]


# Two launched jobs and a reference run: 46 s alone, 100 s in a suite on a quiet machine, 265-300 s
# on a loaded one (once, over 240 s before the first job journaled its sixth result: the suite's
# heaviest files start together); each job's own waits are bounded, this bounds the whole.
@pytest.mark.timeout(900)
def test_sbatch_script_runs_and_a_requeue_resumes(tmp_path):
    from ports import free_port

    write_toy_prompts(tmp_path)
    out = tmp_path / "slurm.jsonl"
    paths = _slurm(tmp_path)
    env = {**ENV, "PATH": os.pathsep.join([*paths, str(Path(sys.executable).parent), os.environ["PATH"]]),
           "SLURM_JOB_NODELIST": "node[01]", "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_ID": "4242",
           "NPROC_PER_NODE": "2", "PYTHON": sys.executable, "PORT": str(free_port())}  # fmt: skip
    script = ["bash", str(ROOT / "examples" / "slurm.sbatch")]
    args = ["prompts.jsonl", str(out), "--batch-size", "1", "--quiet"]
    first = Job(args, tmp_path, "slurm-1", command=script, env=env)
    wait_for_journals(first, out, 6, timeout=420)
    first.kill()  # Slurm requeues: the whole job step is killed
    assert not out.exists()
    requeued = [*args, "--timeline", "timeline.png"]
    again = Job(requeued, tmp_path, "slurm-2", command=script, env={**env, "PORT": str(free_port())})
    assert again.wait(240) == 0, again.output()
    assert "journals of" in again.stderr and "resuming" in again.stderr, again.output()
    rows = read_results(out)
    assert len(rows) == 66 and len({r["id"] for r in rows}) == 66, again.output()  # each prompt once
    assert_no_orphans(out)
    assert_results_agree(rows, reference_results(tmp_path), f"requeued\n{again.output()}")
    png = (tmp_path / "timeline.png").read_bytes()  # --timeline: one row per rank
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
