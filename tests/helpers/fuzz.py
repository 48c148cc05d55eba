"""The schedule fuzzer: random schedules on 2-4 ranks; every one must end, correct and well attributed.

    python tests/helpers/fuzz.py --n 1000 [--seed0 0] [--json fuzz.json]     (``make fuzz N=1000``)

Schedule ``seed0 + i`` comes from ``fuzz_schedule.make_schedule`` (replay one with
``--seed0 S --n 1``). Fault-free schedules run in a reused World of spawned ranks;
schedules with a fault run in fresh processes (tests/helpers/fuzz_rank.py). A schedule passes
when no rank outlives its bound, every output equals HF ``generate()``, and, if the
fault fired, every healthy rank either finished (exit 0 after ``close()``) or raised
an error naming the victim and only the victim.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
sys.path[:0] = [str(HERE), str(HERE.parents[1] / "src")]

from fuzz_schedule import make_schedule  # noqa: E402

FAULT_BOUND = 15.0  # s from the fault to the last healthy rank's exit (stall_timeout=4 + slack)
RUN_BOUND = 240.0  # s for a whole schedule (a loaded 2-core machine)


def named(msg: str) -> set[int]:
    return {int(m) for m in re.findall(r"rank (\d+) \((?:host|no heartbeat)", msg)}


def world_scenario(seed: int) -> dict[str, Any]:
    """A fault-free schedule's part on this rank of a World (module level: importable)."""
    from fuzz_schedule import run_schedule
    from world import rank

    return run_schedule(make_schedule(seed), rank())


class Worlds:
    """One live World at a time, (re)started when the world size changes or it broke."""

    def __init__(self) -> None:
        self.world: Any = None

    def get(self, n: int) -> Any:
        from world import World

        if self.world is not None and (self.world.nprocs != n or self.world.broken):
            self.close()
        if self.world is None:
            self.world = World(n, start_timeout=300.0)  # a loaded machine starts ranks slowly
        return self.world

    def close(self) -> None:
        if self.world is not None:
            self.world.close()
            self.world = None


def run_fault_free(worlds: Worlds, seed: int, n: int) -> tuple[str, list[dict[str, Any]]]:
    """'ok', 'hang' or 'wrong' (or 'error: ...') for one schedule on a World, and each rank's
    counters (``run_schedule``'s; none unless 'ok')."""
    from world import WorldError, WorldHang

    try:
        world = worlds.get(n)
    except Exception as e:  # not the schedule's fault: the machine could not start ranks
        return f"error: the World did not start: {str(e)[:2000]}", []
    try:
        return "ok", world.run(world_scenario, seed, timeout=RUN_BOUND)
    except WorldHang as e:
        return f"hang: {str(e)[:3000]}", []
    except WorldError as e:
        return ("wrong: " if "!= HF" in str(e) else "error: ") + str(e)[-3000:], []


def run_with_fault(sched: dict[str, Any]) -> tuple[str, float | None]:
    """(verdict, seconds from the fault to the last healthy exit) for one fault schedule."""
    from fault_ranks import Ranks

    world, victim = sched["world"], sched["fault"]["victim"]
    ranks = Ranks(str(sched["seed"]), world, victim, script="fuzz_rank.py")
    try:
        t0 = time.monotonic()
        healthy = [r for r in range(world) if r != victim]
        while time.monotonic() - t0 < RUN_BOUND and any(ranks.procs[r].poll() is None for r in healthy):
            fault = ranks.events(victim, "fault")
            if fault and time.time() - fault[0]["t"] > FAULT_BOUND:
                break
            time.sleep(0.1)
        fault = ranks.events(victim, "fault")
        late = [r for r in healthy if ranks.procs[r].poll() is None]
        if late:
            return f"hang: rank(s) {late} still running\n{ranks.dump()}", None
        last = [e["t"] for r in healthy for e in ranks.events(r, "error") + ranks.events(r, "closed")]
        took = max(last) - fault[0]["t"] if fault and last else None  # fault -> last healthy rank's end
        for r in range(world):
            for e in ranks.events(r, "error"):
                if "!= HF" in e["msg"]:
                    return f"wrong: {e['msg']}", took
        for r in healthy:
            code, errs = ranks.procs[r].returncode, ranks.events(r, "error")
            if code == 0 and ranks.events(r, "closed"):
                continue
            if not fault:
                return f"error: rank {r} failed with no fault fired\n{ranks.dump()}", None
            if not errs or named(errs[0]["msg"]) != {victim}:
                return f"misattributed: rank {r} (victim {victim})\n{ranks.dump()}", took
        return "ok", took
    finally:
        for p in ranks.procs:  # a stopped victim: continue it so that it can die
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
        ranks.close()


def fuzz(n: int, seed0: int = 0, log: Any = print) -> dict[str, Any]:
    """Run schedules seed0 .. seed0+n-1; return the summary (counts and failing seeds)."""
    scheds = [make_schedule(seed0 + i) for i in range(n)]
    counts: Counter[str] = Counter()
    failures: list[dict[str, Any]] = []
    detect: list[float] = []
    t_start = time.monotonic()
    worlds = Worlds()
    interrupted = False
    try:
        # In blocks of 20 seeds (so a partial run covers both kinds): the fault-free schedules by
        # world size (one World at a time), then the fault schedules.
        order = sorted(scheds, key=lambda s: ((s["seed"] - seed0) // 20, s["fault"] is not None, s["world"]))
        for s in order:
            if s["fault"] is None:
                (result, ranks), took = run_fault_free(worlds, s["seed"], s["world"]), None
                # the Pacer's choice, on this machine's timings: did any rank verify a draft?
                counts["verified"] += any(r["verified"] for r in ranks)
            else:
                worlds.close()
                result, took = run_with_fault(s)
                if took is not None:
                    detect.append(took)
            kind = result.split(":", 1)[0]
            counts[kind] += 1
            counts["faults" if s["fault"] else "fault_free"] += 1
            if kind != "ok":
                failures.append({"seed": s["seed"], "result": result[:4000]})
            counts[f"gather={s['gather']}"] += 1
            counts[f"speculate={s['speculate']}"] += 1
            desc = f"fault={s['fault']['kind']}@rank{s['fault']['victim']}" if s["fault"] else "no fault"
            took_s = f" ({took:.1f}s)" if took else ""
            spec = f", speculate {s['speculate']}" if s["speculate"] else ""
            log(f"seed {s['seed']}: world {s['world']}, gather {s['gather']}{spec}, {desc}: {kind}{took_s}")
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM (see main): report the schedules run so far
        interrupted = True
    finally:
        worlds.close()
    return {
        "schedules": counts["faults"] + counts["fault_free"],
        "interrupted": interrupted,
        "seed0": seed0,
        "fault_free": counts["fault_free"],
        "with_fault": counts["faults"],
        "ok": counts["ok"],
        "hangs": counts["hang"],
        "wrong_tokens": counts["wrong"],
        "misattributed": counts["misattributed"],
        "other_errors": counts["error"],
        "by_gather": _by(counts, "gather"),
        "by_speculate": _by(counts, "speculate"),
        "fault_free_with_verify_forwards": counts["verified"],
        "max_fault_to_exit_s": round(max(detect), 2) if detect else None,
        "wall_s": round(time.monotonic() - t_start, 1),
        "failures": failures,
    }


def _by(counts: Counter[str], knob: str) -> dict[str, int]:
    """The schedules run per value of ``knob`` (counted as ``knob=value``)."""
    return {k.split("=", 1)[1]: v for k, v in sorted(counts.items()) if k.startswith(f"{knob}=")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--seed0", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the summary here")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Stopped by SIGINT or SIGTERM, still write the summary: a run started in the background has
    # SIGINT ignored (so it is restored here), and a job system's stop is a SIGTERM.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    summary = fuzz(args.n, args.seed0, log=lambda m: print(m, flush=True))
    text = json.dumps({k: v for k, v in summary.items() if k != "failures"}, indent=1)
    print(text)
    for f in summary["failures"]:
        print(f"--- seed {f['seed']}\n{f['result']}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0 if summary["ok"] == summary["schedules"] == args.n else 1


if __name__ == "__main__":
    sys.exit(main())
