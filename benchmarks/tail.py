"""The long tail of a batch job: ranks' busy time spread under each claim order, side by side.

    python benchmarks/tail.py                          # 400 skewed toy prompts, 4 ranks
    python benchmarks/tail.py --prompts 400 --nproc 4 --rounds 2 --json tail.json
    python benchmarks/tail.py --prompts 20 --nproc 2 --workloads plain --orders longest

Runs ``shardgen run --nproc N`` on the toy model's skewed prompts with ``--claim-order input``
and ``--claim-order longest``, rounds interleaved, and reports each run's ``busy_spread``
((max - min) / max of the ranks' busy seconds) from the job summary, and the same spread of
the ranks' real forwards (the work itself, free of the CPU contention in busy seconds).
Two workloads: ``plain`` (every line has the job's max_new_tokens, so nothing tells a long
request from a short one before it runs) and ``bounded`` (each line carries its own
max_new_tokens, the answer's length + 1, as a user sets it who knows the bound of each kind of
request).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from shardgen.toy import answer_length, make_prompts


def run_job(folder: str, prompts: str, nproc: int, order: str, extra: list[str]) -> dict:
    out, summary = os.path.join(folder, "r.jsonl"), os.path.join(folder, "s.json")
    cmd = [sys.executable, "-m", "shardgen", "run", "--prompts", prompts, "--out", out, "--nproc", str(nproc),
           "--claim-order", order, "--json-summary", summary, "--quiet", *extra]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL).returncode != 0:
        # once more: on a busy machine the launcher's free port can be taken before rank 0 binds it
        subprocess.run([*cmd, "--resume"], check=True, env=env, stdout=subprocess.DEVNULL)
    with open(summary, encoding="utf-8") as f:
        s = json.load(f)
    os.remove(out)
    busy = [r["busy_s"] for r in s["ranks"]]
    forwards = [r["forwards"] for r in s["ranks"]]  # real forwards: the work, free of CPU noise
    fwd_spread = (max(forwards) - min(forwards)) / max(forwards)
    return {"busy_spread": s["busy_spread"], "forward_spread": fwd_spread, "wall_s": s["wall_s"],
            "busy_s": busy, "forwards": forwards}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=400)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--workloads", nargs="+", default=["plain", "bounded"])
    p.add_argument("--orders", nargs="+", default=["input", "longest"], choices=["input", "longest"])
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more shardgen run flags")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    results: dict[str, dict[str, list[dict]]] = {}
    with tempfile.TemporaryDirectory(prefix="shardgen-tail-") as tmp:
        for workload in args.workloads:
            lines = make_prompts(args.prompts, seed=0, skew=True)
            if workload == "bounded":
                lines = [{**x, "max_new_tokens": answer_length(x["prompt"]) + 1} for x in lines]
            path = os.path.join(tmp, f"{workload}.jsonl")
            with open(path, "w", encoding="utf-8") as f:
                f.writelines(json.dumps(x) + "\n" for x in lines)
            results[workload] = {order: [] for order in args.orders}
            for _ in range(args.rounds):
                for order in args.orders:
                    r = run_job(tmp, path, args.nproc, order, args.extra)
                    results[workload][order].append(r)
                    busy = [round(b, 1) for b in r["busy_s"]]
                    spread = f"busy spread {100 * r['busy_spread']:5.1f}% forwards {r['forwards']}"
                    print(f"{workload:8} {order:8} {spread} wall {r['wall_s']:.1f}s busy {busy}", flush=True)
    for workload, by_order in results.items():
        for order, runs in by_order.items():
            busy = statistics.median([100 * r["busy_spread"] for r in runs])
            fwd = statistics.median([100 * r["forward_spread"] for r in runs])
            n = len(runs)
            print(f"{workload:8} {order:8} median spread: busy {busy:5.1f}%, forwards {fwd:5.1f}% ({n} runs)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"config": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
