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
import os
import sys
import textwrap

from shardgen.bench.command import BenchConfig
from shardgen.cli.demo import DemoConfig
from shardgen.cli.run import LAUNCHER_ONLY, RUN_FIELDS, cmd_run
from shardgen.errors import ExitCode, JobError
from shardgen.flags import add_fields, build, field_docs

__all__ = ["LAUNCHER_ONLY", "RUN_FIELDS", "exit_code_help", "main", "make_parser"]


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


if __name__ == "__main__":
    sys.exit(main())
