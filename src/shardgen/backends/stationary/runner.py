"""Weight-stationary forwards: no weight of a stationary linear, embedding or head ever moves.

:class:`Stationary` runs one of shardgen's forwards (real or shadow) with the layout of
``layout.py``: the backend's gathering hooks set aside (``Source.aside``), each stationary
module's ``forward`` replaced by its exchange (``exchange.py``), the kept parameters swapped in
(gathered once, kept until :meth:`Stationary.invalidate`: a pause may change the weights), and
each fallback module gathered for its call and released after. Nothing is materialized beyond
the kept parameters, the cut rows and one fallback module at a time.

Token counts are agreed, not guessed: the driver hands each forward the ``(tokens, head_rows)``
of every rank's forward from the tick (``shapes``); a linear with rule ``body`` holds
``tokens`` tokens, one with rule ``rows`` (the LM head) ``head_rows``. A rank whose agreed
count is 0 is running a shadow forward: its modules contribute zero rows and return zeros,
through the same collectives in the same order. A real forward that feeds a module another
count than agreed raises ``RuntimeError`` before that module's first collective.

Collective contract of :meth:`Stationary.forward` (every rank of the parameter group, in the
same tick, in the same order): first, once after construction or :meth:`invalidate`, one
all-gather per dtype of the kept parameters, then one of the cut rows' fragments (if any);
then, in module call order: two collectives per exchange group (an all-to-all that brings
every rank every other rank's input rows, issued without waiting so that this rank's own
tokens' columns are computed meanwhile, and waited before the all-to-all of the outputs),
two per embedding call (the ids, the rows), one all-gather per dtype per fallback call. The
call order is the module structure's (HF decoders call every module once per forward, whatever
the batch), so a 1x1 shadow issues what any real forward does.

A model with towers (``backends/towers.py``): the towers a forward runs are agreed in the tick
(``towers``), and every rank runs each of them (on its shadow input where its own inputs lack
it), so their modules' calls match too. A tower's token counts are not in ``shapes``: a module
of rule ``"free"`` (``layout.py``) holds whatever its input holds, and its exchange first
all-gathers every rank's count (one more collective, ``exchange.gather_counts``: three per
exchange group, three per embedding call). An encoder-decoder's gated linears (cross-attention
keys and values) exchange in every forward that runs the encoder: a rank whose decoder reads
them from its cache issues their exchanges with no rows just before their follower's; in a
forward that runs no encoder only a shadow forward calls them, which computes zeros locally.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardgen.backends.buffer_pool import trim_heap
from shardgen.backends.lookups import looking_up, own_forward, stand_in
from shardgen.backends.stationary import exchange as ex
from shardgen.backends.stationary.layout import (
    EmbeddingSpec,
    FallbackSpec,
    Layout,
    LinearSpec,
    Source,
    classify,
    overridden,
    probe,
    swapped,
)
from shardgen.backends.stationary.shards import CutRows, gather_full, local_rows
from shardgen.backends.towers import Tower
from shardgen.log import get_logger

log = get_logger()


class _Forward:
    """Per-forward state: the agreed counts and the outputs of groups waiting for their members."""

    def __init__(self, shapes: list[tuple[int, int]], rank: int, towers: int) -> None:
        self.counts = {"body": [t for t, _ in shapes], "rows": [r for _, r in shapes]}
        self.pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(module) -> (input, output)
        self.shadow = tuple(shapes[rank]) == (0, 0)  # this rank's forward is a shadow
        self.towers = towers  # the towers every rank's forward runs (agreed)
        self.gated: set[int] = set()  # the gated groups exchanged so far


class Stationary:
    """The weight-stationary mode of one sharded model. Built by a backend (``create``)."""

    def __init__(self, model: nn.Module, source: Source, layout: Layout) -> None:
        self.model, self.source, self.layout = model, source, layout
        self.cut = CutRows(
            [s.shard for s in layout.linears.values()] + [s.shard for s in layout.embeddings.values()]
        )
        self.kept: list[torch.Tensor] | None = None  # full values of layout.kept, while kept
        self._kept_at = {id(r): i for i, r in enumerate(layout.kept)}
        world = source.world
        # Per group: the widths of each rank's columns of each of its linears.
        self._parts = [
            [[b - a for a, b in (s.shard.row_ranges()[r] for s in g)] for r in range(world)]
            for g in layout.groups
        ]
        self._fw: _Forward | None = None
        self.forwards = 0
        self.free_exchanges = 0  # exchanges sized at the call (a tower's, cross-attention's)

    @classmethod
    def create(cls, model: nn.Module, source: Source, towers: tuple[Tower, ...] = ()) -> Stationary:
        """Classify and probe ``model`` with its ``towers`` (local, no collective); log what falls back."""
        layout = classify(model, source)
        probe(model, layout, source, towers)
        d = layout.describe()
        log.info(
            "shardgen: gather='stationary': %d linears in %d exchanges (shared: %s), embeddings %s, "
            "%d small parameters kept (%.2f MB); fallback per module: %s; sized at the call: %d",
            d["linears"], d["exchanges"], d["groups"] or "none", d["embeddings"] or "none",
            d["kept"], d["kept_bytes"] / 2**20, d["fallbacks"] or "none", len(d["free"]),
        )  # fmt: skip
        return cls(model, source, layout)

    # ------------------------------------------------------------------ kept state
    def invalidate(self) -> None:
        """Drop the kept parameters and cut rows (a pause may change the weights); the next
        stationary forward gathers them again. Local."""
        self.kept = None
        self.cut.clear()

    def kept_bytes(self) -> int:
        """Bytes of full parameters held between forwards (kept parameters and cut rows)."""
        total = sum(t.numel() * t.element_size() for t in self.kept or ())
        return total + sum(t.numel() * t.element_size() for t in (self.cut.rows or {}).values())

    def _ensure(self) -> None:
        """Collective on the parameter group when nothing is kept (see the module docstring)."""
        src = self.source
        if self.kept is None:
            self.kept = gather_full([r.shard for r in self.layout.kept], src.group, src.device)
        self.cut.ensure(src.group, src.device)

    # ------------------------------------------------------------------ the forward
    def forward(self, shapes: list[tuple[int, int]], call: Any, towers: int = 0) -> Any:
        """Run ``call()`` (the model's forward) as a stationary forward with the agreed ``shapes``
        (``(tokens, head_rows)`` per rank; ``(0, 0)`` for a shadow) and ``towers`` (the agreed bits:
        those every rank's forward runs). Collective on the parameter group (see the module
        docstring): every rank, the same tick."""
        layout = self.layout
        assert len(shapes) == self.source.world, (shapes, self.source.world)
        with torch.no_grad(), self.source.aside():
            self._ensure()
            assert self.kept is not None
            places = [(m, n, t) for r, t in zip(layout.kept, self.kept, strict=True) for m, n in r.places]
            forwards = [(s.module, self._linear_fn(s)) for s in layout.linears.values()]
            forwards += [(s.module, self._embedding_fn(s)) for s in layout.embeddings.values()]
            forwards += [(s.module, self._fallback_fn(s)) for s in layout.fallbacks.values()]
            self._fw = _Forward(shapes, self.source.rank, towers)
            try:
                with swapped(places), overridden(forwards):
                    out = call()
                assert not self._fw.pending, f"grouped outputs never used: {list(self._fw.pending)}"
                self.forwards += 1
                if self.source.device.type == "cpu":
                    trim_heap()  # the forward's freed temporaries back to the OS (buffer_pool.trim_heap)
                return out
            finally:
                self._fw = None

    def _counts(self, spec: Any, x: torch.Tensor, tokens: int) -> tuple[list[int], bool]:
        """(agreed counts, shadow) for a call of ``spec`` holding ``tokens`` tokens here."""
        fw = self._fw
        assert fw is not None, "stationary module called outside a stationary forward"
        if spec.rule == "free":  # a count no agreed shape gives: every rank's, gathered now
            src = self.source
            self.free_exchanges += 1
            return ex.gather_counts(tokens, src.rank, src.world, src.group, src.device), False
        counts = fw.counts[spec.rule]
        mine = counts[self.source.rank]
        if mine and tokens != mine:
            raise RuntimeError(
                f"rank {self.source.rank}: {spec.name} got {tokens} tokens ({tuple(x.shape)}) in a "
                f"stationary forward, the tick agreed {mine} (its shape for this rank's forward is wrong)"
            )
        return counts, mine == 0

    def _linear_fn(self, spec: LinearSpec) -> Any:
        group = self.layout.groups[spec.group]
        if group[0] is not spec:
            return lambda x, *_a, **_k: self._member(spec, x)
        return lambda x, *_a, **_k: self._exchange(group, x)

    def _member(self, spec: LinearSpec, x: torch.Tensor) -> torch.Tensor:
        """A group member's output, computed in its leader's exchange. Local."""
        fw = self._fw
        assert fw is not None
        got = fw.pending.pop(id(spec.module), None)
        if got is None or got[0] is not x:
            raise RuntimeError(
                f"{spec.name} was called on another input than the linears it shares an exchange with "
                f"({[s.name for s in self.layout.groups[spec.group]]}); the probe saw them read one input"
            )
        return got[1]

    def _exchange(self, group: list[LinearSpec], x: torch.Tensor) -> torch.Tensor:
        """One exchange for the linears of ``group`` reading ``x``: collective (see the module
        docstring); returns the first linear's output, keeps the others' for their calls. Before
        it, the exchanges of the gated groups it follows that this rank's decoder skipped."""
        src, lead, fw = self.source, group[0], self._fw
        assert fw is not None
        for g in self.layout.followers.get(id(lead.module), ()):
            if fw.towers and g not in fw.gated:  # read from the cache here: no rows, same exchange
                fw.gated.add(g)
                gl = self.layout.groups[g]
                self._run(gl, x.new_zeros((0, int(gl[0].shard.shape[1]))))
        cols = int(lead.shard.shape[1])
        if lead.gated:
            if not fw.towers:  # no encoder runs anywhere this forward: no rank exchanges them
                if not fw.shadow:
                    raise RuntimeError(
                        f"rank {src.rank}: {lead.name} (cross-attention, computed with the encoder) "
                        "called in a forward that runs no encoder"
                    )
                outs = [x.new_zeros((*x.shape[:-1], int(s.shard.shape[0]))) for s in group]
                for s, res in zip(group[1:], outs[1:], strict=True):
                    fw.pending[id(s.module)] = (x, res)
                return outs[0]
            fw.gated.add(lead.group)
        counts, shadow = self._counts(lead, x, x.numel() // cols)
        rows = x.new_zeros((0, cols)) if shadow else x.reshape(-1, cols)
        outs = self._run(group, rows, counts)
        results = []
        for s, out in zip(group, outs, strict=True):
            width = int(s.shard.shape[0])
            res = x.new_zeros((*x.shape[:-1], width)) if shadow else out.view(*x.shape[:-1], width)
            results.append(res)
        for s, res in zip(group[1:], results[1:], strict=True):
            fw.pending[id(s.module)] = (x, res)
        return results[0]

    def _run(
        self, group: list[LinearSpec], rows: torch.Tensor, counts: list[int] | None = None
    ) -> list[torch.Tensor]:
        """The two exchanges of ``group`` for this rank's ``rows`` (``[n, in]``), every rank's
        ``counts`` agreed (None: gathered now, a ``"free"`` group's or a skipped gated one's):
        each linear's ``[n, out]``. Collective on the parameter group (the module docstring)."""
        src, lead = self.source, group[0]
        if counts is None:
            counts = ex.gather_counts(rows.shape[0], src.rank, src.world, src.group, src.device)
            self.free_exchanges += 1
        gathering = ex.start_gather(rows, counts, src.rank, src.group)
        # This rank's own tokens' columns are computed while the other ranks' rows arrive.
        own = self._columns(group, rows) if counts[src.rank] else None
        blocks_in = []
        for r, p in zip((r for r, c in enumerate(counts) if c), gathering.wait(), strict=True):
            blocks_in.append(own if r == src.rank else self._columns(group, p))  # own: counts[rank] > 0
        if not blocks_in:  # no rank has a token: nothing crosses, every rank knows
            blocks_in.append(self._columns(group, rows))
        y = blocks_in[0] if len(blocks_in) == 1 else torch.cat(blocks_in)
        parts = self._parts[lead.group]
        blocks = ex.return_columns(y, counts, [sum(p) for p in parts], src.rank, src.group)
        return ex.split_columns(blocks, parts)

    def _columns(self, group: list[LinearSpec], p: torch.Tensor) -> torch.Tensor:
        """This rank's columns of every linear of ``group`` for the tokens ``p`` (one source rank's
        rows): ``[len(p), sum of this rank's widths]``. Local.

        One product per source rank's tokens, not one over all of them: a GEMM's last bits can
        depend on its row count, so a rank's outputs then depend on its own tokens only, never on
        how many other ranks brought this tick (which depends on timing)."""
        outs = []
        for spec in group:
            bias = None
            if spec.bias is not None:
                assert self.kept is not None
                bias = self.kept[self._kept_at[id(spec.bias)]]
            for first, w in local_rows(spec.shard, self.cut):
                b = bias[first : first + w.shape[0]] if bias is not None else None
                outs.append(F.linear(p, w.to(spec.shard.dtype), b))
        if not outs:
            return p.new_zeros((p.shape[0], 0))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    def _embedding_fn(self, spec: EmbeddingSpec) -> Any:
        def fn(ids: torch.Tensor, *_a: Any, **_k: Any) -> torch.Tensor:
            """The lookup from the shards. Collective (``exchange.lookup_rows``: the ids, then the
            rows), at this module's call, on every rank of the parameter group."""
            src = self.source
            counts, shadow = self._counts(spec, ids, ids.numel())
            flat = ids.new_zeros((0,)) if shadow else ids.reshape(-1)
            cols = int(spec.shard.shape[1])
            blocks = local_rows(spec.shard, self.cut)
            out = ex.lookup_rows(
                flat, counts, spec.shard.row_ranges(), blocks, cols, spec.shard.dtype, src.rank, src.group
            )
            if shadow:
                return out.new_zeros((*ids.shape, cols))
            return out.view(*ids.shape, cols)

        if not spec.subclass:
            return fn
        orig = own_forward(spec.module)

        def other(func: Any, *_: Any) -> Any:
            raise RuntimeError(
                f"rank {self.source.rank}: {spec.name} ({type(spec.module).__name__}) used its weight in "
                f"{getattr(func, '__name__', func)} in a stationary forward; the probe saw only lookups"
            )

        w = stand_in(spec.shard.shape, spec.shard.dtype, self.source.device)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            """The subclass's own forward, its lookups from the shards (each collective, as ``fn``)."""
            with looking_up(spec.module, w, fn, other):
                return orig(*args, **kwargs)

        return wrapped

    def _fallback_fn(self, spec: FallbackSpec) -> Any:
        orig = own_forward(spec.module)

        def fn(*args: Any, **kwargs: Any) -> Any:
            """Gather the module's parameters, run it, release them. Collective (one all-gather
            per dtype of its parameters' pieces, on the parameter group)."""
            src = self.source
            full = gather_full([r.shard for r in spec.refs], src.group, src.device)
            places = [(m, n, t) for r, t in zip(spec.refs, full, strict=True) for m, n in r.places]
            with swapped(places):
                return orig(*args, **kwargs)

        return fn
