"""``shardgen run``: validate everything, then launch the ranks or run as one of them."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import sys

from shardgen.config import EngineConfig, JobConfig, SamplingParams, check_backend_name
from shardgen.core.process import exit_on_signals
from shardgen.errors import ExitCode, JobError
from shardgen.flags import build, flag_names, to_argv
from shardgen.jobs.journal import id_key, include_out_file, journal_paths, load_results
from shardgen.jobs.prompts import PromptRecord, read_prompts
from shardgen.jobs.run import check_model, model_vocab_size
from shardgen.launch import LAUNCHED_ENV, die_with_parent, is_rank, launch

# The settings `shardgen run` exposes, per dataclass (None: every field). SamplingParams'
# temperature and seed are JobConfig's own (0 = greedy; a base seed for per-request seeds).
RUN_FIELDS: tuple[tuple[type, tuple[str, ...] | None], ...] = (
    (JobConfig, None),
    (
        EngineConfig,
        ("backend", "gather", "max_batch_size", "refill", "stall_timeout")
        + ("share_prefill", "max_prefill_tokens", "numerics")
        + ("speculate", "speculate_history_tokens", "speculate_share"),
    ),
    (SamplingParams, ("max_new_tokens", "top_k", "top_p")),
)
LAUNCHER_ONLY = ("nproc", "max_restarts")  # consumed by the launcher, not passed to the ranks


def cmd_run(ns: argparse.Namespace) -> int:
    try:
        job, engine_cfg, base = (build(cls, ns, names) for cls, names in RUN_FIELDS)
        job.validate()
        engine_cfg.validate()
        check_backend_name(engine_cfg.backend)
        base.validate()
    except ValueError as e:
        raise JobError(ExitCode.USAGE, flag_names(str(e), RUN_FIELDS)) from None
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        job = dataclasses.replace(job, resume=True)  # a restarted worker group picks up the journals
    # Validate everything before any rank or engine starts (in the launcher when it spawns).
    if job.timeline:
        from shardgen.bench.plot import pyplot

        try:
            pyplot()
        except ImportError as e:
            raise JobError(ExitCode.USAGE, str(e)) from None
    # The model's vocabulary first, when its config is readable, so a line's out-of-range EOS id is
    # named with the line's other problems; an unreadable model is said after the prompts file.
    records = read_prompts(job.prompts, job, base, vocab_size=model_vocab_size(job.model_path))
    check_model(job.model_path)
    for path in (job.out, job.json_summary, job.timeline):
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder and not (os.path.isdir(folder) and os.access(folder, os.W_OK)):
            raise JobError(ExitCode.USAGE, f"cannot write {path}: {folder} is not a writable folder")
    if job.nproc is not None and not is_rank():
        if journal_paths(job.out) and not job.resume:
            raise JobError(ExitCode.USAGE, _stale_journals(job.out))
        code = launch_job(job, engine_cfg, base)
        if code in (ExitCode.INTERRUPTED, ExitCode.TERMINATED):  # the ranks have ended, quietly
            line = interrupted_line(code - 128, job.out, records, resume_command())
            print(line, file=sys.stderr, flush=True)
        return code
    return run_rank(job, engine_cfg, records)


def interrupted_line(signum: int, out: str, records: list[PromptRecord], resume: str) -> str:
    """The one line of a job stopped by ``signum``: how many of its prompts ``resume`` will
    skip (journaled, or in a resumed ``out``), and that command. Local; reads the journals."""
    found = load_results(out, include_out=include_out_file(out, True))  # what --resume will count
    done = sum(id_key(r.id) in found for r in records)
    return (
        f"shardgen run: interrupted by {signal.Signals(signum).name}: {done} of {len(records)} "
        f"prompts are journaled, the journals are intact; resume with: {resume}"
    )


def _stale_journals(out: str) -> str:
    return (
        f"{journal_paths(out)[0]}: journals of an unfinished earlier run exist; "
        "pass --resume to continue it, or delete them to start over"
    )


def run_rank(job: JobConfig, engine_cfg: EngineConfig, records: list[PromptRecord]) -> int:
    """This process as one rank (of a torchrun world, or alone). Collective across the world."""
    # SIGINT / SIGTERM: every rank ends quietly, its journal intact; rank 0 says the one line,
    # unless `shardgen run --nproc` launched it (that process says it, once the ranks ended).
    speaks = os.environ.get("RANK", "0") == "0" and LAUNCHED_ENV not in os.environ
    say = (lambda signum: print(interrupted_line(signum, job.out, records, _rank_resume_command()),
                                file=sys.stderr, flush=True))  # fmt: skip
    with exit_on_signals(say if speaks else None):
        return _run_rank(job, engine_cfg, records)


def _run_rank(job: JobConfig, engine_cfg: EngineConfig, records: list[PromptRecord]) -> int:
    import torch.distributed as dist

    from shardgen.core import comm
    from shardgen.jobs.progress import format_summary
    from shardgen.jobs.run import run_job

    if "TORCHELASTIC_RUN_ID" in os.environ:
        die_with_parent()  # a SIGKILLed launcher must not leave ranks running on their own
    comm.init()
    try:
        outcome = run_job(job, engine_cfg, records)
        if outcome is not None:
            summary, rows = outcome
            if job.timeline:
                from shardgen.bench.plot import plot

                todo, world = summary["prompts"] - summary["resumed"], dist.get_world_size()
                title = f"shardgen run: {todo} prompts on {world} ranks"
                plot(rows, job.timeline, title=title, origin=dict.fromkeys(rows, 0.0))
            if not job.quiet:
                print(format_summary(summary), flush=True)
            if job.json_summary:
                from shardgen.jobs.journal import atomic_write_text

                atomic_write_text(job.json_summary, [json.dumps(summary, indent=2) + "\n"])
        return ExitCode.OK
    except JobError:
        raise
    except Exception as e:  # the journals are intact; say how to go on
        say_rank_failed(e, dist.get_rank())
        sys.stdout.flush()
        from shardgen.faults.liveness import linger

        linger()  # on rank 0, the store's host: let peers read who failed first
        os._exit(ExitCode.FAILED)  # peers may be blocked in collectives: do not wait for teardown
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def say_rank_failed(e: BaseException, rank: int) -> None:
    """A rank's job failed while running: its one ``shardgen run: error:`` line on stderr first;
    then, for anything but a ``ShardgenError`` (whose message names the failed or stalled rank
    already) or a lost connection (``DistNetworkError``: the job's store or a peer went away, a
    consequence of another rank's failure, which that rank or the launcher names), the Python
    traceback, for a bug report. Local."""
    import traceback

    from torch.distributed import DistNetworkError

    from shardgen.errors import ShardgenError

    lost = isinstance(e, DistNetworkError)
    why = ": a connection to the job's store or another rank was lost (another rank failed first?)"
    print(
        f"shardgen run: error: rank {rank} failed: {type(e).__name__}: {e}{why if lost else ''} "
        "(results so far are in the journals; rerun with --resume)",
        file=sys.stderr,
        flush=True,
    )
    if not isinstance(e, ShardgenError) and not lost:
        traceback.print_exception(e, file=sys.stderr)
        sys.stderr.flush()


def launch_job(
    job: JobConfig, engine_cfg: EngineConfig, base: SamplingParams, timeout: float | None = None
) -> ExitCode:
    """Spawn ``job.nproc`` ranks running ``shardgen run`` with the same settings (see ``launch``)."""
    assert job.nproc is not None
    argv = ["run"]
    for obj, (_, names) in zip((job, engine_cfg, base), RUN_FIELDS, strict=True):
        argv += to_argv(obj, names, skip=LAUNCHER_ONLY)
    return launch(argv, job.nproc, max_restarts=job.max_restarts, timeout=timeout, resume=resume_command())


def _rank_resume_command() -> str:
    """``resume_command``; under torchrun, its agent's command line (this process's parent's)."""
    import shlex

    if "TORCHELASTIC_RUN_ID" in os.environ:
        with contextlib.suppress(OSError):
            with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
            if len(argv) > 1 and os.path.basename(argv[1]) == "torchrun":
                argv = argv[1:]  # the torchrun script, not its interpreter
            if argv:
                return shlex.join([*argv, *([] if "--resume" in argv else ["--resume"])])
    return resume_command()


def resume_command() -> str:
    """The command line that resumes this job: the user's own, with ``--resume``."""
    import shlex

    args = sys.argv[1:]
    return shlex.join(["shardgen", *args, *([] if "--resume" in args else ["--resume"])])
