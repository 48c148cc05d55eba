"""Batch jobs: read prompts, hand them out dynamically, journal results durably, merge, resume.

    shardgen run --prompts prompts.jsonl --out results.jsonl --nproc 4
    torchrun --nproc-per-node 4 -m shardgen.cli run --prompts prompts.jsonl --out results.jsonl

Everything that touches files is plain Python (unit-testable without processes); the
distributed part is :func:`run_job`, called once on every rank.

How work is shared: every rank holds the same list of pending prompts (rank 0 computes
it and broadcasts it). A rank with free slots claims the next ``k`` indices with ONE
atomic ``store.add(key, k)`` on the default group's c10d store (the returned value ``v``
means "indices ``v-k .. v-1`` are mine"), so each prompt goes to exactly one rank and a
rank that is fast, or has short prompts, simply claims more. Each result is appended to
the rank's own journal (flush + fsync) the moment it completes; at the end rank 0 merges
the journals into ``--out`` in input order, deduplicated by id, through a temp file and
``os.replace``. A rerun with ``--resume`` (or a restart by torch's elastic agent) skips
every id already journaled or already in ``--out``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import hashlib
import json
import os
import time
import types
import typing
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Any

from .config import EngineConfig, SamplingParams
from .journal import (
    Journal,
    atomic_write_text,
    id_key,
    include_out_file,
    journal_path,
    journal_paths,
    load_results,
)
from .log import get_logger

log = get_logger()

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
ID_FIELDS = ("id", "prompt")


class ExitCode(enum.IntEnum):
    """Exit codes of ``shardgen run`` / ``shardgen demo`` (also in ``--help`` and the README)."""

    OK = 0
    FAILED = 1
    """the job failed while running (a rank crashed or raised; journals are intact: rerun with --resume)"""
    USAGE = 2
    """bad command line (unknown flag, invalid value, --out folder not writable, journals of an
    unfinished run without --resume)"""
    NO_PROMPTS = 3
    """prompts file missing, unreadable or empty"""
    BAD_PROMPTS = 4
    """prompts file invalid: malformed JSON, missing or non-string prompt, duplicate or bad id,
    unknown or invalid field (the message names file:line)"""
    BAD_MODEL = 5
    """model path missing or unreadable"""
    WRONG_ANSWERS = 6
    """``shardgen demo`` only: some answer is wrong or missing"""
    TIMEOUT = 7
    """``shardgen demo`` only: the job did not finish within ``--timeout``"""


class JobError(Exception):
    """A problem the user can fix; the CLI prints ``str(self)`` on one line and exits ``code``."""

    def __init__(self, code: ExitCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(kw_only=True)
class JobConfig:
    """One ``shardgen run`` job: what is not an engine (``EngineConfig``) or sampling setting."""

    prompts: str
    """JSONL (one object a line: "id", "prompt", optional generation fields named like the
    SamplingParams fields) or plain text (one prompt a line; the ids are the line numbers)."""
    out: str
    """Results file (JSONL, input order). Per-rank journals <out>.rank<R>.journal.jsonl sit next
    to it while the job runs."""
    model: str | None = None
    """Hugging Face model folder; default: the toy model shipped with shardgen."""
    dtype: str = "auto"
    """Weights dtype: auto (the checkpoint's), float32, bfloat16, float16."""
    nproc: int | None = None
    """Spawn this many local ranks with torch's launcher. Without it: one rank, or this process
    as one rank when launched by torchrun (RANK is set)."""
    max_restarts: int = 0
    """Restarts torch's elastic agent may make after a rank fails (with --nproc); a restarted job
    resumes from the journals."""
    resume: bool = False
    """Skip the prompts already answered in the journals of an earlier run or in --out."""
    temperature: float = 0.0
    """Sampling temperature: > 0 samples (do_sample), 0 is greedy. A prompt line may set its own."""
    seed: int = 0
    """Base seed: a sampled request without its own seed gets one derived from (seed, id), so its
    tokens do not depend on the rank that served it."""
    quiet: bool = False
    """No progress bar and no summary table."""
    json_summary: str | None = None
    """Also write the summary as JSON to this file."""
    no_claim_ranks: list[int] = field(default_factory=list, metadata={"hidden": True})
    """Ranks that never claim prompts (demo and tests: a rank with no work must not block others)."""
    away_rank: int | None = field(default=None, metadata={"hidden": True})
    """Rank whose main thread sleeps away_s once it has work in flight (demo and tests)."""
    away_s: float = field(default=3.0, metadata={"hidden": True})
    """Seconds the away_rank's main thread sleeps."""

    @property
    def model_path(self) -> str:
        if self.model is not None:
            return self.model
        from .toy import toy_model_path

        return toy_model_path()

    def validate(self) -> None:
        if self.nproc is not None and self.nproc < 1:
            raise ValueError(f"--nproc must be >= 1, got {self.nproc}")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if self.dtype != "auto" and self.dtype not in ("float32", "float16", "bfloat16", "float64"):
            raise ValueError(f"--dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")


# ---------------------------------------------------------------------------------- reading prompts


@dataclass
class PromptRecord:
    """One validated prompt line."""

    id: str | int
    prompt: str
    options: dict[str, Any]
    """Per-request generation fields from the line (SamplingParams names)."""
    line: int


def read_prompts(
    path: str, cfg: JobConfig | None = None, base: SamplingParams | None = None
) -> list[PromptRecord]:
    """Read and validate the whole prompts file; raise ``JobError`` naming ``file:line``.

    Blank lines are skipped. A file is JSONL when its name ends in .jsonl/.ndjson/.json or
    its first non-blank line starts with ``{``; otherwise each line is one prompt.
    """
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        raise JobError(ExitCode.NO_PROMPTS, f"prompts file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise JobError(ExitCode.NO_PROMPTS, f"cannot read prompts file {path}: {e}") from None
    numbered = [(n, line) for n, line in enumerate(lines, start=1) if line.strip()]
    if not numbered:
        raise JobError(ExitCode.NO_PROMPTS, f"prompts file is empty: {path}")
    is_jsonl = path.endswith(JSONL_SUFFIXES) or numbered[0][1].lstrip().startswith("{")
    if not is_jsonl:
        return [PromptRecord(id=n, prompt=line, options={}, line=n) for n, line in numbered]
    allowed = set(ID_FIELDS) | {f.name for f in dataclasses.fields(SamplingParams)}
    hints = typing.get_type_hints(SamplingParams)
    seen: dict[str, int] = {}
    out = []
    for n, line in numbered:
        where = f"{path}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise JobError(
                ExitCode.BAD_PROMPTS, f"{where}: malformed JSON: {e.msg} (column {e.colno})"
            ) from None
        if not isinstance(obj, dict):
            raise JobError(ExitCode.BAD_PROMPTS, f"{where}: expected a JSON object, got {_json_type(obj)}")
        unknown = sorted(set(obj) - allowed)
        if unknown:
            raise JobError(
                ExitCode.BAD_PROMPTS,
                f"{where}: unknown field(s) {', '.join(map(repr, unknown))} "
                f"(allowed: {', '.join(sorted(allowed))})",
            )
        if "prompt" not in obj:
            raise JobError(ExitCode.BAD_PROMPTS, f"{where}: missing 'prompt'")
        if not isinstance(obj["prompt"], str):
            raise JobError(
                ExitCode.BAD_PROMPTS, f"{where}: 'prompt' must be a string, got {_json_type(obj['prompt'])}"
            )
        rid = obj.get("id", n)
        if isinstance(rid, bool) or not isinstance(rid, (str, int)):
            raise JobError(
                ExitCode.BAD_PROMPTS, f"{where}: 'id' must be a string or an integer, got {_json_type(rid)}"
            )
        key = id_key(rid)
        if key in seen:
            raise JobError(ExitCode.BAD_PROMPTS, f"{where}: duplicate id {rid!r} (first on line {seen[key]})")
        seen[key] = n
        options = {k: v for k, v in obj.items() if k not in ID_FIELDS}
        for name, value in options.items():
            if not _type_ok(value, hints[name]):
                raise JobError(
                    ExitCode.BAD_PROMPTS,
                    f"{where}: field {name!r} must be {_type_name(hints[name])}, got {_json_type(value)}",
                )
        rec = PromptRecord(id=rid, prompt=obj["prompt"], options=options, line=n)
        if cfg is not None and base is not None:
            try:
                request_params(cfg, base, rec)
            except ValueError as e:
                raise JobError(ExitCode.BAD_PROMPTS, f"{where}: {e}") from None
        out.append(rec)
    return out


def _json_type(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number"
    )


def _type_ok(value: Any, tp: Any) -> bool:
    """Does a JSON value fit a (simple) annotation: int, float, bool, str, X | None, list[int]?"""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(tp))
    if origin is list:
        (inner,) = typing.get_args(tp)
        return isinstance(value, list) and all(_type_ok(v, inner) for v in value)
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, tp)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    names = {int: "an integer", float: "a number", bool: "true/false", str: "a string", type(None): "null"}
    return names.get(tp, getattr(tp, "__name__", str(tp)))


def derive_seed(base_seed: int, rid: str | int) -> int:
    """A request's sampling seed from the job seed and its id (63 bits; the same on every rank)."""
    digest = hashlib.blake2b(f"{base_seed}\0{id_key(rid)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


def request_params(cfg: JobConfig, base: SamplingParams, rec: PromptRecord) -> SamplingParams:
    """The request's SamplingParams: job flags, then the line's own fields. Raises ValueError.

    As with ``--temperature``, a line's ``temperature`` > 0 means sampling unless it sets
    ``do_sample`` itself. Sampled requests without a ``seed`` get :func:`derive_seed`.
    """
    opts = dict(rec.options)
    temperature = opts.pop("temperature", cfg.temperature)
    do_sample = opts.pop("do_sample", temperature > 0)
    if temperature <= 0 and not do_sample:
        temperature = base.temperature  # unused when greedy; keep SamplingParams valid
    params = base.replace(**opts, do_sample=do_sample, temperature=temperature)
    if params.do_sample and params.seed is None:
        params = params.replace(seed=derive_seed(cfg.seed, rec.id))
    params.validate()
    return params


def check_model(path: str) -> None:
    """Raise ``JobError(BAD_MODEL)`` unless ``path`` is a readable HF model folder (or a cached model id)."""
    if os.path.isdir(path):
        cfg_file = os.path.join(path, "config.json")
        try:
            with open(cfg_file, encoding="utf-8") as f:
                json.load(f)
        except (OSError, ValueError) as e:
            raise JobError(ExitCode.BAD_MODEL, f"cannot read model at {path}: {cfg_file}: {e}") from None
        return
    if os.path.exists(path) or path.startswith((".", "/", "~")) or path.count("/") > 1:
        raise JobError(ExitCode.BAD_MODEL, f"cannot read model at {path}: not a model folder")
    try:  # a hub id: accept it only from the local cache (never download here)
        from transformers import AutoConfig

        AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - any failure means "cannot read"
        raise JobError(
            ExitCode.BAD_MODEL, f"cannot read model {path!r}: no such folder ({type(e).__name__})"
        ) from None


# ---------------------------------------------------------------------------------- merge


def merge_results(records: Sequence[PromptRecord], out: str, *, include_out: bool) -> int:
    """Write ``out``: one result line per prompt, in input order; then remove the journals.

    Raises ``JobError(FAILED)`` (writing nothing) when some prompt has no result. Returns the
    number of lines written.
    """
    found = load_results(out, include_out=include_out)
    missing = [r.id for r in records if id_key(r.id) not in found]
    if missing:
        shown = ", ".join(map(repr, missing[:5])) + (" ..." if len(missing) > 5 else "")
        raise JobError(
            ExitCode.FAILED, f"{len(missing)} prompt(s) have no result ({shown}); rerun with --resume"
        )
    atomic_write_text(out, (json.dumps(found[id_key(r.id)], ensure_ascii=False) + "\n" for r in records))
    for path in journal_paths(out):
        os.remove(path)
    return len(records)


# ---------------------------------------------------------------------------------- claiming


class Claimer:
    """Hands out the indices ``0 .. n-1`` to whichever rank asks first, each exactly once.

    ``claim(k)`` is ONE atomic ``store.add(key, k)``: the new counter value ``v`` gives this
    caller the indices ``v-k .. v-1`` (cut at ``n``). Not collective; any rank, any time.
    """

    def __init__(self, store: Any, key: str, n: int) -> None:
        self.store, self.key, self.n = store, key, n
        self.exhausted = n == 0

    def claim(self, k: int) -> range:
        if self.exhausted or k <= 0:
            return range(0)
        hi = int(self.store.add(self.key, k))
        if hi >= self.n:
            self.exhausted = True
        return range(min(hi - k, self.n), min(hi, self.n))


def result_record(rec: PromptRecord, completion: Any) -> dict[str, Any]:
    """The result line for a completed request (also what the journal holds)."""
    out: dict[str, Any] = {
        "id": rec.id,
        "prompt": rec.prompt,
        "text": completion.text,
        "finish_reason": completion.finish_reason,
        "token_ids": completion.token_ids,
        "prompt_tokens": len(completion.prompt_token_ids),
        "generated_tokens": len(completion.token_ids),
        "rank": completion.rank,
    }
    if completion.seed is not None:
        out["seed"] = completion.seed
    if completion.logprobs is not None:
        out["logprobs"] = completion.logprobs
    return out


def error_record(rec: PromptRecord, err: Exception, rank: int) -> dict[str, Any]:
    return {"id": rec.id, "prompt": rec.prompt, "error": f"{type(err).__name__}: {err}", "rank": rank}


# ---------------------------------------------------------------------------------- the job on one rank

_JOB_SEQ = [0]


@dataclass
class RankReport:
    """What one rank did (gathered to rank 0 for the summary)."""

    rank: int
    prompts: int = 0
    errors: int = 0
    tokens: int = 0
    stats: dict[str, Any] = field(default_factory=dict)


def _plan(cfg: JobConfig, records: Sequence[PromptRecord]) -> dict[str, Any]:
    """Rank 0's view of what is left to do (broadcast to every rank, so all agree on indices)."""
    journals = journal_paths(cfg.out)
    if journals and not cfg.resume:
        return {
            "error": f"{journals[0]}: journals of an unfinished earlier run exist; pass --resume to "
            "continue it, or delete them to start over"
        }
    include_out = include_out_file(cfg.out, cfg.resume)
    done = load_results(cfg.out, include_out=include_out) if cfg.resume else {}
    pending = [i for i, r in enumerate(records) if id_key(r.id) not in done]
    return {"pending": pending, "include_out": include_out, "error": None}


def run_job(
    cfg: JobConfig, engine_cfg: EngineConfig, base: SamplingParams, records: Sequence[PromptRecord]
) -> dict[str, Any] | None:
    """Run the job on this rank; rank 0 returns the summary (others None). Collective.

    Every rank calls it once, with the same arguments: it broadcasts rank 0's plan, builds the
    engine (collective), serves claims until none are left, closes the engine (collective
    join), all-gathers the per-rank reports on the default group, and rank 0 merges.
    """
    import torch.distributed as dist

    from . import comm
    from .engine import Engine
    from .progress import Progress, summarize

    rank, world = dist.get_rank(), dist.get_world_size()
    if cfg.no_claim_ranks and all(r in cfg.no_claim_ranks for r in range(world)):
        raise JobError(ExitCode.USAGE, "every rank is in no_claim_ranks: nobody would claim a prompt")
    plan = _plan(cfg, records) if rank == 0 else None
    journal = None
    if rank == 0 and not plan["error"]:  # rank 0's journal (with the header) exists before any work
        journal = Journal(journal_path(cfg.out, 0), header={"include_out": plan["include_out"]})
    plan_box: list[Any] = [plan]
    dist.broadcast_object_list(plan_box, src=0)  # why: every rank must index the same pending list
    plan = plan_box[0]
    if plan["error"]:
        raise JobError(ExitCode.USAGE, plan["error"])
    pending: list[int] = plan["pending"]
    resumed = len(records) - len(pending)

    _JOB_SEQ[0] += 1
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefix = f"shardgen/job{_JOB_SEQ[0]}/attempt{restart}"
    store = comm.default_store()
    t_load = time.perf_counter()
    _quiet_transformers()
    engine = Engine.from_pretrained(
        cfg.model_path, dtype=None if cfg.dtype == "auto" else cfg.dtype, config=engine_cfg
    )
    load_s = time.perf_counter() - t_load
    if journal is None:
        journal = Journal(journal_path(cfg.out, rank))
    progress = Progress(
        store, prefix, total=len(records), initial=resumed, enabled=rank == 0 and not cfg.quiet
    )
    t0 = time.perf_counter()
    try:
        report = _serve(
            cfg,
            engine,
            base,
            records,
            pending,
            Claimer(store, f"{prefix}/next", len(pending)),
            journal,
            store,
            prefix,
            rank,
        )
        engine.close()
    finally:
        progress.stop()
        journal.close()
    wall_s = time.perf_counter() - t0
    report.stats = engine.stats()
    reports: list[Any] = [None] * world
    dist.all_gather_object(reports, dataclasses.asdict(report))  # after close(): every rank's work is done
    if rank != 0:
        return None
    merge_results(records, cfg.out, include_out=plan["include_out"])
    return summarize(
        reports,
        prompts=len(records),
        resumed=resumed,
        wall_s=wall_s,
        load_s=load_s,
        out=cfg.out,
        engine_cfg=engine_cfg,
    )


def _serve(
    cfg: JobConfig,
    engine: Any,
    base: SamplingParams,
    records: Sequence[PromptRecord],
    pending: Sequence[int],
    claimer: Claimer,
    journal: Journal,
    store: Any,
    prefix: str,
    rank: int,
) -> RankReport:
    """Keep about ``max_batch_size`` requests in flight: claim, submit, journal as they complete.

    With the engine's continuous refill, claims follow each completion (finished slots take the
    new requests); with ``refill=False`` the engine decodes in waves, so a rank claims a new wave
    only when its last one is over (claiming earlier would park prompts that another rank could
    run now).
    """
    report = RankReport(rank=rank)
    inflight: dict[Future, PromptRecord] = {}
    claims = rank not in cfg.no_claim_ranks
    away = cfg.away_rank == rank
    slots, refill = engine.config.max_batch_size, engine.config.refill

    def finish(rec: PromptRecord, result: dict[str, Any]) -> None:
        journal.append(result)  # durable before it counts as done
        report.prompts += 1
        report.errors += "error" in result
        report.tokens += result.get("generated_tokens", 0)
        store.add(f"{prefix}/done", 1)
        store.add(f"{prefix}/tokens", result.get("generated_tokens", 0))

    done: list[tuple[PromptRecord, dict[str, Any]]] = []
    while True:
        # Refill first, journal second: the driver admits the new requests while we fsync.
        free = slots - len(inflight)
        if not refill and inflight:
            free = 0  # an engine decoding in waves admits a new batch only once the running one is over
        if claims and free > 0 and not claimer.exhausted:
            for i in claimer.claim(free):
                rec = records[pending[i]]
                try:
                    params = request_params(cfg, base, rec)
                    inflight[engine.submit(rec.prompt, **dataclasses.asdict(params))] = rec
                except ValueError as e:  # a bad single request: answered with an error, the job goes on
                    done.append((rec, error_record(rec, e, rank)))
        for rec, result in done:
            finish(rec, result)
        done.clear()
        if away and inflight:
            away = False
            log.warning(
                "rank %d: main thread steps away for %.1fs (its driver keeps serving)", rank, cfg.away_s
            )
            time.sleep(cfg.away_s)
        if not inflight:
            if claimer.exhausted or not claims:
                return report
            continue
        finished, _ = wait(list(inflight), timeout=5.0, return_when=FIRST_COMPLETED)
        for fut in finished:
            rec = inflight.pop(fut)
            done.append((rec, result_record(rec, fut.result())))  # an engine failure raises here: fatal


def _quiet_transformers() -> None:
    with contextlib.suppress(Exception):
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()  # "sequence longer than the maximum": our error field says it
