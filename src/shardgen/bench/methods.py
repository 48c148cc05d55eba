"""The methods ``shardgen bench`` compares, run on every rank of one world (the rank side).

Workload: the shipped toy model and its skewed prompts (``toy.make_prompts(skew=True)``: most
answers are 1-4 numbers, about 15% are 20-25), ``prompts * world`` of them, rank ``r`` taking
every ``world``-th one (a static split: the same prompts for every method). Methods:

- ``hf_synced``: HF ``generate(synced_gpus=True)`` on an FSDP2-sharded model, in batches; ranks
  with fewer batches make padding calls (equal call counts, or the job would hang).
- ``hf_eos_none``: the same with ``eos_token_id=None`` (every batch decodes ``max_new_tokens``),
  answers then cut at the first EOS.
- ``ds_hf``: DeepSpeed ZeRO-3 (``deepspeed.initialize``) + HF ``generate(synced_gpus=True)``.
- ``ds_gather_hf``: gather-then-generate as TRL's ``unwrap_model_for_generation`` does it for
  ZeRO-3: ``GatheredParameters`` around each (padded) call, DeepSpeed's hooks removed inside.
- ``sg_fsdp2`` / ``sg_fsdp2_once`` / ``sg_ds`` / ``sg_ds_once``: one shardgen ``generate()`` per
  rank (continuous refill), per-layer or gather-once, on each backend.
- ``sg_fsdp2_stationary`` / ``sg_ds_stationary``: the same, weight-stationary (no weight of a
  linear, the embeddings or the head moves; activations are exchanged).
- ``sg_fsdp2_spec``: ``sg_fsdp2`` with speculative decoding from history (``speculate=4``):
  drafts from the prompts, the rows decoding and the warm-up's rollouts; the same answers.
- ``local``: shardgen with ``backend="local"`` (an unsharded replica per rank): the floor.

Every method's answers are checked against the toy task. Every function here is collective:
every rank calls it, in the same order, with the same arguments.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from shardgen.core.timeline import Span, Timeline

HF_METHODS = ("hf_synced", "hf_eos_none", "ds_hf", "ds_gather_hf")
SG_METHODS = {  # name: (backend, gather)
    "sg_fsdp2": ("fsdp2", "per-layer"),
    "sg_fsdp2_once": ("fsdp2", "once"),
    "sg_ds": ("deepspeed", "per-layer"),
    "sg_ds_once": ("deepspeed", "once"),
    "sg_fsdp2_stationary": ("fsdp2", "stationary"),
    "sg_ds_stationary": ("deepspeed", "stationary"),
    "sg_fsdp2_spec": ("fsdp2", "per-layer"),
    "local": ("local", "per-layer"),
}
SPECULATE = {"sg_fsdp2_spec": 4}  # EngineConfig.speculate of a method (0 when not named)
METHODS = (*HF_METHODS, *SG_METHODS)
DESCRIPTIONS = {  # shown by shardgen bench --help
    "hf_synced": "HF generate(synced_gpus=True) on an FSDP2-sharded model, in batches; ranks with "
    "fewer batches make padding calls",
    "hf_eos_none": "the same with eos_token_id=None (every batch runs to --max-new-tokens), answers cut "
    "at the first EOS afterwards",
    "ds_hf": "DeepSpeed ZeRO-3 (deepspeed.initialize) + HF generate(synced_gpus=True)",
    "ds_gather_hf": "ZeRO-3, the whole model gathered around each HF generate() call (as TRL's "
    "unwrap_model_for_generation does)",
    "sg_fsdp2": "shardgen, fsdp2 backend, gathers per layer",
    "sg_fsdp2_once": "shardgen, fsdp2 backend, the whole model gathered once",
    "sg_ds": "shardgen, deepspeed backend, gathers per layer",
    "sg_ds_once": "shardgen, deepspeed backend, the whole model gathered once",
    "sg_fsdp2_stationary": "shardgen, fsdp2 backend, weight-stationary (no weight moves; "
    "activations are exchanged)",
    "sg_ds_stationary": "shardgen, deepspeed backend, weight-stationary",
    "sg_fsdp2_spec": "shardgen, fsdp2 backend, gathers per layer, speculative decoding from history "
    "(speculate=4: drafts from the prompts and earlier rollouts, no draft model)",
    "local": "shardgen, local backend: an unsharded replica per rank (the floor)",
}
DEEPSPEED_METHODS = ("ds_hf", "ds_gather_hf", "sg_ds", "sg_ds_once", "sg_ds_stationary")


@dataclass
class Workload:
    prompts: list[str]  # this rank's prompts
    batch_size: int
    max_new_tokens: int
    useful_tokens: int  # answer tokens + EOS, summed over this rank's prompts
    full_bytes: int  # the unsharded model's parameters
    unit_bytes: int  # the largest unit a per-layer gather holds (a decoder layer, or the rest)


@dataclass
class Outcome:
    """One method on one rank."""

    method: str
    rank: int
    wall_s: float = 0.0
    forwards: int = 0
    wasted_forwards: int = 0
    useful_tokens: int = 0
    peak_param_bytes: int = 0
    wrong: int = 0
    error: str | None = None
    spans: list[Span] = field(default_factory=list)


def make_workload(n_per_rank: int, batch_size: int, max_new_tokens: int, rank: int, world: int) -> Workload:
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardgen.toy import answer_length, make_prompts, toy_model_path

    everything = [p["prompt"] for p in make_prompts(n_per_rank * world, seed=0, skew=True)]
    mine = everything[rank::world]
    useful = sum(answer_length(p) + 1 for p in mine)  # one token per number, plus EOS
    import torch

    with torch.device("meta"):  # sizes only
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(toy_model_path()))
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    return Workload(mine, batch_size, max_new_tokens, useful, full, _largest_unit_bytes(model))


def run_method(name: str, work: Workload) -> Outcome:
    """Run one method on this rank and time it between two barriers. Collective."""
    import torch.distributed as dist

    from shardgen.toy import check_answer

    rank = dist.get_rank()
    out = Outcome(method=name, rank=rank)
    try:
        setup, go = _METHOD_FNS[name](name, work)
    except Exception as e:  # e.g. DeepSpeed not installed: reported, the other methods go on
        out.error = f"{type(e).__name__}: {e}"
        _agree_on_error(out)
        return out
    go(work.prompts[: work.batch_size], Timeline(), Outcome(method=name, rank=rank))  # warm-up, untimed
    tl = Timeline(enabled=True)
    dist.barrier()
    t0 = time.perf_counter()
    texts = go(work.prompts, tl, out)
    t_done = time.perf_counter()
    dist.barrier()
    t1 = time.perf_counter()
    tl.add(t_done, t1, "idle")  # waiting for the slowest rank: the long tail
    out.wall_s = t1 - t0
    out.spans = [(max(a - t0, 0.0), b - t0, k) for a, b, k in tl.spans if b > t0]
    out.useful_tokens = work.useful_tokens
    out.wrong = sum(not check_answer(p, t) for p, t in zip(work.prompts, texts, strict=True))
    setup.close()
    return out


def _agree_on_error(out: Outcome) -> None:
    """A setup error on one rank must skip the method on every rank (or the peers would hang)."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([1 if out.error else 0])
    dist.all_reduce(flag)
    if flag.item() and not out.error:
        out.error = "failed on another rank"


# ---------------------------------------------------------------------------------- HF generate()


class _Closer:
    def __init__(self, fn: Callable[[], None] = lambda: None) -> None:
        self.close = fn


Run = Callable[[list[str], Timeline, Outcome], list[str]]


def _hf(name: str, work: Workload) -> tuple[_Closer, Run]:
    """Setup for the four HF ``generate()`` methods; returns (closer, run)."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardgen.toy import toy_model_path

    path = toy_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    world = dist.get_world_size()
    gather_ctx: Callable[[], Any] = contextlib.nullcontext
    if name.startswith("ds"):
        model, gather_ctx = _deepspeed(model, gather=name == "ds_gather_hf")
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    forwards: list[tuple[float, float]] = []  # this call's forwards (hooks on the whole model)
    started = [0.0]
    model.register_forward_pre_hook(lambda *_: started.__setitem__(0, time.perf_counter()))
    model.register_forward_hook(lambda *_: forwards.append((started[0], time.perf_counter())))
    gathered = name == "ds_gather_hf"
    peak = work.full_bytes // world + (work.full_bytes if gathered else work.unit_bytes)
    eos = tok.eos_token_id

    def go(prompts: list[str], tl: Timeline, out: Outcome) -> list[str]:
        most = torch.tensor([math.ceil(len(prompts) / work.batch_size)])
        dist.all_reduce(most, op=dist.ReduceOp.MAX)  # padding calls: every rank makes the same number
        texts: list[str] = []
        for c in range(int(most.item())):
            batch = prompts[c * work.batch_size : (c + 1) * work.batch_size]
            pad_call = not batch
            enc = tok(batch or work.prompts[:1], return_tensors="pt", padding=True)
            kw: dict[str, Any] = {"max_new_tokens": work.max_new_tokens, "do_sample": False}
            kw["synced_gpus"] = not gathered  # after a full gather, ranks generate on their own
            if name == "hf_eos_none":
                kw["eos_token_id"] = None
            t = time.perf_counter()
            forwards.clear()
            with gather_ctx():
                if gathered:
                    tl.since(t, "gather")
                if not (gathered and pad_call):  # a padding call only joins the gather
                    with torch.no_grad():
                        ids = model.generate(**enc, **kw)[:, enc["input_ids"].shape[1] :].tolist()
            out.forwards += len(forwards)
            rows = [] if pad_call else [r[: r.index(eos) + 1] if eos in r else r for r in ids]
            useful = max((len(r) for r in rows), default=0)  # later steps: every row had ended
            out.wasted_forwards += len(forwards) - useful
            for i, (a, b) in enumerate(forwards):
                tl.add(a, b, "shadow" if i >= useful else "prefill" if i == 0 else "decode")
            texts += [tok.decode(r, skip_special_tokens=True) for r in rows]
        out.peak_param_bytes = peak
        return texts

    return _Closer(), go


def _deepspeed(model: Any, gather: bool) -> tuple[Any, Callable[[], Any]]:
    """``deepspeed.initialize`` ZeRO-3 on CPU; for ``gather``, a TRL-style gather context."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
    except ImportError:
        raise ImportError("needs DeepSpeed: pip install 'shardgen[deepspeed]'") from None
    zero = {"stage": 3, "memory_efficient_linear": False}
    engine, *_ = deepspeed.initialize(
        model=model, config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero}
    )

    @contextlib.contextmanager
    def gathered() -> Iterator[None]:
        from shardgen.backends.deepspeed import internals as ds

        # What trl.models.utils.unwrap_model_for_generation does for ZeRO-3: gather every
        # parameter, then take DeepSpeed's hooks off so forwards neither re-gather nor release.
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None):
            offload = getattr(engine.optimizer, "parameter_offload", engine.optimizer)
            if offload is None:
                yield
            else:
                with ds.hooks_removed(offload, list(engine.module.parameters())):
                    yield

    return engine.module, gathered if gather else contextlib.nullcontext


def _largest_unit_bytes(model: Any) -> int:
    """Bytes of the largest unit a per-layer gather holds at once (a decoder layer, or the rest)."""
    layers = list(model.model.layers)
    layer_ids = {id(p) for layer in layers for p in layer.parameters()}
    rest = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in layer_ids)
    return max([rest] + [sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in layers])


# ---------------------------------------------------------------------------------- shardgen


def _sg(name: str, work: Workload) -> tuple[Any, Run]:
    import torch.distributed as dist

    from shardgen.core.engine import Engine
    from shardgen.toy import toy_model_path

    backend, gather = SG_METHODS[name]
    if backend == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    engine = Engine.from_pretrained(
        toy_model_path(), backend=backend, gather=gather, max_batch_size=work.batch_size, timeline=True,
        speculate=SPECULATE.get(name, 0),
    )  # fmt: skip
    world = dist.get_world_size()

    def go(prompts: list[str], tl: Timeline, out: Outcome) -> list[str]:
        before = engine.stats()
        spans_before = len(engine.timeline())
        done = engine.generate(prompts, max_new_tokens=work.max_new_tokens)
        tl.spans += engine.timeline()[spans_before:]
        after = engine.stats()
        shadows = after["shadow_forwards"] - before["shadow_forwards"]
        out.forwards = after["forwards"] - before["forwards"] + shadows
        out.wasted_forwards = shadows
        if backend == "local":
            out.peak_param_bytes = work.full_bytes
        elif gather == "stationary":  # the shard, the kept small parameters, one fallback module
            kept = engine.backend.stationary.layout.describe()["kept_bytes"]
            out.peak_param_bytes = work.full_bytes // world + kept
        else:
            unit = work.unit_bytes if gather == "per-layer" else work.full_bytes
            out.peak_param_bytes = work.full_bytes // world + unit
        return [c.text for c in done]

    return engine, go


_METHOD_FNS: dict[str, Callable[..., Any]] = {
    **{m: _hf for m in HF_METHODS},
    **{m: _sg for m in SG_METHODS},
}
