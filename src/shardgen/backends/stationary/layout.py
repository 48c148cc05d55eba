"""The weight-stationary layout of one model: what each module does in a stationary forward.

Built once per engine from the module structure and one local probe forward, the same on
every rank (no data, no rank's history goes in):

* **stationary linears**: plain ``nn.Linear`` (not a subclass: quantized and custom linears
  fall back) whose weight rows stay in their shards (``exchange.py``); linears that read the
  same input one after another in the probe (q/k/v, gate/up) share one exchange (a *group*);
* **stationary embeddings**: ``nn.Embedding`` (no ``max_norm``) looked up from the shards; a
  subclass (Gemma's scaled embedding, OPT's learned positions) runs its own forward with its
  lookups of its weight taken from the shards (``backends/lookups.py``), unless the probe sees it use
  the weight otherwise;
* **kept** parameters: the 1-D ones (norms, biases) of modules that are neither, gathered once
  and kept until the next pause or close;
* **fallbacks**: MoE blocks (whole), and any other module owning a parameter of 2 or more
  dimensions (GPT-2's ``Conv1D``, positional tables of another class, ...), or a linear fed a
  token count the tick cannot predict: gathered per call, in call order, released after.

The probe (:func:`probe`) runs the model once on a ``[2, 3]`` batch, with the keyword arguments
the decoder passes, every stationary module returning zeros and every other parameter replaced
by zeros of its full shape (a fallback's only for its call): it records which linears are
called, with which input tensor and how many tokens: ``rows x width`` (``"body"``) or ``rows``
(``"rows"``: the LM head after ``logits_to_keep=1``, which the decoder also passes when the
model takes it). No collective.

A model with towers (``backends/towers.py``): the probe also runs each tower on its shadow input.
A tower's token counts (image patches, encoder lengths) are no function of the tick's agreed
shapes, so every module the towers call, and any module of such a model fed a count the probe
cannot predict (T5's relative position buckets, BART's learned positions), gets the rule
``"free"``: its exchanges first all-gather each rank's count (``exchange.gather_counts``). An
encoder-decoder's cross-attention keys and values (linears fed the encoder output) are
*gated*: the decoder computes them only in a forward that runs the encoder (later steps read
them from the cache), so every rank computes them exactly when the tick agreed the encoder, a
rank whose decoder reads them from the cache issuing their exchanges with no rows just before
the linear that follows them in the probe (their *follower*: the attention's output).
"""

from __future__ import annotations

import contextlib
import inspect
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from shardgen.backends.lookups import looking_up, own_forward, stand_in
from shardgen.backends.parts import float_dtype, is_moe_block, outermost, plain_type
from shardgen.backends.stationary.shards import FlatShard
from shardgen.backends.towers import Tower, module_at
from shardgen.log import get_logger

log = get_logger()

PROBE_ROWS, PROBE_WIDTH = 2, 3  # rows, width and rows * width tell the token rules apart
PROBE_ENCODER = 5  # an encoder-decoder probe's encoder width: rows * 5 tokens are the encoder output's


class Unsupported(Exception):
    """A parameter whose layout the mode cannot read (the whole model then gathers per layer)."""


class Source:
    """What a backend tells the mode about its model: the parameter group and, per parameter,
    where its elements lie. Subclasses implement :meth:`shard` and :meth:`aside`."""

    def __init__(self, group: Any, rank: int, world: int, device: torch.device) -> None:
        self.group, self.rank, self.world, self.device = group, rank, world, device

    def shard(self, module: nn.Module, name: str) -> FlatShard:
        """The layout of ``module``'s parameter ``name``; ``Unsupported`` if it cannot be read."""
        raise NotImplementedError

    def aside(self) -> contextlib.AbstractContextManager:
        """Around a stationary (or probe) forward: the backend's own gathering hooks set aside. Local."""
        return contextlib.nullcontext()

    def is_block(self, module: nn.Module) -> bool:
        """Modules computed whole as a fallback (MoE blocks)."""
        return is_moe_block(module)


@dataclass(eq=False)
class Ref:
    """One parameter at every place it is registered (tied weights: several)."""

    shard: FlatShard
    places: list[tuple[nn.Module, str]] = field(default_factory=list)


@dataclass(eq=False)
class LinearSpec:
    name: str
    module: nn.Module
    weight: Ref
    bias: Ref | None = None
    rule: str = "body"  # which agreed token count its input holds: "body", "rows" or "free"
    group: int = -1  # index into Layout.groups
    calls: int = 0  # calls per forward (probe)
    gated: bool = False  # an encoder-decoder's cross-attention key / value: run with the encoder

    @property
    def shard(self) -> FlatShard:
        return self.weight.shard


@dataclass(eq=False)
class EmbeddingSpec:
    name: str
    module: nn.Module
    weight: Ref
    rule: str = "body"
    calls: int = 0
    bias: Ref | None = None  # never: the same fields as a linear
    subclass: bool = False  # its own forward runs, its lookups intercepted (Lookups)

    @property
    def shard(self) -> FlatShard:
        return self.weight.shard


@dataclass(eq=False)
class FallbackSpec:
    name: str
    module: nn.Module
    refs: list[Ref]
    why: str
    calls: int = 0


@dataclass
class Layout:
    linears: dict[int, LinearSpec] = field(default_factory=dict)  # id(module) -> spec
    embeddings: dict[int, EmbeddingSpec] = field(default_factory=dict)
    fallbacks: dict[int, FallbackSpec] = field(default_factory=dict)
    kept: list[Ref] = field(default_factory=list)
    groups: list[list[LinearSpec]] = field(default_factory=list)
    #: id(a group's lead module) -> the gated groups (indices) whose exchanges come before its own
    followers: dict[int, list[int]] = field(default_factory=dict)

    def describe(self) -> dict[str, Any]:
        """What goes where (logs, tests)."""
        return {
            "linears": len(self.linears),
            "exchanges": len(self.groups),
            "groups": [[s.name for s in g] for g in self.groups if len(g) > 1],
            "free": sorted(
                s.name for t in (self.linears, self.embeddings) for s in t.values() if s.rule == "free"
            ),
            "gated": sorted(s.name for s in self.linears.values() if s.gated),
            "embeddings": [s.name for s in self.embeddings.values()],
            "kept": sum(len(r.places) for r in self.kept),
            "kept_bytes": sum(r.shard.numel * _itemsize(r.shard.dtype) for r in self.kept),
            "fallbacks": {s.name: s.why for s in self.fallbacks.values()},
        }


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def classify(model: nn.Module, source: Source) -> Layout:
    """Sort the model's modules (see the module docstring). Local; raises ``Unsupported``."""
    layout = Layout()
    refs: dict[Any, Ref] = {}

    def ref(module: nn.Module, pname: str) -> Ref:
        shard = source.shard(module, pname)
        r = refs.setdefault(shard.key, Ref(shard))
        r.places.append((module, pname))
        return r

    roots = outermost(model, source.is_block)
    inside = {id(c) for _, m in roots for c in m.modules()}
    for name, m in roots:
        places = [ref(sub, p) for sub in m.modules() for p, v in sub._parameters.items() if v is not None]
        layout.fallbacks[id(m)] = FallbackSpec(name, m, list(dict.fromkeys(places)), "mixture of experts")
    kept: dict[int, Ref] = {}
    for name, m in model.named_modules():
        own = [p for p, v in m._parameters.items() if v is not None]
        if id(m) in inside or not own:
            continue
        shards = {p: ref(m, p) for p in own}
        kind = plain_type(m)
        weight = shards.get("weight")
        if kind is nn.Linear and weight is not None and len(weight.shard.shape) == 2:
            bias = shards.get("bias")
            layout.linears[id(m)] = LinearSpec(name, m, weight, bias)
            if bias is not None:
                kept[id(bias)] = bias
        elif issubclass(kind, nn.Embedding) and m.max_norm is None and set(own) == {"weight"}:
            layout.embeddings[id(m)] = EmbeddingSpec(name, m, weight, subclass=kind is not nn.Embedding)
        elif all(len(r.shard.shape) <= 1 for r in shards.values()):
            kept.update((id(r), r) for r in shards.values())
        else:
            why = f"{type(m).__name__}: not a plain nn.Linear / nn.Embedding"
            layout.fallbacks[id(m)] = FallbackSpec(name, m, list(shards.values()), why)
    layout.kept = list(kept.values())
    return layout


@contextlib.contextmanager
def swapped(places: list[tuple[nn.Module, str, Any]]) -> Iterator[None]:
    """``module._parameters[name] = value`` for each place for the duration, then the originals
    back. Local."""
    saved = [(m, n, m._parameters[n]) for m, n, _ in places]
    for m, n, v in places:
        m._parameters[n] = v
    try:
        yield
    finally:
        for m, n, v in saved:
            m._parameters[n] = v


@contextlib.contextmanager
def overridden(forwards: list[tuple[nn.Module, Callable[..., Any]]]) -> Iterator[None]:
    """Each module's ``forward`` replaced (an instance attribute) for the duration; whatever
    instance attribute it had is put back. Local."""
    saved = [(m, m.__dict__.get("forward")) for m, _ in forwards]
    for m, fn in forwards:
        m.forward = fn
    try:
        yield
    finally:
        for m, prev in saved:
            if prev is None:
                m.__dict__.pop("forward", None)
            else:
                m.forward = prev


@contextlib.contextmanager
def hooks_aside(modules: list[nn.Module], ids: set[int]) -> Iterator[None]:
    """The forward hooks with these handle ids set aside on ``modules`` for the duration (the hook
    dicts swapped for copies without them, the originals put back after); other hooks keep their
    order. Local."""
    saved = []
    for m in modules:
        for attr in ("_forward_pre_hooks", "_forward_hooks"):
            d = getattr(m, attr)
            if any(k in ids for k in d):
                copy = OrderedDict((k, v) for k, v in d.items() if k not in ids)
                saved.append((m, attr, d, set(copy)))
                setattr(m, attr, copy)
    try:
        yield
    finally:
        for m, attr, d, before in saved:
            # Hooks registered meanwhile go on with the originals: HF installs its output capturing
            # hooks once, lazily, at the first forward asking for hidden states (a vision tower's,
            # in a stationary forward), and never again.
            d.update((k, v) for k, v in getattr(m, attr).items() if k not in before)
            setattr(m, attr, d)


def probe(model: nn.Module, layout: Layout, source: Source, towers: tuple[Tower, ...] = ()) -> None:
    """Run the probe forward (and each of ``towers`` on its shadow input) and finish ``layout``:
    token rules, exchange groups, call counts; linears and embeddings fed an unpredictable token
    count become fallbacks (a model with towers: ``"free"``). Local."""
    # (spec, input, tokens, in a tower); inputs kept alive
    calls: list[tuple[Any, torch.Tensor, int, bool]] = []
    bad: dict[int, str] = {}  # id(spec) -> why an embedding subclass cannot stay stationary
    entered: dict[int, int] = {}  # id(spec) -> calls of an embedding subclass's own forward
    dev = source.device
    where = {"tower": False}  # whether the calls now come from a tower's run

    def linear(spec: LinearSpec) -> Callable[..., Any]:
        def fn(x: torch.Tensor, *_a: Any, **_k: Any) -> torch.Tensor:
            calls.append((spec, x, x.numel() // max(1, x.shape[-1]), where["tower"]))
            return x.new_zeros((*x.shape[:-1], int(spec.shard.shape[0])))

        return fn

    def embedding(spec: EmbeddingSpec) -> Callable[..., Any]:
        def fn(ids: torch.Tensor, *_a: Any, **_k: Any) -> torch.Tensor:
            calls.append((spec, ids, ids.numel(), where["tower"]))
            return torch.zeros(
                (*ids.shape, int(spec.shard.shape[1])), dtype=spec.shard.dtype, device=ids.device
            )

        if not spec.subclass:
            return fn
        orig = own_forward(spec.module)

        w = stand_in(spec.shard.shape, spec.shard.dtype, dev)

        def other(func: Any, args: tuple, kwargs: dict) -> Any:  # noted; computed on zeros
            use = getattr(func, "__name__", repr(func))
            bad.setdefault(id(spec), f"{type(spec.module).__name__} uses its weight in {use}, not a lookup")
            zeros = torch.zeros(spec.shard.shape, dtype=spec.shard.dtype, device=dev)
            args = tuple(zeros if a is w else a for a in args)
            return func(*args, **{k: zeros if v is w else v for k, v in kwargs.items()})

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if not where["tower"]:
                entered[id(spec)] = entered.get(id(spec), 0) + 1
            with looking_up(spec.module, w, fn, other):
                return orig(*args, **kwargs)

        return wrapped

    def fallback(spec: FallbackSpec) -> Callable[..., Any]:
        orig = own_forward(spec.module)

        def fn(*args: Any, **kwargs: Any) -> Any:  # zeros of the full shapes, for this call only
            spec.calls += 0 if where["tower"] else 1  # per forward: a tower runs in some only
            zeros = [
                (m, n, torch.zeros(r.shard.shape, dtype=r.shard.dtype, device=dev))
                for r in spec.refs
                for m, n in r.places
            ]
            with swapped(zeros):
                return orig(*args, **kwargs)

        return fn

    places = [
        (m, n, torch.zeros(r.shard.shape, dtype=r.shard.dtype, device=dev))
        for r in layout.kept
        for m, n in r.places
    ]
    for fb in layout.fallbacks.values():
        fb.calls = 0
    forwards = [(s.module, linear(s)) for s in layout.linears.values()]
    forwards += [(s.module, embedding(s)) for s in layout.embeddings.values()]
    forwards += [(s.module, fallback(s)) for s in layout.fallbacks.values()]
    encdec = bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))
    with torch.no_grad(), source.aside(), swapped(places), overridden(forwards):
        where["tower"] = True
        for t in towers:  # as a shadow run does: the tower alone, on its shadow input
            t.shadow(module_at(model, t.path), dev)
        where["tower"] = False
        model(**_probe_inputs(model, dev, encdec))
    _finish(layout, calls, bad, entered, bool(towers), encdec)


def _probe_inputs(model: nn.Module, dev: torch.device, encdec: bool) -> dict[str, Any]:
    """The probe forward's inputs: a ``[2, 3]`` batch with the keyword arguments the decoder
    passes; an encoder-decoder's decoder against a ``[2, PROBE_ENCODER]`` encoder output."""
    params = inspect.signature(model.forward).parameters
    ids = torch.zeros((PROBE_ROWS, PROBE_WIDTH), dtype=torch.long, device=dev)
    if encdec:  # as the decode step passes them (generation/encdec.py), no cache
        cfg = model.config
        width = int(getattr(cfg, "d_model", None) or cfg.hidden_size)
        dtype = float_dtype(model)
        hidden = torch.zeros((PROBE_ROWS, PROBE_ENCODER, width), dtype=dtype, device=dev)
        mask = torch.ones((PROBE_ROWS, PROBE_ENCODER), dtype=torch.long, device=dev)
        return {"decoder_input_ids": ids, "encoder_outputs": (hidden,), "attention_mask": mask,
                "use_cache": False}  # fmt: skip
    kwargs: dict[str, Any] = {"input_ids": ids, "use_cache": False}
    if "logits_to_keep" in params:  # as the decoder passes them (generation/batch.py)
        kwargs["logits_to_keep"] = 1
    if "position_ids" in params:
        kwargs["position_ids"] = torch.arange(PROBE_WIDTH, device=dev).expand(PROBE_ROWS, PROBE_WIDTH)
    return kwargs


def _finish(
    layout: Layout,
    calls: list[tuple[Any, torch.Tensor, int, bool]],
    bad: dict[int, str],
    entered: dict[int, int],
    towers: bool = False,
    encdec: bool = False,
) -> None:
    """Token rules, call counts and exchange groups from the probe's ``calls``; the modules it
    could not predict (or, ``bad``, embedding subclasses using their weight otherwise: called
    ``entered`` times) become fallbacks, or with ``towers`` (the model has some) ``"free"``, an
    encoder-decoder's linears fed the encoder output gated (the module docstring). Local."""
    rules = {PROBE_ROWS * PROBE_WIDTH: "body", PROBE_ROWS: "rows"}
    seen: dict[int, tuple[Any, list[int], int]] = {}  # id(spec) -> (spec, decoder counts, all calls)
    for spec, _, n, in_tower in calls:
        got = seen.get(id(spec), (spec, [], 0))
        seen[id(spec)] = (spec, got[1] if in_tower else [*got[1], n], got[2] + 1)
    odd: dict[int, str] = {}
    for spec, counts, total in seen.values():
        spec.calls = len(counts)
        found = {rules.get(n) for n in counts}
        if len(found) == 1 and None not in found and total == len(counts):
            spec.rule = found.pop()
        elif towers:  # a tower's module, or a count no agreed shape gives: sized at the call
            spec.rule = "free"
            cross = set(counts) == {PROBE_ROWS * PROBE_ENCODER} and total == len(counts)
            spec.gated = encdec and isinstance(spec, LinearSpec) and cross
        else:
            odd[id(spec)] = f"fed {sorted(set(counts))} tokens for a {PROBE_ROWS}x{PROBE_WIDTH} batch"
    for table in (layout.linears, layout.embeddings):  # never called in the probe: sized at the call
        for spec in table.values():
            if towers and id(spec) not in seen:
                spec.rule = "free"
    odd.update(bad)
    for table in (layout.linears, layout.embeddings):
        for key, spec in list(table.items()):
            if id(spec) not in odd:
                continue
            del table[key]
            refs = [r for r in (spec.weight, spec.bias) if r is not None]
            layout.kept = [r for r in layout.kept if r is not spec.bias]
            n = entered.get(id(spec), spec.calls)  # a fallback gathers per call of the module
            layout.fallbacks[key] = FallbackSpec(spec.name, spec.module, refs, odd[id(spec)], n)
    # Groups: consecutive calls of linears called once in the probe on the very same input tensor.
    once = {id(spec) for spec, _, total in seen.values() if total == 1}
    groups: list[list[LinearSpec]] = []
    prev: tuple[Any, torch.Tensor] | None = None
    gated: int | None = None  # the last gated group, until the next other linear follows it
    for spec, x, _, _ in calls:
        if not isinstance(spec, LinearSpec) or id(spec.module) not in layout.linears:
            prev = None
            continue
        if spec.group >= 0:  # called again: its own exchange per call
            prev = None
            continue
        lead = groups[-1][0] if prev is not None else None
        if (
            lead is not None
            and prev[1] is x
            and id(spec) in once
            and id(lead) in once
            and lead.rule == spec.rule
            and lead.gated == spec.gated
            and lead.shard.shape[1] == spec.shard.shape[1]
        ):
            groups[-1].append(spec)
        else:
            groups.append([spec])
            if gated is not None and not spec.gated:
                layout.followers.setdefault(id(spec.module), []).append(gated)
                gated = None
            if spec.gated:
                gated = len(groups) - 1
        spec.group = len(groups) - 1
        prev = (spec, x)
    for spec in layout.linears.values():
        if spec.group < 0:  # never called in the probe: an exchange of its own if it ever is
            groups.append([spec])
            spec.group = len(groups) - 1
    layout.groups = groups
