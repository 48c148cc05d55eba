"""Consecutive launched 2-rank ``shardgen run`` jobs beside busy processes: do they all exit 0?

    python benchmarks/exit_jobs.py --n 300 --json exit_jobs.json        # the RELIABILITY figure
    nice -n 10 python benchmarks/exit_jobs.py --n 30 --busy 2 --progress /tmp/exit_jobs.log

Each job is ``torchrun --standalone --nproc-per-node 2 -m shardgen run`` on the shipped toy
model with ``--prompts-n`` toy prompts (gloo, CPU), in its own session under a hard timeout.
``--busy`` pure-Python spinning processes (``while True: pass``, at this script's nice level)
run beside the jobs for the whole loop and are killed by pid at the end. A job counts as
clean when the launcher exits 0, every prompt has its row, and no output has a C++
``terminate``. ``--cores DIR`` lets the ranks dump core (``ulimit -c unlimited``; where the
cores land is the kernel's ``core_pattern``). Stops at the first unclean job with
``--stop-on-failure``; ``--json`` writes the counts and every unclean job's output tail.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"


def one_job(
    work: Path, prompts: Path, n_prompts: int, i: int, timeout: float, args: argparse.Namespace
) -> dict:
    """One launched 2-rank job; returns {rc, seconds, rows, terminate, tail}."""
    out = work / f"out-{i}.jsonl"
    log = work / f"job-{i}.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    if args.script:  # an engine script of the user's: no rows to count
        cmd += [str(Path(args.script).resolve())]
    else:
        cmd += ["-m", "shardgen", "run", "--prompts", str(prompts), "--out", str(out), "--quiet"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join([args.src, env.get("PYTHONPATH", "")])
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    t0 = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(
            cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=work, start_new_session=True
        )
        try:
            rc: int | None = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:  # past its timeout, or this script stopped (SIGTERM, Ctrl-C): no job left behind
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # this job's own process group
                proc.wait()
    text = log.read_text(errors="replace")
    rows = len(out.read_text().splitlines()) if out.exists() else 0
    res = {"job": i, "rc": rc, "seconds": round(time.monotonic() - t0, 2), "rows": rows}
    res["terminate"] = "terminate called" in text
    res["clean"] = rc == 0 and (rows == n_prompts or bool(args.script)) and not res["terminate"]
    res["tail"] = "" if res["clean"] else text[-4000:]
    for path in (log, out):
        path.unlink(missing_ok=True)
    return res


def die_with_parent() -> None:
    """A busy process must not outlive this script (Linux: SIGKILL when its parent dies)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=300, help="jobs to run (default 300)")
    ap.add_argument("--prompts-n", type=int, default=2, help="toy prompts per job (default 2)")
    ap.add_argument("--busy", type=int, default=2, help="busy-spinning processes beside the jobs (default 2)")
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds a job may take (default 180)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--progress", help="append one line per job to this file")
    ap.add_argument("--cores", action="store_true", help="let the ranks dump core (ulimit -c unlimited)")
    ap.add_argument("--stop-on-failure", action="store_true")
    ap.add_argument(
        "--script", help="launch this engine script instead of shardgen run (e.g. examples/basic.py)"
    )
    ap.add_argument(
        "--src", default=str(SRC), help="shardgen sources to put first on the path (default: this repo's)"
    )
    args = ap.parse_args()
    sys.path.insert(0, str(SRC))
    from shardgen import toy

    if args.cores:
        resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally below kills the busy ones
    spin = [sys.executable, "-c", "while True: pass"]
    busy = [subprocess.Popen(spin, preexec_fn=die_with_parent) for _ in range(args.busy)]
    results: list[dict] = []
    t0 = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="exit-jobs-") as d:
            work = Path(d)
            prompts = work / "prompts.jsonl"
            prompts.write_text(
                "".join(json.dumps(p) + "\n" for p in toy.make_prompts(args.prompts_n, seed=2))
            )
            for i in range(args.n):
                res = one_job(work, prompts, args.prompts_n, i, args.timeout, args)
                results.append(res)
                line = f"job {i}: rc={res['rc']} rows={res['rows']} terminate={res['terminate']} "
                line += f"{res['seconds']}s {'ok' if res['clean'] else 'UNCLEAN'}"
                if args.progress:
                    with open(args.progress, "a") as f:
                        f.write(line + "\n")
                print(line, flush=True)
                if not res["clean"]:
                    print(res["tail"], flush=True)
                    if args.stop_on_failure:
                        break
    finally:
        for p in busy:  # ours, by pid
            p.kill()
            p.wait()
    unclean = [r for r in results if not r["clean"]]
    summary = {
        "jobs": len(results),
        "clean": len(results) - len(unclean),
        "aborts": sum(r["terminate"] for r in results),
        "nonzero": sum(r["rc"] != 0 for r in results),
        "busy": args.busy,
        "prompts_per_job": args.prompts_n,
        "job": args.script or "shardgen run",
        "nice": os.nice(0),
        "seconds": round(time.monotonic() - t0, 1),
        "median_job_s": sorted(r["seconds"] for r in results)[len(results) // 2] if results else None,
        "unclean": unclean,
    }
    print(f"jobs: {summary['jobs']}, clean: {summary['clean']}, aborts: {summary['aborts']}, "
          f"non-zero: {summary['nonzero']}, {summary['seconds']} s", flush=True)  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return 1 if unclean else 0


if __name__ == "__main__":
    sys.exit(main())
