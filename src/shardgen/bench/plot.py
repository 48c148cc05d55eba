"""Timelines as PNGs: one horizontal bar per rank, its spans (:mod:`shardgen.core.timeline`)
coloured by kind. Used by ``shardgen bench --timeline`` and ``shardgen run --timeline``;
needs matplotlib (``pip install 'shardgen[plot]'``), imported only when drawing."""

from __future__ import annotations

from typing import Any

from shardgen.core.timeline import KINDS, Span

COLORS = {
    "prefill": "#1f77b4",
    "refill": "#17becf",
    "decode": "#2ca02c",
    "score": "#bcbd22",
    "shadow": "#d62728",
    "gather": "#9467bd",
    "release": "#8c564b",
    "tick": "#bbbbbb",
    "idle": "#eeeeee",
    "paused": "#ff7f0e",
}


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
