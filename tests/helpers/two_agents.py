"""A ``shardgen run`` job under two torchrun agents on this host, as on two nodes.

    python tests/helpers/two_agents.py [RUNS]

Starts ``torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d`` twice (one agent per
"node", each in its own session), waits for both, and prints one line per run: exit
codes, seconds, and whether either output has a C++ ``terminate``. Exits non-zero if any
run failed. Used by tests/multirank/test_clean_exit.py and ``make fuzz``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ports import free_port

HERE = Path(__file__).parent


def run_once(workdir: Path, prompts: Path, timeout: float = 150.0) -> dict:
    """One two-agent job; returns {codes, seconds, terminate, outputs}."""
    port = free_port()
    out = workdir / f"out-{port}.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    src = os.environ.get("SHARDGEN_SRC", str(HERE.parents[1] / "src"))
    env["PYTHONPATH"] = os.pathsep.join([src, str(HERE / "exitcheck"), env.get("PYTHONPATH", "")])
    procs, logs = [], []
    t0 = time.monotonic()
    for node in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"]
        cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--max-restarts", "0"]
        cmd += ["-m", "shardgen.cli", "run", "--prompts", str(prompts), "--out", str(out), "--quiet"]
        cmd += ["--stall-timeout", "10"]
        log = workdir / f"agent-{port}-{node}.log"
        logs.append(log)
        with open(log, "w") as f:
            procs.append(
                subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
            )
    codes: list[int | None] = []
    for p in procs:
        left = timeout - (time.monotonic() - t0)
        try:
            codes.append(p.wait(max(1.0, left)))
        except subprocess.TimeoutExpired:
            os.killpg(os.getpgid(p.pid), signal.SIGKILL)
            p.wait()
            codes.append(None)
    texts = [log.read_text() for log in logs]
    rows = len(out.read_text().splitlines()) if out.exists() else 0
    leftover = [line for t in texts for line in t.splitlines() if "EXIT-THREADS" in line and "[]" not in line]
    return {
        "codes": codes,
        "seconds": round(time.monotonic() - t0, 1),
        "terminate": any("terminate called" in t for t in texts),
        "rows": rows,
        "threads_at_exit": leftover,
        "outputs": texts,
    }


def main(runs: int) -> int:
    sys.path.insert(0, str(HERE.parents[1] / "src"))
    from shardgen import toy

    bad = 0
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        prompts = work / "prompts.jsonl"
        prompts.write_text("".join(json.dumps(p) + "\n" for p in toy.make_prompts(12, seed=2)))
        for i in range(runs):
            res = run_once(work, prompts)
            ok = res["codes"] == [0, 0] and not res["terminate"] and res["rows"] == 12
            ok = ok and not res["threads_at_exit"]
            bad += not ok
            line = f"run {i}: codes={res['codes']} seconds={res['seconds']} terminate={res['terminate']}"
            line += f" rows={res['rows']} threads_at_exit={res['threads_at_exit']} {'ok' if ok else 'FAILED'}"
            print(line, flush=True)
            if not ok:
                for t in res["outputs"]:
                    print(t[-4000:])
    print(f"two-agent runs: {runs}, failed: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 10))
