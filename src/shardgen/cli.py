"""The ``shardgen`` command: ``shardgen run`` (batch generation jobs) and ``shardgen demo``.

    shardgen run --prompts prompts.jsonl --out results.jsonl --nproc 4
    torchrun --nproc-per-node 4 -m shardgen.cli run --prompts prompts.jsonl --out results.jsonl

Every flag is a dataclass field (``JobConfig``, ``EngineConfig``, ``SamplingParams``,
``DemoConfig``): its name, type, default and help (the docstring under the field) are
declared there once and read here.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import inspect
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import types
import typing
from dataclasses import dataclass
from typing import Any

from .backends import check_backend_name
from .config import EngineConfig, SamplingParams
from .jobs import ExitCode, JobConfig, JobError, check_model, read_prompts
from .journal import journal_paths, read_jsonl

# The settings `shardgen run` exposes, per dataclass (None: every field). SamplingParams'
# temperature and seed are JobConfig's own (0 = greedy; a base seed for per-request seeds).
RUN_FIELDS: tuple[tuple[type, tuple[str, ...] | None], ...] = (
    (JobConfig, None),
    (EngineConfig, ("backend", "gather", "max_batch_size", "refill", "stall_timeout")),
    (SamplingParams, ("max_new_tokens", "top_k", "top_p")),
)
FLAG_NAMES = {"max_batch_size": "batch-size"}
LAUNCHER_ONLY = ("nproc", "max_restarts")  # consumed by the launcher, not passed to the ranks


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
    """No progress bar and no summary table."""


# ---------------------------------------------------------------------------------- flags from fields


def field_docs(cls: type) -> dict[str, str]:
    """``{name: docstring}`` from the string literal under each field (or enum member) of ``cls``."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, nxt in zip(body, body[1:], strict=False):
        target = node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        doc = nxt.value.value if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) else None
        if isinstance(target, ast.Name) and isinstance(doc, str):
            docs[target.id] = " ".join(doc.split())
    return docs


def exit_code_help() -> str:
    """The exit-code table for ``--help`` epilogs and the README, from :class:`ExitCode`'s docstrings."""
    docs = field_docs(ExitCode)
    lines = ["exit codes:"]
    for c in ExitCode:
        text = docs.get(c.name, "success").replace("``", "")
        lines += textwrap.wrap(text, 96, initial_indent=f"  {int(c)}  ", subsequent_indent="     ")
    return "\n".join(lines)


def _base_type(tp: Any) -> tuple[Any, bool]:
    """(the type argparse converts to, is it a list) for int/float/str/bool, X | None, list[X]."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        (tp,) = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is list:
        return typing.get_args(tp)[0], True
    return tp, False


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def add_fields(parser: argparse.ArgumentParser, cls: type, names: tuple[str, ...] | None = None) -> None:
    """One ``--flag`` per dataclass field: type, default and help (the field docstring) from ``cls``."""
    docs, hints = field_docs(cls), typing.get_type_hints(cls)
    group = parser.add_argument_group(f"{cls.__name__} settings")
    for f in dataclasses.fields(cls):
        if names is not None and f.name not in names:
            continue
        tp, many = _base_type(hints[f.name])
        default = _default(f)
        text = docs.get(f.name, "").replace("``", "").removeprefix("(agreed) ").replace("%", "%%")
        if not (default is dataclasses.MISSING or default is None or default is False or default == []):
            text += f" (default: {default})"
        kw: dict[str, Any] = {"dest": f.name, "help": argparse.SUPPRESS if f.metadata.get("hidden") else text}
        if tp is bool:
            kw["action"] = argparse.BooleanOptionalAction if default else "store_true"
        else:
            kw.update(type=tp, metavar=FLAG_NAMES.get(f.name, f.name).upper().replace("-", "_"))
            if many:
                kw["nargs"] = "+"
        if default is dataclasses.MISSING:
            kw["required"] = True
        else:
            kw["default"] = default
        group.add_argument("--" + FLAG_NAMES.get(f.name, f.name.replace("_", "-")), **kw)


def build(cls: type, ns: argparse.Namespace, names: tuple[str, ...] | None = None) -> Any:
    """An instance of ``cls`` from the parsed flags (the fields without a flag keep their defaults)."""
    keys = [f.name for f in dataclasses.fields(cls) if names is None or f.name in names]
    return cls(**{k: getattr(ns, k) for k in keys})


def to_argv(obj: Any, names: tuple[str, ...] | None = None, skip: tuple[str, ...] = ()) -> list[str]:
    """The flags that rebuild ``obj`` (only the fields that differ from their defaults)."""
    argv: list[str] = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if (names is not None and f.name not in names) or f.name in skip or value == _default(f):
            continue
        flag = "--" + FLAG_NAMES.get(f.name, f.name.replace("_", "-"))
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    return argv


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardgen", description="Deadlock-free generation on sharded models."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser(
        "run",
        help="batch generation job: prompts file -> results file",
        description="Generate for every prompt of a file on all ranks; results in input order.",
        epilog=exit_code_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for cls, names in RUN_FIELDS:
        add_fields(run, cls, names)
    demo = sub.add_parser(
        "demo",
        help="4 ranks on the shipped toy model: skewed work, an idle rank, a rank that steps away",
        description=(DemoConfig.__doc__ or "").replace("``", ""),
        epilog=exit_code_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_fields(demo, DemoConfig)
    return parser


# ---------------------------------------------------------------------------------- entry points


def main(argv: list[str] | None = None) -> int:
    """``shardgen`` console script. Returns the exit code (see ``ExitCode``)."""
    ns = make_parser().parse_args(argv)
    try:
        return cmd_run(ns) if ns.command == "run" else cmd_demo(build(DemoConfig, ns))
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
        raise JobError(ExitCode.USAGE, _flag_names(str(e))) from None
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        job = dataclasses.replace(job, resume=True)  # a restarted worker group picks up the journals
    # Validate everything before any rank or engine starts (in the launcher when it spawns).
    records = read_prompts(job.prompts, job, base)
    check_model(job.model_path)
    for path in (job.out, job.json_summary):
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder and not (os.path.isdir(folder) and os.access(folder, os.W_OK)):
            raise JobError(ExitCode.USAGE, f"cannot write {path}: {folder} is not a writable folder")
    if job.nproc is not None and "RANK" not in os.environ:
        if journal_paths(job.out) and not job.resume:
            raise JobError(ExitCode.USAGE, _stale_journals(job.out))
        return launch(job, engine_cfg, base)
    return run_rank(job, engine_cfg, base, records)


def _flag_names(message: str) -> str:
    """Say ``--batch-size`` where a validation message says ``max_batch_size``."""
    for cls, names in RUN_FIELDS:
        for name in names or [f.name for f in dataclasses.fields(cls)]:
            flag = "--" + FLAG_NAMES.get(name, name.replace("_", "-"))
            message = re.sub(rf"(?<![-\w]){name}\b", flag, message)
    return message


def _stale_journals(out: str) -> str:
    return (
        f"{journal_paths(out)[0]}: journals of an unfinished earlier run exist; "
        "pass --resume to continue it, or delete them to start over"
    )


def run_rank(job: JobConfig, engine_cfg: EngineConfig, base: SamplingParams, records: list) -> int:
    """This process as one rank (of a torchrun world, or alone). Collective across the world."""
    import torch.distributed as dist

    from . import comm
    from .jobs import run_job
    from .progress import format_summary

    if "TORCHELASTIC_RUN_ID" in os.environ:
        _die_with_parent()  # a SIGKILLed launcher must not leave ranks running on their own
    comm.init()
    try:
        summary = run_job(job, engine_cfg, base, records)
        if summary is not None:
            if not job.quiet:
                print(format_summary(summary), flush=True)
            if job.json_summary:
                from .journal import atomic_write_text

                atomic_write_text(job.json_summary, [json.dumps(summary, indent=2) + "\n"])
        return ExitCode.OK
    except JobError:
        raise
    except Exception as e:  # noqa: BLE001 - the journals are intact; say how to go on
        import traceback

        traceback.print_exc()
        print(
            f"shardgen run: error: rank {dist.get_rank()} failed: {type(e).__name__}: {e} "
            "(results so far are in the journals; rerun with --resume)",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        os._exit(ExitCode.FAILED)  # peers may be blocked in collectives: do not wait for teardown
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def launch(
    job: JobConfig, engine_cfg: EngineConfig, base: SamplingParams, timeout: float | None = None
) -> int:
    """Spawn ``job.nproc`` ranks with torch's launcher running ``shardgen.cli run`` (same settings).

    Returns 0 when every rank succeeded, ``FAILED`` otherwise, ``TIMEOUT`` past ``timeout``.
    """
    assert job.nproc is not None
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={job.nproc}"]
    if job.max_restarts:
        cmd.append(f"--max-restarts={job.max_restarts}")
    cmd += ["-m", "shardgen.cli", "run"]
    for obj, (_, names) in zip((job, engine_cfg, base), RUN_FIELDS, strict=True):
        cmd += to_argv(obj, names, skip=LAUNCHER_ONLY)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # torch's launcher would set it too, with a warning
    # A store shared with the agent keeps the keys of a failed attempt, and the restarted ranks
    # then connect their gloo groups to dead peers (pytorch/pytorch#135712): one store per attempt.
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    proc = subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent)  # noqa: PLW1509
    old = signal.signal(signal.SIGTERM, lambda *_: proc.terminate())  # the agent stops its ranks
    try:
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()  # the ranks die with it (parent-death signal)
                proc.wait()
            return ExitCode.TIMEOUT
        except KeyboardInterrupt:  # the terminal sent SIGINT to the agent as well
            proc.wait()
            return ExitCode.FAILED
    finally:
        signal.signal(signal.SIGTERM, old)
    return ExitCode.OK if rc == 0 else ExitCode.FAILED


def _die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this process when its parent dies (no orphaned ranks)."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG


# ---------------------------------------------------------------------------------- demo


def cmd_demo(cfg: DemoConfig) -> int:
    """Run the demo job in a child world, then check every answer with ``toy.check_answer``."""
    from .toy import check_answer, make_prompts, toy_model_path

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
            json_summary=summary_path,
            no_claim_ranks=[idle],
            away_rank=away,
            away_s=cfg.away_s,
        )
        print(
            f"shardgen demo: {cfg.nproc} ranks (gloo, CPU), {cfg.prompts} skewed toy prompts; rank {idle} "
            f"claims none, rank {away} steps away for {cfg.away_s:g}s",
            flush=True,
        )
        t0 = time.perf_counter()
        rc = launch(
            job,
            EngineConfig(backend="fsdp2", max_batch_size=cfg.batch_size),
            SamplingParams(),
            timeout=cfg.timeout,
        )
        wall = time.perf_counter() - t0
        if rc == ExitCode.TIMEOUT:
            raise JobError(ExitCode.TIMEOUT, f"the job did not finish within {cfg.timeout:g}s (a hang?)")
        if rc != ExitCode.OK:
            raise JobError(ExitCode.FAILED, "the job failed (see the messages above)")
        return _check_demo(prompts, list(read_jsonl(out)), summary_path, wall, idle, check_answer)
    finally:
        if tmp is not None:
            tmp.cleanup()


def _check_demo(
    prompts: list[dict], results: list[dict], summary_path: str, wall: float, idle: int, check_answer: Any
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
        print(f"  {r['prompt']!r:32} -> {r['text']!r} (rank {r['rank']})")
    with open(summary_path, encoding="utf-8") as f:
        summary = json.load(f)
    served = [r["prompts"] for r in summary["ranks"]]
    idle_prompts = served[idle]
    print(
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


if __name__ == "__main__":
    sys.exit(main())
