"""The ``shardgen`` command: ``shardgen run`` (batch jobs), ``shardgen bench``, ``shardgen demo``.

    shardgen run --prompts prompts.jsonl --out results.jsonl --nproc 4
    torchrun --nproc-per-node 4 -m shardgen run --prompts prompts.jsonl --out results.jsonl
    python -m shardgen run ...          # the same as the shardgen command

Every flag is a dataclass field (``JobConfig``, ``EngineConfig``, ``SamplingParams``,
``DemoConfig``, ``BenchConfig``): its name, type, default and help (the docstring under the
field) are declared there once and turned into flags by :mod:`shardgen.flags`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import textwrap

from .backends import check_backend_name
from .bench import BenchConfig
from .config import EngineConfig, JobConfig, SamplingParams
from .demo import DemoConfig
from .errors import ExitCode, JobError
from .flags import add_fields, build, field_docs, flag_names, to_argv
from .jobs import check_model
from .journal import journal_paths
from .launch import die_with_parent, is_rank, launch
from .prompts import PromptRecord, read_prompts

# The settings `shardgen run` exposes, per dataclass (None: every field). SamplingParams'
# temperature and seed are JobConfig's own (0 = greedy; a base seed for per-request seeds).
RUN_FIELDS: tuple[tuple[type, tuple[str, ...] | None], ...] = (
    (JobConfig, None),
    (EngineConfig, ("backend", "gather", "max_batch_size", "refill", "stall_timeout")),
    (SamplingParams, ("max_new_tokens", "top_k", "top_p")),
)
LAUNCHER_ONLY = ("nproc", "max_restarts")  # consumed by the launcher, not passed to the ranks


def exit_code_help() -> str:
    """The exit-code table for ``--help`` epilogs and the README, from :class:`ExitCode`'s docstrings."""
    docs = field_docs(ExitCode)
    lines = ["exit codes:"]
    for c in ExitCode:
        text = docs.get(c.name, "success").replace("``", "")
        lines += textwrap.wrap(text, 96, initial_indent=f"  {int(c)}  ", subsequent_indent="     ")
    return "\n".join(lines)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardgen", description="Deadlock-free generation on sharded models."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    raw = {"epilog": exit_code_help(), "formatter_class": argparse.RawDescriptionHelpFormatter}
    run = sub.add_parser(
        "run",
        help="batch generation job: prompts file -> results file",
        description="Generate for every prompt of a file on all ranks; results in input order.",
        **raw,
    )
    for cls, names in RUN_FIELDS:
        add_fields(run, cls, names)
    demo = sub.add_parser(
        "demo",
        help="4 ranks on the shipped toy model: skewed work, an idle rank, a rank that steps away",
        description=(DemoConfig.__doc__ or "").replace("``", ""),
        **raw,
    )
    add_fields(demo, DemoConfig)
    bench = sub.add_parser(
        "bench",
        help="every generation method side by side on the toy model: table, JSON, timelines",
        description=(BenchConfig.__doc__ or "").replace("``", ""),
        **raw,
    )
    add_fields(bench, BenchConfig)
    return parser


def main(argv: list[str] | None = None) -> int:
    """``shardgen`` console script (and ``python -m shardgen``). Returns the exit code (``ExitCode``)."""
    ns = make_parser().parse_args(argv)
    try:
        if ns.command == "demo":
            from .demo import cmd_demo

            return cmd_demo(build(DemoConfig, ns))
        if ns.command == "bench":
            from .bench import cmd_bench

            return cmd_bench(build(BenchConfig, ns))
        return cmd_run(ns)
    except JobError as e:
        if os.environ.get("RANK", "0") == "0":  # every rank hits the same input error; say it once
            print(f"shardgen {ns.command}: error: {e}", file=sys.stderr, flush=True)
        return int(e.code)


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
        from .timeline import pyplot

        try:
            pyplot()
        except ImportError as e:
            raise JobError(ExitCode.USAGE, str(e)) from None
    records = read_prompts(job.prompts, job, base)
    check_model(job.model_path)
    for path in (job.out, job.json_summary, job.timeline):
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder and not (os.path.isdir(folder) and os.access(folder, os.W_OK)):
            raise JobError(ExitCode.USAGE, f"cannot write {path}: {folder} is not a writable folder")
    if job.nproc is not None and not is_rank():
        if journal_paths(job.out) and not job.resume:
            raise JobError(ExitCode.USAGE, _stale_journals(job.out))
        return launch_job(job, engine_cfg, base)
    return run_rank(job, engine_cfg, records)


def _stale_journals(out: str) -> str:
    return (
        f"{journal_paths(out)[0]}: journals of an unfinished earlier run exist; "
        "pass --resume to continue it, or delete them to start over"
    )


def run_rank(job: JobConfig, engine_cfg: EngineConfig, records: list[PromptRecord]) -> int:
    """This process as one rank (of a torchrun world, or alone). Collective across the world."""
    import torch.distributed as dist

    from . import comm
    from .jobs import run_job
    from .progress import format_summary

    if "TORCHELASTIC_RUN_ID" in os.environ:
        die_with_parent()  # a SIGKILLed launcher must not leave ranks running on their own
    comm.init()
    try:
        summary = run_job(job, engine_cfg, records)
        if summary is not None:
            if not job.quiet:
                print(format_summary(summary), flush=True)
            if job.json_summary:
                from .journal import atomic_write_text

                atomic_write_text(job.json_summary, [json.dumps(summary, indent=2) + "\n"])
        return ExitCode.OK
    except JobError:
        raise
    except Exception as e:  # the journals are intact; say how to go on
        import traceback

        traceback.print_exc()
        print(
            f"shardgen run: error: rank {dist.get_rank()} failed: {type(e).__name__}: {e} "
            "(results so far are in the journals; rerun with --resume)",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        from .liveness import linger

        linger()  # on rank 0, the store's host: let peers read who failed first
        os._exit(ExitCode.FAILED)  # peers may be blocked in collectives: do not wait for teardown
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def launch_job(
    job: JobConfig, engine_cfg: EngineConfig, base: SamplingParams, timeout: float | None = None
) -> ExitCode:
    """Spawn ``job.nproc`` ranks running ``shardgen run`` with the same settings (see ``launch``)."""
    assert job.nproc is not None
    argv = ["run"]
    for obj, (_, names) in zip((job, engine_cfg, base), RUN_FIELDS, strict=True):
        argv += to_argv(obj, names, skip=LAUNCHER_ONLY)
    return launch(argv, job.nproc, max_restarts=job.max_restarts, timeout=timeout)


if __name__ == "__main__":
    sys.exit(main())
