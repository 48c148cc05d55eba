"""``shardgen bench``: every way to generate with a sharded model, side by side, in one run.

    shardgen bench                                   # world sizes 2 and 4, every method
    shardgen bench --world-sizes 2 --methods hf_synced sg_fsdp2 local --json b.json --timeline b.png
    shardgen bench --world-sizes 2 --prompts-per-rank 4 --batch-size 2      # a quick one

One model (the shipped toy model), one workload (its skewed prompts), one run: for each world
size, ``launch`` spawns the ranks (gloo on CPU, the launcher ``shardgen run --nproc`` uses) and
each rank runs every method in turn (:mod:`shardgen.bench.methods`). The table gives useful
tokens/s (answer tokens up to EOS, over the wall time), wall time, forwards and wasted
forwards (padding calls, steps after a batch's last EOS, shadow forwards) summed over ranks,
the peak parameter memory per rank (estimated from the layout: shard + the largest unit a
forward gathers, or the whole model), and each method's time as a multiple of the ``local``
floor (an unsharded replica per rank). ``--timeline`` draws one PNG per world size, one row
per method and rank.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any

from shardgen.bench.methods import METHODS
from shardgen.config import LOG_LEVELS
from shardgen.errors import ExitCode, JobError


@dataclass(kw_only=True)
class BenchConfig:
    """Every generation method on one model (the shipped toy model) and one workload (its skewed
    prompts), world sizes side by side: a table of useful tokens/s, wall time, forwards, wasted
    forwards, parameter memory per rank and each method's time as a multiple of the local floor."""

    world_sizes: list[int] = field(default_factory=lambda: [2, 4])
    """World sizes to run, one after another (gloo ranks on this machine)."""
    methods: list[str] = field(default_factory=lambda: list(METHODS), metadata={"choices": METHODS})
    """Methods to compare, in this order (each described below)."""
    prompts_per_rank: int = 32
    """Skewed toy prompts each rank generates for (the same split for every method)."""
    batch_size: int = 8
    """Requests per batch (HF calls) or in flight (shardgen) on each rank."""
    max_new_tokens: int = 26
    """Most tokens per answer (the longest toy answer is 25 numbers + EOS)."""
    json: str | None = None
    """Also write the results as JSON to this file."""
    timeline: str | None = None
    """Draw the per-rank timelines to this PNG (one file per world size: NAME-w2.png, ...;
    needs matplotlib: pip install 'shardgen[plot]')."""
    timeout: float = 900.0
    """Give up on a world size after this many seconds."""
    quiet: bool = False
    """Print the table and errors only: no progress lines, no log lines."""
    log_level: str | None = field(default=None, metadata={"choices": LOG_LEVELS})
    """Log lines shown (rank 0; the other ranks show warnings and errors): unset is warning (error
    with --quiet), or SHARDGEN_LOG_LEVEL when set."""
    rank_out: str | None = field(default=None, metadata={"hidden": True})
    """Where rank 0 writes its world's outcomes (set by the launcher side)."""

    def validate(self) -> None:
        unknown = sorted(set(self.methods) - set(METHODS))
        if unknown:
            raise ValueError(f"unknown method(s) {', '.join(unknown)}; known: {', '.join(METHODS)}")
        if any(w < 1 for w in self.world_sizes):
            raise ValueError(f"world sizes must be >= 1, got {self.world_sizes}")
        for name in ("prompts_per_rank", "batch_size", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def cmd_bench(cfg: BenchConfig) -> int:
    """The launcher side (spawns each world) or, when ``RANK`` is set, one rank of a world."""
    from shardgen.flags import flag_names
    from shardgen.launch import is_rank, launch

    try:
        cfg.validate()
    except ValueError as e:
        raise JobError(ExitCode.USAGE, flag_names(str(e), ((BenchConfig, None),))) from None
    if is_rank():
        return run_rank(cfg)
    if cfg.timeline:
        from shardgen.bench.plot import pyplot

        try:
            pyplot()  # the install hint now, not after minutes of benchmarking
        except ImportError as e:
            raise JobError(ExitCode.USAGE, str(e)) from None
    from shardgen.flags import to_argv

    results: dict[str, Any] = {"config": dataclasses.asdict(cfg), "worlds": {}}
    with tempfile.TemporaryDirectory(prefix="shardgen-bench-") as tmp:
        for world in cfg.world_sizes:
            rank_out = os.path.join(tmp, f"w{world}.json")
            one = dataclasses.replace(cfg, world_sizes=[world], rank_out=rank_out, json=None, timeline=None)
            if not cfg.quiet:
                print(f"shardgen bench: {world} ranks, {', '.join(cfg.methods)}", file=sys.stderr, flush=True)
            env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
            rc = launch(["bench", *to_argv(one)], world, timeout=cfg.timeout, env=env)
            if rc != ExitCode.OK:
                raise JobError(rc, f"the {world}-rank benchmark failed (see the messages above)")
            with open(rank_out, encoding="utf-8") as f:
                results["worlds"][str(world)] = summarize(json.load(f))
    print(format_table(results), flush=True)
    if cfg.json:
        from shardgen.jobs.journal import atomic_write_text

        atomic_write_text(cfg.json, [json.dumps(results, indent=1) + "\n"])
    if cfg.timeline:
        draw_timelines(results, cfg.timeline)
    return ExitCode.OK


def run_rank(cfg: BenchConfig) -> int:
    """One rank: every method in turn, outcomes gathered to rank 0. Collective."""
    import torch
    import torch.distributed as dist

    from shardgen.bench.methods import make_workload, run_method
    from shardgen.core import comm
    from shardgen.launch import die_with_parent

    die_with_parent()
    torch.set_num_threads(1)
    comm.init()
    _quiet()
    rank, world = dist.get_rank(), dist.get_world_size()
    work = make_workload(cfg.prompts_per_rank, cfg.batch_size, cfg.max_new_tokens, rank, world)
    outcomes = []
    for name in cfg.methods:
        out = run_method(name, work)
        if rank == 0 and not cfg.quiet:
            note = out.error or f"{out.wall_s:.2f}s"
            print(f"shardgen bench: {world} ranks: {name}: {note}", file=sys.stderr, flush=True)
        outcomes.append(dataclasses.asdict(out))
    # Through the store, not a gloo collective, as at the end of ``shardgen run`` (see
    # jobs/run.py): the final barrier's work holds no tensor of Python's, so no gloo worker
    # needs the GIL once a rank heads into interpreter exit.
    store = comm.default_store()
    store.set(f"shardgen/bench/outcomes/{rank}", pickle.dumps(outcomes))
    gathered: list[Any] = []
    if rank == 0:
        gathered = [pickle.loads(store.get(f"shardgen/bench/outcomes/{r}")) for r in range(world)]
    if rank == 0 and cfg.rank_out:
        with open(cfg.rank_out, "w", encoding="utf-8") as f:
            json.dump({"world": world, "methods": cfg.methods, "ranks": gathered}, f)
    dist.barrier()
    dist.destroy_process_group()
    return ExitCode.OK


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    """Per method: the numbers of the table, summed or maxed over ranks, plus each rank's spans."""
    rows: dict[str, Any] = {}
    for i, name in enumerate(raw["methods"]):
        per_rank = [r[i] for r in raw["ranks"]]
        err = next((o["error"] for o in per_rank if o["error"]), None)
        if err:
            rows[name] = {"error": err}
            continue
        wall = max(o["wall_s"] for o in per_rank)
        useful = sum(o["useful_tokens"] for o in per_rank)
        rows[name] = {
            "useful_tok_s": useful / wall,
            "wall_s": wall,
            "forwards": sum(o["forwards"] for o in per_rank),
            "wasted_forwards": sum(o["wasted_forwards"] for o in per_rank),
            "peak_param_mib": max(o["peak_param_bytes"] for o in per_rank) / 2**20,
            "wrong_answers": sum(o["wrong"] for o in per_rank),
            "spans": {str(o["rank"]): o["spans"] for o in per_rank},
        }
    floor = rows.get("local", {}).get("wall_s")
    for row in rows.values():
        if "wall_s" in row and floor:
            row["x_floor"] = row["wall_s"] / floor
    return {"world": raw["world"], "methods": rows}


def format_table(results: dict[str, Any]) -> str:
    """A plain-text table, one block per world size."""
    names = [n for res in results["worlds"].values() for n in res["methods"]]
    w = max([15, *map(len, names)])  # the widest method name (sg_fsdp2_stationary is 19)
    head = f"{'method':{w}} {'useful tok/s':>12} {'wall s':>8} {'forwards':>9} {'wasted':>8} "
    head += f"{'param MiB/rank':>14} {'x floor':>8} {'wrong':>6}"
    lines = []
    for world, res in results["worlds"].items():
        lines += [f"{world} ranks (gloo, CPU)", head, "-" * len(head)]
        for name, r in res["methods"].items():
            if "error" in r:
                lines.append(f"{name:{w}} n/a: {r['error'][:90]}")
                continue
            x = f"{r['x_floor']:.2f}" if "x_floor" in r else "-"
            lines.append(
                f"{name:{w}} {r['useful_tok_s']:12.1f} {r['wall_s']:8.2f} {r['forwards']:9d} "
                f"{r['wasted_forwards']:8d} {r['peak_param_mib']:14.2f} {x:>8} {r['wrong_answers']:6d}"
            )
        lines.append("")
    return "\n".join(lines)


def draw_timelines(results: dict[str, Any], path: str) -> list[str]:
    """One PNG per world size (``NAME-w2.png``), a row per method and rank; returns the paths."""
    from shardgen.bench.plot import plot

    stem, ext = os.path.splitext(path)
    written = []
    for world, res in results["worlds"].items():
        rows = {
            f"{name} r{rank}": [tuple(s) for s in spans]
            for name, r in res["methods"].items()
            for rank, spans in r.get("spans", {}).items()
        }
        out = f"{stem}-w{world}{ext or '.png'}"
        plot(rows, out, title=f"shardgen bench: {world} ranks", origin=dict.fromkeys(rows, 0.0))
        written.append(out)
    return written


def _quiet() -> None:
    import contextlib
    import logging

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for name in ("DeepSpeed", "deepspeed", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.WARNING)
    with contextlib.suppress(Exception):
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
