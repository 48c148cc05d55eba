"""Long runs leak nothing: the soaks of docs/RELIABILITY.md ("Long runs"), and their figures.

    python tests/helpers/soak.py job --prompts 20000 [--json soak-job.json]
    python tests/helpers/soak.py engine --calls 5000 --engines 200 [--world 2] [--json soak-engine.json]

``job``: ``shardgen run --nproc 2`` over N toy prompts while a sampler reads every rank's
resident memory (``VmRSS``) twice a second, next to the job's progress (the journals' lines);
a least-squares line over the samples after warm-up gives each rank's growth in MB per 1,000
prompts. ``engine``: in a World of spawned gloo ranks (tests/helpers/soak_scenarios.py), one engine
kept open across N ``generate()`` calls of random sizes, then M engines opened and closed one
after the other; threads, native threads, file descriptors, process groups, the store's keys
and ``atexit`` callbacks must be back at their baseline. tests/multirank/test_soak.py runs both, short
in ``make test`` and at full size (marker ``long``) in ``make fuzz``; the exit code here is
non-zero when a bound below is broken.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
if str(HERE) not in sys.path:  # soak_scenarios, world (run as a script)
    sys.path.insert(0, str(HERE))
if importlib.util.find_spec("shardgen") is None:  # not installed, no PYTHONPATH: this checkout's
    sys.path.append(str(HERE.parents[1] / "src"))

# Growth allowed after warm-up, MB of RSS per 1,000 prompts, per rank. Resident memory rises
# ~7-9 MB over the first 5,000 prompts, then creeps 0.1-0.2 per 1,000 (docs/RELIABILITY.md; in
# the engine soak glibc's bytes in use and Python's blocks stay flat meanwhile). A kept result
# per prompt (~1 kB) would add ~0.5. A short run (make test) is still in the warm-up: 600
# prompts, fitted over the second half, gave 10-14, so its bound catches only a gross leak (60 kB
# kept per result on each rank gave 38-40, 25 kB gave 21-23). Leaks of a few bytes per forward
# are the engine soak's to catch (Python's blocks). The growth is now the smaller of the two
# halves' slopes (analyse) and the short run is 1,000 prompts: clean 1-6, 25 kB kept per result
# 14-16, 60 kB 31-37 (a sitecustomize wrapping Journal.append, 2026-12-04).
SLOPE_BOUND_MB = 0.5  # 5,000 prompts or more: the first quarter is warm-up
SLOPE_BOUND_SHORT_MB = 25.0  # fewer: the first half is warm-up
LONG_JOB = 5000
WARMUP_MIN = 200

# While one engine stays open: growth of Python's allocated blocks after warm-up, per call (a
# median of slopes: a census now and then finds ~300 blocks fewer than its neighbours). Measured
# 0.04-0.09 per call after 1,250 of 5,000 calls (docs/RELIABILITY.md); FSDP2's forward records,
# before shardgen cleared them, grew 30-40 per call (4-5 requests, ~6 forwards), and one kept
# object per request would be ~5-15. A short run (make test) is still warming up: 3-9 per call
# over calls 30-80, so its bound catches FSDP2's records but not one small object per request.
BLOCKS_BOUND_PER_CALL = 2.0  # 1,000 calls or more
BLOCKS_BOUND_SHORT = 18.0  # fewer
LONG_CALLS = 1000
CALLS_WARMUP = 0.25  # the first quarter of the calls (at least CALLS_WARMUP_MIN) is warm-up
CALLS_WARMUP_MIN = 30

SHARDGEN = [sys.executable, "-m", "shardgen"]

#: What must return to its baseline in the engine soaks (RSS is reported beside them).
COUNTED = ("threads", "native_threads", "fds", "groups", "store_keys", "atexit")


def rss_mb(pid: int | str = "self") -> float:
    """Resident memory of ``pid`` in MB (``VmRSS`` of ``/proc/<pid>/status``); NaN if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


# ---------------------------------------------------------------------------------- the job soak


def rank_pids(needle: str) -> dict[int, int]:
    """{rank: pid} of the live rank processes whose command line holds ``needle`` (a unique tmp
    path: our job's ranks, not the launcher or torch's agent, which have no ``RANK``)."""
    found: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if needle not in (d / "cmdline").read_bytes().decode(errors="replace"):
                continue
            env = (d / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for var in env:
            if var.startswith(b"RANK="):
                found[int(var[5:])] = int(d.name)
    return found


class JournalLines:
    """The job's progress: result lines in its journals, read incrementally."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.offsets: dict[Path, int] = {}
        self.lines = 0

    def count(self) -> int:
        for path in self.out.parent.glob(self.out.name + ".rank*.journal.jsonl"):
            try:
                with open(path, "rb") as f:
                    f.seek(self.offsets.get(path, 0))
                    chunk = f.read()
            except OSError:
                continue
            whole = chunk[: chunk.rfind(b"\n") + 1]  # complete lines only
            self.offsets[path] = self.offsets.get(path, 0) + len(whole)
            self.lines += whole.count(b'"id"')  # rank 0's header line names no id
        return self.lines


def write_prompts(path: Path, n: int, seed: int = 19) -> None:
    """``n`` toy prompts, skewed lengths (85% short answers); one in ten sampled."""
    from shardgen import toy

    lines = []
    for i, p in enumerate(toy.make_prompts(n, seed=seed, skew=True)):
        lines.append({**p, "temperature": 0.8} if i % 10 == 3 else p)
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def fit_slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ``ys`` over ``xs`` (NaN with fewer than 3 points)."""
    n = len(xs)
    if n < 3:
        return math.nan
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else math.nan


def median_slope(xs: list[float], ys: list[float]) -> float:
    """Theil-Sen slope of ``ys`` over ``xs``: the median of the slopes between every two points, so
    that a few outliers do not tilt it (NaN with fewer than 3 points)."""
    pairs = [(i, j) for i in range(len(xs)) for j in range(i + 1, len(xs)) if xs[j] != xs[i]]
    slopes = sorted((ys[j] - ys[i]) / (xs[j] - xs[i]) for i, j in pairs)
    if len(xs) < 3 or not slopes:
        return math.nan
    mid = len(slopes) // 2
    return slopes[mid] if len(slopes) % 2 else (slopes[mid - 1] + slopes[mid]) / 2


def analyse(samples: list[dict[str, Any]], n: int, warm: int, world: int) -> dict[str, Any]:
    """Per rank: the growth of RSS over prompts done after warm-up (MB per 1,000), RSS at the end
    of warm-up, at the last sample of the serving phase and at its peak.

    The growth is the smaller of two least-squares slopes, one over each half of the serving
    phase's samples: a leak grows in both halves, a one-off step in one. A short run is still
    warming up, and a step there (a kernel cached for a batch shape first met after the
    warm-up: 10 MB on one rank of a clean clone's CI, where a line over the whole phase read 45
    MB per 1,000 prompts against the bound of 25) is not a leak. ``slope_all_mb_per_1000`` is
    the line over the whole phase, for the record."""
    # Serving ends where the count stops moving: rank 0 then merges the journals (it reads every
    # result back: a peak that is the merge's, not the serving's).
    end = min(n, max((s["done"] for s in samples), default=0))
    serving = [s for s in samples if warm <= s["done"] < end and len(s["rss_mb"]) == world]
    per_rank = []
    for r in range(world):
        pts = [
            (s["done"] / 1000, s["rss_mb"][str(r)]) for s in serving if not math.isnan(s["rss_mb"][str(r)])
        ]
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        half = len(pts) // 2
        halves = [fit_slope(xs[:half], ys[:half]), fit_slope(xs[half:], ys[half:])]
        per_rank.append({
            "rank": r,
            "samples": len(pts),
            # NaN when a half has under 3 samples: the caller's sample check fails first.
            "slope_mb_per_1000": round(min(halves), 3) if not any(map(math.isnan, halves)) else math.nan,
            "slope_halves_mb_per_1000": [round(h, 3) for h in halves],
            "slope_all_mb_per_1000": round(fit_slope(xs, ys), 3),
            "rss_warm_mb": round(ys[0], 1) if ys else None,
            "rss_last_mb": round(ys[-1], 1) if ys else None,
            "rss_peak_mb": round(max(ys), 1) if ys else None,
            "rss_min_mb": round(min(ys), 1) if ys else None,
        })  # fmt: skip
    return {"prompts": n, "warmup_prompts": warm, "ranks": per_rank}


def job_soak(
    n: int,
    *,
    workdir: Path | None = None,
    nproc: int = 2,
    batch_size: int | None = 16,
    interval: float = 0.5,
    timeout: float = 7200.0,
    log: Any = print,
) -> dict[str, Any]:
    """Run ``shardgen run --nproc`` over ``n`` toy prompts, sampling every rank's RSS each
    ``interval`` s; return the analysis, the samples and the job's summary. Raises
    ``RuntimeError`` (with the job's output) when the job fails or outlives ``timeout``."""
    workdir = Path(workdir or tempfile.mkdtemp(prefix="shardgen-soak-"))
    out = workdir / f"soak-{os.getpid()}-{time.monotonic_ns()}.jsonl"
    prompts, summary_path = workdir / "soak-prompts.jsonl", workdir / "soak-summary.json"
    write_prompts(prompts, n)
    args = ["run", "--prompts", str(prompts), "--out", str(out), "--nproc", str(nproc), "--quiet"]
    args += ["--json-summary", str(summary_path), "--seed", "7"]
    if batch_size:
        args += ["--batch-size", str(batch_size)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    here = str(Path(importlib.util.find_spec("shardgen").origin).parents[1])  # the ranks run this one
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    stdout, stderr = workdir / "soak.stdout", workdir / "soak.stderr"
    with open(stdout, "w") as o, open(stderr, "w") as e:
        proc = subprocess.Popen(
            SHARDGEN + args, cwd=workdir, env=env, stdout=o, stderr=e, start_new_session=True
        )
    progress = JournalLines(out)
    samples: list[dict[str, Any]] = []
    t0 = time.monotonic()
    try:
        while proc.poll() is None:
            if time.monotonic() - t0 > timeout:
                os.killpg(proc.pid, signal.SIGKILL)  # our own session: the launcher and its ranks
                proc.wait()
                raise RuntimeError(f"the soak job outlived {timeout:g}s\n{stderr.read_text()[-4000:]}")
            pids = rank_pids(str(out))
            if pids:
                rss = {str(r): round(rss_mb(pid), 2) for r, pid in sorted(pids.items())}
                samples.append(
                    {"t": round(time.monotonic() - t0, 2), "done": progress.count(), "rss_mb": rss}
                )
                if len(samples) % 60 == 0:
                    log(f"soak job: {samples[-1]}")
            time.sleep(interval)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if proc.returncode != 0 or not summary_path.exists():
        raise RuntimeError(f"the soak job failed (exit {proc.returncode})\n{stderr.read_text()[-4000:]}")
    summary = json.loads(summary_path.read_text())
    warm = job_warmup(n)
    result = analyse(samples, n, warm, nproc)
    result.update(wall_s=round(time.monotonic() - t0, 1), summary=summary, samples=samples)
    return result


# ---------------------------------------------------------------------------------- the engine soak


def engine_soak(calls: int, engines: int, world: int = 2, seed: int = 0, log: Any = print) -> dict[str, Any]:
    """The two engine scenarios on a fresh World of ``world`` ranks (tests/helpers/soak_scenarios.py)."""
    import soak_scenarios as S
    from world import World

    with World(world, start_timeout=300.0) as w:
        got = {}
        if calls:
            t = time.monotonic()
            got["calls"] = w.run(S.engine_calls, calls, seed, timeout=max(600.0, 2.0 * calls))
            log(f"soak engine: {calls} calls in {time.monotonic() - t:.0f}s")
        if engines:
            t = time.monotonic()
            got["engines"] = w.run(S.engine_cycles, engines, seed, timeout=max(600.0, 20.0 * engines))
            log(f"soak engine: {engines} engines in {time.monotonic() - t:.0f}s")
    return got


def leftovers(per_rank: list[dict[str, Any]]) -> list[str]:
    """What did not return to its baseline, per rank (empty: nothing leaked)."""
    bad = []
    for r in per_rank:
        moved = {k: (r["before"][k], r["after"][k]) for k in COUNTED if r["after"][k] != r["before"][k]}
        if moved or r["keys_left"]:
            bad.append(f"rank {r['rank']}: {moved} keys left {r['keys_left'][:20]}")
    return bad


def calls_growth(r: dict[str, Any]) -> dict[str, Any]:
    """One rank of ``engine_calls``: Python blocks per call and RSS (MB) per 1,000 calls, fitted
    over the censuses after warm-up."""
    warm = max(CALLS_WARMUP_MIN, int(CALLS_WARMUP * r["calls"]))
    pts = [c for c in r["open"] if c["calls"] >= warm]
    xs = [c["calls"] for c in pts]
    return {
        "rank": r["rank"],
        "warmup_calls": warm,
        "samples": len(pts),
        "blocks_per_call": round(median_slope(xs, [c["py_blocks"] for c in pts]), 3),
        "rss_mb_per_1000": round(1000 * fit_slope(xs, [c["rss_mb"] for c in pts]), 3),
        "blocks": (pts[0]["py_blocks"], pts[-1]["py_blocks"]) if pts else None,
        "rss_mb": (pts[0]["rss_mb"], pts[-1]["rss_mb"]) if pts else None,
        "malloc_mb": (pts[0]["malloc_mb"], pts[-1]["malloc_mb"]) if pts else None,
    }


def calls_lines(per_rank: list[dict[str, Any]]) -> list[str]:
    out = []
    for r in per_rank:
        g = calls_growth(r)
        out.append(
            f"MEASURED engine soak, one engine across {r['calls']} calls ({r['requests']} requests, "
            f"{r['seconds']}s), rank {r['rank']}: {g['blocks_per_call']:+.3f} Python blocks per call, "
            f"{g['rss_mb_per_1000']:+.3f} MB RSS per 1,000 calls after {g['warmup_calls']} (blocks "
            f"{g['blocks']}, RSS {g['rss_mb']} MB, malloc in use {g['malloc_mb']} MB; "
            f"{g['samples']} censuses; bound "
            f"{blocks_bound(r['calls']):g} blocks per call)"
        )
    return out


def table(per_rank: list[dict[str, Any]]) -> str:
    """One line per rank: each count before -> after."""
    rows = []
    for r in per_rank:
        cells = ", ".join(
            f"{k} {r['before'][k]} -> {r['after'][k]}" for k in (*COUNTED, "rss_mb", "malloc_mb", "py_blocks")
        )
        rows.append(f"rank {r['rank']}: {cells}")
    return "\n".join(rows)


def job_lines(res: dict[str, Any], bound: float) -> list[str]:
    """The job soak's figures, one line per rank (``MEASURED``: docs/RELIABILITY.md)."""
    lines = []
    for r in res["ranks"]:
        lines.append(
            f"MEASURED job soak, {res['prompts']} prompts, rank {r['rank']}: "
            f"{r['slope_mb_per_1000']:+.3f} MB per 1,000 prompts after {res['warmup_prompts']} "
            f"(halves {r['slope_halves_mb_per_1000']}, whole {r['slope_all_mb_per_1000']:+.3f}) "
            f"(RSS {r['rss_warm_mb']} -> {r['rss_last_mb']} MB, min {r['rss_min_mb']}, peak "
            f"{r['rss_peak_mb']}; {r['samples']} samples; bound {bound:g})"
        )
    s = res["summary"]
    lines.append(f"job: {s['completed']} prompts, {s['wall_s']}s serving, {res['wall_s']}s in all")
    return lines


def blocks_bound(calls: int) -> float:
    return BLOCKS_BOUND_PER_CALL if calls >= LONG_CALLS else BLOCKS_BOUND_SHORT


def job_bound(prompts: int) -> float:
    return SLOPE_BOUND_MB if prompts >= LONG_JOB else SLOPE_BOUND_SHORT_MB


def job_warmup(prompts: int) -> int:
    """The prompts whose samples are warm-up: the first quarter of a long job, half of a short one."""
    return max(WARMUP_MIN, prompts // 4 if prompts >= LONG_JOB else prompts // 2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    j = sub.add_parser("job", help="shardgen run over N prompts; RSS per rank")
    j.add_argument("--prompts", type=int, default=20000)
    j.add_argument("--batch-size", type=int, default=16, help="rows per rank (the figures' 16; 0: sized)")
    j.add_argument("--json", default=None)
    e = sub.add_parser("engine", help="one engine across N calls; M engines opened and closed")
    e.add_argument("--calls", type=int, default=5000)
    e.add_argument("--engines", type=int, default=200)
    e.add_argument("--world", type=int, default=2)
    e.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    ok = True
    if a.what == "job":
        res = job_soak(a.prompts, batch_size=a.batch_size)
        print("\n".join(job_lines(res, job_bound(a.prompts))))
        ok = all(r["slope_mb_per_1000"] <= job_bound(a.prompts) for r in res["ranks"])
    else:
        res = engine_soak(a.calls, a.engines, a.world)
        for name, per_rank in res.items():
            print(f"MEASURED engine soak, {name} ({a.calls} calls, {a.engines} engines), world {a.world}:")
            print(table(per_rank))
            bad = leftovers(per_rank)
            if name == "calls":
                print("\n".join(calls_lines(per_rank)))
                bad += [
                    f"rank {g['rank']}: {g['blocks_per_call']} Python blocks per call"
                    for g in map(calls_growth, per_rank)
                    if not g["blocks_per_call"] <= blocks_bound(a.calls)
                ]
            print("\n".join(bad) if bad else "nothing left behind")
            ok &= not bad
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
