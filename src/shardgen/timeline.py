"""What each rank's driver did over time: ``(t0, t1, kind)`` spans, and a PNG with one row per rank.

Recording is off by default (``EngineConfig(timeline=True)`` turns it on); when on, the driver
appends one tuple per tick phase (a list append: no locks, no I/O), and ``engine.timeline()``
returns the spans, in seconds on this process's ``time.perf_counter()`` clock. Spans of
different ranks are put on one axis by subtracting each rank's own start time, which is
taken right after a collective, so the ranks' origins agree to within that collective's skew.

Kinds: ``prefill``, ``refill`` (a prefill joining a running batch) and ``decode`` (real
forwards), ``shadow`` (a forward that only joins the peers' parameter collectives),
``gather``/``release`` (whole-model gathers of ``gather='once'``), ``tick`` (the tick's
all-reduce: where a rank waits for slower peers), ``idle`` (nobody has work) and ``paused``.
Per-layer gathers happen inside forwards and are not separate spans.
"""

from __future__ import annotations

import time
from typing import Any

KINDS = ("prefill", "refill", "decode", "shadow", "gather", "release", "tick", "idle", "paused")
COLORS = {
    "prefill": "#1f77b4",
    "refill": "#17becf",
    "decode": "#2ca02c",
    "shadow": "#d62728",
    "gather": "#9467bd",
    "release": "#8c564b",
    "tick": "#bbbbbb",
    "idle": "#eeeeee",
    "paused": "#ff7f0e",
}
Span = tuple[float, float, str]


class Timeline:
    """One rank's spans. ``add`` is a no-op unless enabled; owned by the thread that records."""

    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled
        self.spans: list[Span] = []

    def add(self, t0: float, t1: float, kind: str) -> None:
        if not self.enabled:
            return
        spans = self.spans
        if spans and spans[-1][2] == kind and t0 - spans[-1][1] < 1e-4:
            spans[-1] = (spans[-1][0], t1, kind)  # one span for a run of same-kind ticks (idle)
        else:
            spans.append((t0, t1, kind))

    def since(self, t0: float, kind: str) -> float:
        """Record ``[t0, now)`` as ``kind``; return now (the next span's start)."""
        t1 = time.perf_counter()
        self.add(t0, t1, kind)
        return t1


def totals(spans: list[Span]) -> dict[str, float]:
    """Seconds per kind."""
    out: dict[str, float] = {}
    for t0, t1, kind in spans:
        out[kind] = out.get(kind, 0.0) + (t1 - t0)
    return out


def merge_adjacent(spans: list[Span], gap: float = 1e-4) -> list[Span]:
    """Join consecutive spans of one kind (fewer rectangles to draw for thousands of ticks)."""
    out: list[Span] = []
    for t0, t1, kind in sorted(spans):
        if out and out[-1][2] == kind and t0 - out[-1][1] <= gap:
            out[-1] = (out[-1][0], max(out[-1][1], t1), kind)
        else:
            out.append((t0, t1, kind))
    return out


def plot(
    rows: dict[str, list[Span]], path: str, title: str = "", origin: dict[str, float] | None = None
) -> None:
    """Draw one horizontal bar per row (e.g. ``"rank 0"``) with its spans coloured by kind.

    ``origin`` gives each row's time zero (default: its first span's start). Needs matplotlib
    (``pip install 'shardgen[plot]'``).
    """
    plt = pyplot()
    from matplotlib.patches import Patch

    names = list(rows)
    fig, ax = plt.subplots(figsize=(11, 0.5 + 0.45 * max(1, len(names))))
    seen: set[str] = set()
    for y, name in enumerate(names):
        spans = merge_adjacent(rows[name])
        zero = (origin or {}).get(name, spans[0][0] if spans else 0.0)
        by_kind: dict[str, list[tuple[float, float]]] = {}
        for t0, t1, kind in spans:
            by_kind.setdefault(kind, []).append((t0 - zero, t1 - t0))
        for kind, bars in by_kind.items():
            ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=COLORS.get(kind, "#000000"), linewidth=0)
            seen.add(kind)
    ax.set_yticks(range(len(names)), labels=names)
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    if title:
        ax.set_title(title, fontsize=9)
    handles = [Patch(color=COLORS[k], label=k) for k in KINDS if k in seen]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only; never a window
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError(
            "drawing a timeline needs matplotlib: pip install 'shardgen[plot]' (or: pip install matplotlib)"
        ) from None
    return plt
