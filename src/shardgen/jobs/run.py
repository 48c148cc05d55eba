"""Batch jobs: hand prompts out dynamically, journal results durably, merge, resume.

    shardgen run --prompts prompts.jsonl --out results.jsonl --nproc 4
    torchrun --nproc-per-node 4 -m shardgen run --prompts prompts.jsonl --out results.jsonl

The prompts file is read and checked by :mod:`shardgen.jobs.prompts`. Everything that touches
files is plain Python (unit-testable without processes); the distributed part is
:func:`run_job`, called once on every rank.

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
import json
import math
import os
import pickle
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Any

from shardgen.config import EngineConfig, JobConfig
from shardgen.core.process import uninterrupted
from shardgen.core.timeline import Span
from shardgen.errors import ExitCode, JobError
from shardgen.jobs.journal import (
    Journal,
    atomic_write_text,
    id_key,
    include_out_file,
    journal_path,
    journal_paths,
    load_results,
)
from shardgen.jobs.prompts import PromptRecord
from shardgen.loading.paths import missing_model_path
from shardgen.log import get_logger

log = get_logger()


def check_model(path: str) -> None:
    """Raise ``JobError(BAD_MODEL)`` unless ``path`` is a readable HF model folder (or a cached model id)."""
    if os.path.isdir(path):
        cfg_file = os.path.join(path, "config.json")
        where = f"cannot read model at {path}"
        if not os.path.exists(cfg_file):
            raise JobError(ExitCode.BAD_MODEL, f"{where}: no config.json in it (not a HF model folder)")
        try:
            with open(cfg_file, encoding="utf-8") as f:
                json.load(f)
        except OSError as e:
            raise JobError(ExitCode.BAD_MODEL, f"{where}: {cfg_file}: {e.strerror}") from None
        except ValueError as e:
            raise JobError(ExitCode.BAD_MODEL, f"{where}: {cfg_file} is not valid JSON ({e})") from None
        return
    if os.path.exists(path):
        raise JobError(ExitCode.BAD_MODEL, f"cannot read model at {path}: a file, not a model folder")
    missing = missing_model_path(path)
    if missing is not None:
        raise JobError(ExitCode.BAD_MODEL, missing)
    try:  # a hub id: accept it only from the local cache (never download here)
        from transformers import AutoConfig

        AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - any failure means "cannot read"
        raise JobError(
            ExitCode.BAD_MODEL,
            f"model {path!r} does not exist: no such folder, nor a model in the local Hugging Face "
            f"cache ({type(e).__name__})",
        ) from None


def model_vocab_size(path: str) -> int | None:
    """The vocabulary size in the config of the model folder ``path`` (None: no folder, no
    readable config, or no ``vocab_size`` in it; ``check_model`` says what is wrong)."""
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    for c in (cfg, cfg.get("text_config") or {}) if isinstance(cfg, dict) else ():
        if isinstance(c, dict) and isinstance(c.get("vocab_size"), int):
            return c["vocab_size"]
    return None


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

    ``claim(k)`` is ONE atomic ``store.add(key, k')`` (after a read of the counter): the new
    counter value ``v`` gives this caller the indices ``v-k' .. v-1`` (cut at ``n``). ``k'`` is
    ``k`` capped at ``ceil(unclaimed / ranks)``, so that what is left is shared among the
    ``ranks`` claiming ranks: on a small job the first rank to claim does not take a whole batch
    while the others get the rest (20 prompts, 2 ranks, batch 16: 10 and 5, then smaller claims,
    not 16 and 4). Not collective; any rank, any time.
    """

    def __init__(self, store: Any, key: str, n: int, ranks: int = 1) -> None:
        self.store, self.key, self.n, self.ranks = store, key, n, max(1, ranks)
        self.exhausted = n == 0

    def share(self) -> int:
        """The most one claim takes now: ``ceil(unclaimed / ranks)``, at least 1."""
        if self.ranks == 1:
            return self.n
        unclaimed = self.n - int(self.store.add(self.key, 0))
        return max(1, math.ceil(unclaimed / self.ranks))

    def claim(self, k: int) -> range:
        if self.exhausted or k <= 0:
            return range(0)
        k = min(k, self.share())
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
    engine_ranks: list[int] = field(default_factory=list)  # the ranks its engine spans (a replica)
    prompts: int = 0
    errors: int = 0
    tokens: int = 0
    stats: dict[str, Any] = field(default_factory=dict)
    spans: list[Any] = field(default_factory=list)  # the driver's timeline (--timeline), from t0


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
    if cfg.claim_order == "longest":
        pending = longest_first(records, pending)
    return {"pending": pending, "include_out": include_out, "error": None}


def longest_first(records: Sequence[PromptRecord], pending: Sequence[int]) -> list[int]:
    """``pending`` in claim order: the most expected work first, input order among equals.

    A rank's busy time ends with its last request; a long request claimed last makes that
    rank finish alone. Claiming the longest first leaves short requests for the end, where
    they even out the ranks (longest-processing-time-first scheduling). Expected work: the
    request's ``max_new_tokens`` (the bound on its decode steps; unset counts as the largest, as
    the model's default bounds it), then its prompt length (the prefill's cost). Requests alike
    in both keep their input order: this helps only where the bounds tell requests apart.
    """

    def key(i: int) -> tuple[float, int, int]:
        bound = records[i].params.max_new_tokens
        return (-(math.inf if bound is None else bound), -len(records[i].prompt), i)

    return sorted(pending, key=key)


def run_job(
    cfg: JobConfig, engine_cfg: EngineConfig, records: Sequence[PromptRecord]
) -> tuple[dict[str, Any], dict[str, list[Span]]] | None:
    """Run the job on this rank; rank 0 returns the summary and, with ``cfg.timeline``, each
    rank's timeline (``{"rank 0": spans, ...}``, from the job's start) to draw; others None.
    Collective.

    Every rank calls it once, with the same arguments: it broadcasts rank 0's plan, builds the
    engine (collective), serves claims until none are left, closes the engine (collective
    join), sends the per-rank reports to rank 0 through the store, and rank 0 merges.
    """
    import torch.distributed as dist

    from shardgen.core import comm
    from shardgen.core.engine import Engine
    from shardgen.core.groups import replica_group
    from shardgen.jobs.progress import Progress, summarize

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
    if cfg.timeline:
        engine_cfg = dataclasses.replace(engine_cfg, timeline=True)
    try:  # collective on the world (new_group): every rank, here
        group, _ = replica_group(cfg.shard_size) if cfg.shard_size else (None, 0)
    except ValueError as e:
        raise JobError(ExitCode.USAGE, str(e)) from None
    engine = Engine.from_pretrained(
        cfg.model_path, dtype=None if cfg.dtype == "auto" else cfg.dtype, config=engine_cfg, group=group
    )
    load_s = time.perf_counter() - t_load
    if journal is None:
        journal = Journal(journal_path(cfg.out, rank))
    progress = Progress(
        store, prefix, total=len(records), initial=resumed, enabled=rank == 0 and not cfg.quiet
    )
    claimers = len(set(range(world)) - set(cfg.no_claim_ranks))
    t0 = time.perf_counter()
    try:
        report = _serve(
            cfg,
            engine,
            records,
            pending,
            Claimer(store, f"{prefix}/next", len(pending), ranks=claimers),
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
    report.stats, report.engine_ranks = engine.stats(), engine.ranks
    report.spans = [(max(a - t0, 0.0), b - t0, k) for a, b, k in engine.timeline() if b > t0]
    # The reports go to rank 0 through the store, not a gloo collective: a rank other than 0
    # exits right after, and a gloo worker still releasing a just-finished collective's tensors
    # then needs the GIL while the interpreter finalizes (docs/RELIABILITY.md, "Clean exits").
    store.set(f"{prefix}/report/{rank}", pickle.dumps(dataclasses.asdict(report)))
    if rank != 0:
        return None
    reports: list[Any] = [pickle.loads(store.get(f"{prefix}/report/{r}")) for r in range(world)]
    for r in range(world):
        store.delete_key(f"{prefix}/report/{r}")
    with uninterrupted():  # a SIGINT / SIGTERM now ends the job after the merge, not amid it
        merge_results(records, cfg.out, include_out=plan["include_out"])
    rows = {f"rank {r['rank']}": r.pop("spans") for r in reports}
    summary = summarize(
        reports,
        prompts=len(records),
        resumed=resumed,
        wall_s=wall_s,
        load_s=load_s,
        out=cfg.out,
        engine_cfg=engine.config,  # max_batch_size as the engine sized it
        shard_size=cfg.shard_size or world,
    )
    return summary, (rows if cfg.timeline else {})


def _serve(
    cfg: JobConfig,
    engine: Any,
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
                    inflight[engine.submit(rec.prompt, rec.params)] = rec
                except ValueError as e:  # a bad single request: answered with an error, the job goes on
                    done.append((rec, error_record(rec, e, rank)))
        for rec, result in done:
            finish(rec, result)
        done.clear()
        if away and inflight:
            away = False
            log.info("rank %d: main thread steps away for %.1fs (its driver keeps serving)", rank, cfg.away_s)
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
