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
import inspect
import os
import sys
import textwrap

from shardgen.bench.command import BenchConfig
from shardgen.bench.methods import DESCRIPTIONS, METHODS
from shardgen.cli.demo import DemoConfig
from shardgen.cli.run import LAUNCHER_ONLY, RUN_FIELDS, cmd_run
from shardgen.config import EngineConfig, JobConfig, SamplingParams
from shardgen.errors import ExitCode, JobError
from shardgen.flags import CommandParser, add_fields, build, field_docs
from shardgen.launch import LAUNCHED_ENV
from shardgen.log import set_level

__all__ = ["EXIT_CODES", "LAUNCHER_ONLY", "RUN_FIELDS", "exit_code_help", "main", "make_parser"]


# The exit codes each command can end with, and what they mean there (None: ExitCode's docstring).
EXIT_CODES: dict[str, dict[ExitCode, str | None]] = {
    "run": {c: None for c in ExitCode if c not in (ExitCode.WRONG_ANSWERS, ExitCode.TIMEOUT)},
    "demo": {
        ExitCode.OK: "every answer is right and nothing hung",
        ExitCode.FAILED: "the demo job failed while running (a rank crashed or raised)",
        ExitCode.USAGE: "bad command line (unknown flag, invalid value)",
        ExitCode.WRONG_ANSWERS: "an answer is wrong or missing",
        ExitCode.TIMEOUT: "the job did not finish within --timeout (a hang?)",
        ExitCode.INTERRUPTED: "interrupted by SIGINT (Ctrl-C)",
        ExitCode.TERMINATED: "stopped by SIGTERM",
    },
    "bench": {
        ExitCode.OK: None,
        ExitCode.FAILED: "the benchmark of a world size failed (a rank crashed or raised)",
        ExitCode.USAGE: "bad command line (unknown flag or method, invalid value)",
        ExitCode.TIMEOUT: "a world size did not finish within --timeout",
    },
}

# The help sections of `shardgen run`'s flags, per dataclass.
RUN_TITLES = {
    JobConfig: "job",
    EngineConfig: "engine (shardgen.EngineConfig in the Python API)",
    SamplingParams: "sampling (shardgen.SamplingParams; unset: the model's generation_config decides)",
}


def exit_code_help(command: str = "run") -> str:
    """The exit-code table of ``command`` for its ``--help`` epilog (``ExitCode``'s docstrings
    unless ``EXIT_CODES`` words a code for that command)."""
    docs = field_docs(ExitCode)
    lines = ["exit codes:"]
    for c, text in EXIT_CODES[command].items():
        text = (text or docs.get(c.name, "success")).replace("``", "")
        first = f"  {int(c)}  "
        lines += textwrap.wrap(text, 96, initial_indent=first, subsequent_indent=" " * len(first))
    return "\n".join(lines)


def methods_help() -> str:
    """``shardgen bench``'s methods, one line each, for its ``--help``."""
    width = max(map(len, METHODS))
    lines = ["methods:"]
    for name in METHODS:
        lines += textwrap.wrap(
            DESCRIPTIONS[name], 96, initial_indent=f"  {name:<{width}}  ", subsequent_indent=" " * (width + 4)
        )
    return "\n".join(lines)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardgen", description="Deadlock-free generation on sharded models."
    )
    # Each subcommand's parser reports the flags it does not know (with the nearest one it has).
    sub = parser.add_subparsers(dest="command", required=True, parser_class=CommandParser)
    raw = {"formatter_class": argparse.RawDescriptionHelpFormatter}
    run = sub.add_parser(
        "run",
        help="batch generation job: prompts file -> results file",
        description="Generate for every prompt of a file on all ranks; results in input order.",
        epilog=exit_code_help("run"),
        **raw,
    )
    for cls, names in RUN_FIELDS:
        add_fields(run, cls, names, title=RUN_TITLES[cls])
    demo = sub.add_parser(
        "demo",
        help="4 ranks on the shipped toy model: skewed work, an idle rank, a rank that steps away",
        description=(DemoConfig.__doc__ or "").replace("``", ""),
        epilog=exit_code_help("demo"),
        **raw,
    )
    add_fields(demo, DemoConfig)
    bench = sub.add_parser(
        "bench",
        help="every generation method side by side on the toy model: table, JSON, timelines",
        description=inspect.cleandoc(BenchConfig.__doc__ or "").replace("``", ""),
        epilog=methods_help() + "\n\n" + exit_code_help("bench"),
        **raw,
    )
    add_fields(bench, BenchConfig)
    return parser


def _log_level(ns: argparse.Namespace) -> str | None:
    """The level the command line asks for: --log-level, else error under --quiet, else
    SHARDGEN_LOG_LEVEL or the default (None: leave the logger as it is)."""
    if getattr(ns, "log_level", None):
        return ns.log_level
    if getattr(ns, "quiet", False):
        return "error"
    return None


def main(argv: list[str] | None = None) -> int:
    """``shardgen`` console script (and ``python -m shardgen``). Returns the exit code (``ExitCode``)."""
    ns = make_parser().parse_args(argv)
    level = _log_level(ns)
    if level is not None:
        set_level(level)  # this process, and (through the environment) the ranks it launches
    try:
        if ns.command == "demo":
            from shardgen.cli.demo import cmd_demo

            return cmd_demo(build(DemoConfig, ns))
        if ns.command == "bench":
            from shardgen.bench.command import cmd_bench

            return cmd_bench(build(BenchConfig, ns))
        return cmd_run(ns)
    except JobError as e:
        if os.environ.get("RANK", "0") == "0":  # every rank hits the same input error; say it once
            print(f"shardgen {ns.command}: error: {e}", file=sys.stderr, flush=True)
        return int(e.code)
    except KeyboardInterrupt:  # Ctrl-C before the job handles signals (reading input, importing torch)
        if os.environ.get("RANK", "0") == "0" and LAUNCHED_ENV not in os.environ:
            print(f"shardgen {ns.command}: interrupted by SIGINT", file=sys.stderr, flush=True)
        return int(ExitCode.INTERRUPTED)


if __name__ == "__main__":
    sys.exit(main())
