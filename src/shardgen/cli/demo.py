"""``shardgen demo``: a job on the shipped toy model that must neither hang nor answer wrong.

    shardgen demo            # 4 gloo ranks on CPU, 256 skewed toy prompts

Rank ``nproc - 1`` claims no prompts, rank 1 steps away for ``away_s`` while its driver keeps
serving; every answer is then checked against the toy task (``toy.check_answer``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from shardgen.config import LOG_LEVELS, EngineConfig, JobConfig, SamplingParams
from shardgen.errors import ExitCode, JobError
from shardgen.jobs.journal import journal_paths, read_jsonl


@dataclass(kw_only=True)
class DemoConfig:
    """``shardgen demo``: a job on the shipped toy model that must neither hang nor answer wrong."""

    nproc: int = 4
    """Ranks to spawn (gloo on CPU). The last one claims no prompts; rank 1 steps away for a while."""
    prompts: int = 256
    """Number of toy prompts; skewed: most answers are 1-4 numbers long, about 15% are 20-25."""
    batch_size: int = 8
    """Requests in flight per rank."""
    away_s: float = 3.0
    """Seconds rank 1's main thread sleeps while its driver keeps serving shadow forwards."""
    timeout: float = 120.0
    """Exit 7 if the job has not finished after this many seconds."""
    keep: str | None = None
    """Folder that keeps the demo's prompts, results and summary (default: a temporary one, removed)."""
    quiet: bool = False
    """Print nothing but errors: no progress bar, no summary, no log lines."""
    log_level: str | None = field(default=None, metadata={"choices": LOG_LEVELS})
    """Log lines shown (rank 0; the other ranks show warnings and errors): unset is warning (error
    with --quiet), or SHARDGEN_LOG_LEVEL when set."""


def cmd_demo(cfg: DemoConfig) -> int:
    """Run the demo job in a child world, then check every answer with ``toy.check_answer``."""
    from shardgen.toy import check_answer, make_prompts, toy_model_path

    if cfg.nproc < 2:
        raise JobError(ExitCode.USAGE, f"the demo needs --nproc >= 2, got {cfg.nproc}")
    tmp = None if cfg.keep else tempfile.TemporaryDirectory(prefix="shardgen-demo-")
    folder = cfg.keep or tmp.name  # type: ignore[union-attr]
    os.makedirs(folder, exist_ok=True)
    try:
        prompts = make_prompts(cfg.prompts, seed=0, skew=True)
        path = os.path.join(folder, "prompts.jsonl")
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(p) + "\n" for p in prompts)
        out, summary_path = os.path.join(folder, "results.jsonl"), os.path.join(folder, "summary.json")
        for stale in [out, *journal_paths(out)]:
            with contextlib.suppress(FileNotFoundError):
                os.remove(stale)
        idle, away = cfg.nproc - 1, (1 if cfg.nproc > 2 else 0)
        job = JobConfig(
            prompts=path,
            out=out,
            model=toy_model_path(),
            nproc=cfg.nproc,
            quiet=cfg.quiet,
            log_level=cfg.log_level,
            json_summary=summary_path,
            no_claim_ranks=[idle],
            away_rank=away,
            away_s=cfg.away_s,
        )
        say = (lambda *_, **__: None) if cfg.quiet else print
        say(
            f"shardgen demo: {cfg.nproc} ranks (gloo, CPU), {cfg.prompts} skewed toy prompts; rank {idle} "
            f"claims none, rank {away} steps away for {cfg.away_s:g}s",
            flush=True,
        )
        t0 = time.perf_counter()
        from shardgen.cli.run import launch_job

        rc = launch_job(
            job,
            # Per-layer: the demo shows sharded forwards in lockstep (the idle rank's shadow
            # forwards), which the default `auto` skips on a model this small (a replica fits).
            EngineConfig(backend="fsdp2", gather="per-layer", max_batch_size=cfg.batch_size),
            SamplingParams(),
            timeout=cfg.timeout,
        )
        wall = time.perf_counter() - t0
        if rc in (ExitCode.INTERRUPTED, ExitCode.TERMINATED):
            raise JobError(rc, f"interrupted by {signal.Signals(rc - 128).name}")
        if rc == ExitCode.TIMEOUT:
            raise JobError(ExitCode.TIMEOUT, f"the job did not finish within {cfg.timeout:g}s (a hang?)")
        if rc != ExitCode.OK:
            raise JobError(ExitCode.FAILED, "the job failed (see the messages above)")
        return _check_demo(prompts, list(read_jsonl(out)), summary_path, wall, idle, check_answer, say)
    finally:
        if tmp is not None:
            tmp.cleanup()


def _check_demo(
    prompts: list[dict],
    results: list[dict],
    summary_path: str,
    wall: float,
    idle: int,
    check_answer: Any,
    say: Any = print,
) -> int:
    ids = [r.get("id") for r in results]
    if ids != [p["id"] for p in prompts]:
        raise JobError(
            ExitCode.WRONG_ANSWERS, f"results hold {len(ids)} lines, not each of {len(prompts)} ids once"
        )
    wrong = [
        r for p, r in zip(prompts, results, strict=True) if not check_answer(p["prompt"], r.get("text") or "")
    ]
    shown = sorted(results, key=lambda r: r.get("generated_tokens", 0))
    for r in shown[:2] + shown[-2:]:
        say(f"  {r['prompt']!r:32} -> {r['text']!r} (rank {r['rank']})")
    with open(summary_path, encoding="utf-8") as f:
        summary = json.load(f)
    served = [r["prompts"] for r in summary["ranks"]]
    idle_prompts = served[idle]
    say(
        f"shardgen demo: {len(results) - len(wrong)}/{len(results)} answers correct; prompts served per "
        f"rank {served} (rank {idle} served {idle_prompts} prompts); {wall:.1f}s in all, nothing hung",
        flush=True,
    )
    if wrong:
        r = wrong[0]
        raise JobError(
            ExitCode.WRONG_ANSWERS, f"{len(wrong)} wrong answer(s), e.g. {r['prompt']!r} -> {r.get('text')!r}"
        )
    if idle_prompts:
        raise JobError(
            ExitCode.WRONG_ANSWERS, f"rank {idle} should have claimed no prompts, served {idle_prompts}"
        )
    return ExitCode.OK
