"""Rank 0's view of a batch job: a global progress bar while it runs, a summary when it ends.

Ranks count completed prompts and generated tokens on the c10d store (``<prefix>/done``,
``<prefix>/tokens``, one ``store.add`` each per result); rank 0's progress thread reads
them with ``add(key, 0)`` a few times a second. Nothing here is collective.
"""

from __future__ import annotations

import threading
import time
from typing import Any


class Progress:
    """A tqdm bar of completed/total prompts with global tokens/s and ETA (rank 0 only)."""

    def __init__(
        self, store: Any, prefix: str, *, total: int, initial: int, enabled: bool, every: float = 0.5
    ):
        self._store, self._prefix, self._initial, self._every = store, prefix, initial, every
        self._stop = threading.Event()
        self._bar: Any = None
        self._thread: threading.Thread | None = None
        if not enabled:
            return
        from tqdm import tqdm

        self._bar = tqdm(total=total, initial=initial, unit="prompt", desc="shardgen run", dynamic_ncols=True)
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._loop, name="shardgen-progress", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self._every):
            self._refresh()

    def _refresh(self, draw: bool = True) -> None:
        done = int(self._store.add(f"{self._prefix}/done", 0))
        tokens = int(self._store.add(f"{self._prefix}/tokens", 0))
        elapsed = max(time.perf_counter() - self._t0, 1e-9)
        self._bar.n = self._initial + done
        self._bar.set_postfix_str(f"{tokens / elapsed:,.0f} tok/s", refresh=False)
        if draw:
            self._bar.refresh()

    def stop(self) -> None:
        if self._bar is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            self._refresh(draw=False)  # close() draws the final state once
        except Exception:  # the store may be gone after a failure; the bar is cosmetic
            pass
        self._bar.close()
        self._bar = None


def summarize(
    reports: list[dict[str, Any]],
    *,
    prompts: int,
    resumed: int,
    wall_s: float,
    load_s: float,
    out: str,
    engine_cfg: Any,
    shard_size: int | None = None,
) -> dict[str, Any]:
    """The job's numbers from every rank's report (``RankReport`` as a dict, ``stats`` inside)."""
    stats = [r["stats"] for r in reports]
    tokens = sum(r["tokens"] for r in reports)
    busy = [s["busy_s"] for s in stats]
    forwards = sum(s["forwards"] for s in stats)
    shadows = sum(s["shadow_forwards"] for s in stats)
    serving = [b for r, b in zip(reports, busy, strict=True) if r["prompts"] > 0]
    total_busy = sum(busy) or 1.0
    return {
        "prompts": prompts,
        "completed": sum(r["prompts"] for r in reports),
        "resumed": resumed,
        "errors": sum(r["errors"] for r in reports),
        "generated_tokens": tokens,
        "wall_s": round(wall_s, 3),
        "load_s": round(load_s, 3),
        "tokens_per_s": round(tokens / wall_s, 1) if wall_s > 0 else 0.0,
        "ticks": max(s["ticks"] for s in stats),
        "shadow_forward_share": round(shadows / (forwards + shadows), 4) if forwards + shadows else 0.0,
        # spread of busy time among the ranks that served prompts: (max - min) / max
        "busy_spread": round((max(serving) - min(serving)) / max(serving), 4)
        if serving and max(serving)
        else 0.0,
        "world_size": len(reports),
        "backend": engine_cfg.backend,
        "gather": engine_cfg.gather,
        # what the engines' `auto` chose (each replica's engine chooses; the ranks of one agree)
        "gather_used": " / ".join(dict.fromkeys(s["gather"] for s in stats if "gather" in s)) or None,
        "max_batch_size": engine_cfg.max_batch_size,
        "out": out,
        "shard_size": shard_size or len(reports),
        "replicas": _replicas(reports),
        "ranks": [
            {
                "rank": r["rank"],
                "prompts": r["prompts"],
                "errors": r["errors"],
                "tokens": r["tokens"],
                "busy_s": round(s["busy_s"], 3),
                "busy_share": round(s["busy_s"] / total_busy, 4),
                "busy_of_wall": round(s["busy_s"] / wall_s, 4) if wall_s > 0 else 0.0,
                "forwards": s["forwards"],
                "shadow_forwards": s["shadow_forwards"],
            }
            for r, s in zip(reports, stats, strict=True)
        ],
    }


def _replicas(reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Prompts and tokens per replica (``--shard-size``: one engine per replica, as the engines
    report their ranks), in rank order."""
    out: dict[tuple[int, ...], dict[str, Any]] = {}
    for r in reports:
        key = tuple(r.get("engine_ranks") or [x["rank"] for x in reports])
        rep = out.setdefault(key, {"ranks": list(key), "prompts": 0, "tokens": 0})
        rep["prompts"] += r["prompts"]
        rep["tokens"] += r["tokens"]
    return [out[k] for k in sorted(out)]


def _gather(s: dict[str, Any]) -> str:
    """``auto (chose once)``: the gather setting and, where it differs, what the engines used."""
    used = s.get("gather_used")
    return s["gather"] if used in (None, s["gather"]) else f"{s['gather']} (chose {used})"


def format_summary(s: dict[str, Any]) -> str:
    """The summary as a plain-text table (printed by rank 0 unless ``--quiet``)."""
    head = [
        (
            "prompts",
            f"{s['prompts']} ({s['completed']} this run, {s['resumed']} resumed, {s['errors']} errors)",
        ),
        ("generated tokens", f"{s['generated_tokens']:,}"),
        ("wall time", f"{s['wall_s']:.2f} s (+ {s['load_s']:.2f} s loading)"),
        ("tokens/s", f"{s['tokens_per_s']:,.1f}"),
        ("ticks", f"{s['ticks']:,}"),
        ("shadow-forward share", f"{100 * s['shadow_forward_share']:.1f}%"),
        ("busy spread", f"{100 * s['busy_spread']:.1f}% (max-min)/max over ranks that served prompts"),
        ("ranks", f"{s['world_size']} x {s['backend']} (gather {_gather(s)}, batch {s['max_batch_size']})"),
        ("results", s["out"]),
    ]
    if len(s.get("replicas", ())) > 1:
        per = ", ".join(f"{rep['prompts']} (ranks {rep['ranks']})" for rep in s["replicas"])
        head.insert(-1, ("prompts per replica", f"{len(s['replicas'])} x {s['shard_size']} ranks: {per}"))
    width = max(len(k) for k, _ in head)
    lines = [f"{k:<{width}}  {v}" for k, v in head]
    cols = ("rank", "prompts", "tokens", "busy s", "busy share", "busy/wall", "forwards", "shadow")
    lines.append("")
    lines.append("  ".join(f"{c:>10}" for c in cols))
    for r in s["ranks"]:
        row = (
            r["rank"],
            r["prompts"],
            r["tokens"],
            f"{r['busy_s']:.2f}",
            f"{100 * r['busy_share']:.1f}%",
            f"{100 * r['busy_of_wall']:.1f}%",
            r["forwards"],
            r["shadow_forwards"],
        )
        lines.append("  ".join(f"{v!s:>10}" for v in row))
    return "\n".join(lines)
