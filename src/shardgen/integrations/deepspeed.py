"""DeepSpeed's ``RolloutEngine`` on a shardgen ``Engine``: ``ShardgenRollout``, a drop-in for
``HybridEngineRollout``.

    torchrun --nproc-per-node 2 train.py     # DS_ACCELERATOR=cpu on a CPU machine

    from deepspeed.runtime.rollout import RolloutRequest, SamplingConfig
    from shardgen.integrations.deepspeed import ShardgenRollout

    ds_engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=zero3_config)
    rollout = ShardgenRollout(ds_engine, tokenizer)      # collective; HybridEngineRollout's arguments
    for ids, mask in loader:                             # any rows per rank, zero included
        batch = rollout.generate(RolloutRequest(ids, mask), SamplingConfig(max_new_tokens=64))
        loss = ...                                       # ds_engine's forward / backward / step
    rollout.shutdown()                                   # collective

Install: ``pip install 'shardgen[deepspeed]'`` (DeepSpeed 0.19, whose ``deepspeed.runtime.rollout``
defines the interface).

How it fits DeepSpeed 0.19.8 (``deepspeed/runtime/rollout``):

- ``generate`` returns DeepSpeed's ``RolloutBatch`` in ``HybridEngineRollout``'s layout: the
  request's left-padded prompt columns unchanged, then the response right-padded with the pad id;
  the first EOS (the tokenizer's ``eos_token_id``, the one id ``HybridEngineRollout`` cuts at) is
  kept, later positions are pad with attention 0; ``response_start_idx`` is the prompt width.
  Without ``continuous_batch_size`` the response has ``max_new_tokens`` columns and a generated
  token equal to the pad id has attention 0, as there (HF decodes ``max_new_tokens`` with EOS
  off, then masks by id); with it, the width is the longest response and every generated token
  has attention 1, as its continuous path builds them. Rows ``i * n .. i * n + n - 1`` are the
  samples of prompt ``i``. ``ResponseTokenBatch.from_rollout`` takes it as it is.
- The engine is created once, at construction, on the ZeRO-3 model itself (``backend="deepspeed"``:
  its shards are kept, its gathers move to shardgen's private groups). Outside ``generate`` the
  engine is paused (``Engine.paused()``), so the trainer's forward, backward and step run on
  DeepSpeed's own setup, as without shardgen; leaving the pause drops what generation kept (a
  gathered replica, kept small parameters): the weights may have changed.
  Out of the pause the model is in eval mode (no dropout while sampling), then back in yours.
- Unlike ``HybridEngineRollout``, a rank's rows never decide how many forwards another rank runs:
  ranks may hold different numbers of prompts, zero included, and stop at different steps. A
  request of zero rows (``[0, P]``) gets a batch of zero rows in the same layout, and the rank
  keeps serving its peers' forwards until they are done.
- Constructed as ``HybridEngineRollout`` is (``build_rollout``'s ``engine=, tokenizer=, cfg=``):
  ``rollout.engine`` is the DeepSpeed engine, ``rollout.shardgen_engine`` shardgen's ``Engine``;
  ``cfg`` maps as ``options_of`` says. The tokenizer needs only its ids (``eos_token_id``,
  ``pad_token_id``): without ``decode`` the rows have no text (``last_batch.texts`` is None).

Partial rollouts (``groups=K``, ``max_staleness=``, ``stale=``: ``generation/partial.py``; the
meaning of TRL's ``AsyncGRPOConfig.max_staleness`` with ``stale="drop"``, its own): ``generate``
returns once K prompts' groups are whole, held groups of earlier calls first; the rest stay held,
parked while the trainer steps (the pause does not wait for them) and resumed under the new
weights. The rows are then the served groups', not the request's: ``last_batch.prompts`` names
each group's prompt, ``last_batch.versions`` each token's weight version and ``last_batch.logprobs``
its behaviour logprob; the layout is the continuous path's (prompts left-padded to the widest,
every generated token attention 1). ``rollout.groups`` may change between calls
(``rollout.held``: the groups held now, say to drain them).

Speculative decoding from history: ``ShardgenRollout(engine, tokenizer, speculate=4)`` (an
``EngineConfig`` option, as any other); the same rows, fewer forwards. ``rollout.last_stats``
holds the last ``generate``'s counters on this rank (``step_stats``: ``drafted``, ``accepted``,
``tokens_per_forward``, ...), logged at debug level with ``speculate`` on.

``SamplingConfig``: ``temperature <= 0`` is greedy; ``top_k <= 0`` is off; ``top_p``,
``max_new_tokens`` and ``n_samples_per_prompt`` as there; ``continuous_batch_size`` bounds the
rows this rank decodes at once (a finished row's slot goes to the next one), under the engine's
own ``max_batch_size``; unlike there, it also takes sampling and ``n > 1``. Sampling draws are
seeded per row (``seed``: reproducible runs), not from torch's global generator.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import importlib
import numbers
import random
from collections.abc import Iterator
from typing import Any

import torch

from shardgen.config import SamplingParams
from shardgen.generation.partial import Quota, held_groups
from shardgen.generation.requests import Completion, unpadded_rows
from shardgen.generation.rollout import RolloutBatch as ShardgenBatch
from shardgen.generation.rollout import pack, sample_seed
from shardgen.log import get_logger

DEEPSPEED_VERSION = "0.19"
log = get_logger()


def _import_rollout() -> Any:
    try:
        rollout = importlib.import_module("deepspeed.runtime.rollout")
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "shardgen.integrations.deepspeed needs DeepSpeed >= 0.19 (deepspeed.runtime.rollout): "
            "pip install 'shardgen[deepspeed]'"
        ) from e
    return rollout


_ds = _import_rollout()


def _is_number(v: Any) -> bool:
    """A real number DeepSpeed's ``<= 0`` convention applies to (a bool or NaN is not one)."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and v == v  # NaN != NaN; any int


def _eos_ids(tokenizer: Any) -> list[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]


#: ``HybridEngineRollout``'s options (its ``cfg``) that only change how it decodes, not what it
#: returns: shardgen decodes its own way (no CUDA graphs, a KV cache per batch), so they are taken
#: and have no effect. ``use_shared_prefill`` is shardgen's ``share_prefill`` (on by default).
DECODE_ONLY_FIELDS = (
    "use_graph_capture", "align_decode_fronts", "enable_cache_trimming", "continuous_cache_capacity",
)  # fmt: skip
ENGINE_NAMES = ("hybrid_engine", "shardgen")  # RolloutConfig.engine: build_rollout's, or ours


def options_of(cfg: Any) -> dict[str, Any]:
    """DeepSpeed's rollout ``cfg`` (a ``RolloutConfig`` or ``HybridEngineRolloutConfig``; None)
    as ``EngineConfig`` options. ``ValueError`` naming a field it cannot honour: an ``engine``
    that is not this one, ``enable_profiling`` (there is no ``HybridEngineRollout`` profile to
    read; ``shardgen_engine.stats()`` and ``timeline=True`` are shardgen's)."""
    if cfg is None:
        return {}
    name = getattr(cfg, "engine", "hybrid_engine")
    if name not in ENGINE_NAMES:
        raise ValueError(f"cfg.engine={name!r}: ShardgenRollout stands for one of {list(ENGINE_NAMES)}")
    if getattr(cfg, "enable_profiling", False):
        raise ValueError(
            "cfg.enable_profiling=True: ShardgenRollout keeps no HybridEngineRollout profile "
            "(get_last_profile() is None); use rollout.shardgen_engine.stats() or timeline=True"
        )
    set_ = [f for f in DECODE_ONLY_FIELDS if getattr(cfg, f, None) not in (None, False)]
    if set_:
        log.info("ShardgenRollout: cfg fields %s change how HybridEngineRollout decodes; not used", set_)
    return {"share_prefill": True} if getattr(cfg, "use_shared_prefill", False) else {}


#: ``engine.stats()`` counters a ``generate`` call reports in ``ShardgenRollout.last_stats``.
STEP_COUNTERS = (
    "decode_steps",
    "verify_forwards",
    "folded_prefills",
    "drafted",
    "accepted",
    "forwards_saved",
    "drafts_received",
)


def step_stats(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """The ``STEP_COUNTERS`` between two ``engine.stats()`` snapshots, and ``tokens_per_forward``
    (a live row's tokens per decode forward; 0.0 without one)."""
    out = {k: float(after[k] - before[k]) for k in STEP_COUNTERS}
    rows = after["decode_row_steps"] - before["decode_row_steps"]
    out["tokens_per_forward"] = (after["decode_tokens"] - before["decode_tokens"]) / rows if rows else 0.0
    return out


class ShardgenRollout(_ds.RolloutEngine):
    """``RolloutEngine`` on a shardgen ``Engine`` over ``engine``'s ZeRO-3 model (module docstring).

    Called as ``HybridEngineRollout`` is: ``ShardgenRollout(engine, tokenizer, cfg=None)``, the
    keywords and positions of DeepSpeed's ``build_rollout``; ``cfg`` as ``options_of`` maps it.
    Beyond those, keyword only: ``seed``, the base of every sampled row's seed (None: drawn per
    call), and ``engine_options`` (``EngineConfig`` fields, or ``config=``; over ``cfg``'s).
    ``rollout.engine`` is the DeepSpeed engine, as there; ``rollout.shardgen_engine`` shardgen's.

    Constructing it is collective: every rank of the DeepSpeed engine's data-parallel group
    constructs it, in the same order, with the same options; it builds the ``Engine`` and
    enters its pause. Bad options raise ``ValueError`` before any collective.
    """

    name = "shardgen"

    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        cfg: Any = None,
        *,
        seed: int | None = None,
        groups: int | None = None,
        max_staleness: int | None = None,
        stale: str = "drop",
        **engine_options: Any,
    ) -> None:
        import shardgen

        Quota.of(groups, max_staleness, stale, None)  # ValueError now, before any collective
        self.groups, self.max_staleness, self.stale = groups, max_staleness, stale

        backend = engine_options.pop("backend", "deepspeed")
        if backend != "deepspeed":
            raise ValueError(f"ShardgenRollout runs on backend='deepspeed', got backend={backend!r}")
        engine_options = {**options_of(cfg), **engine_options}
        pad = getattr(tokenizer, "pad_token_id", None)
        self.eos = _eos_ids(tokenizer)
        if pad is None:
            pad = self.eos[0] if self.eos else None
        if pad is None:
            raise ValueError("The tokenizer must define pad_token_id or eos_token_id")
        self.pad = int(pad)
        self.engine, self.tokenizer, self.cfg = engine, tokenizer, cfg  # HybridEngineRollout's fields
        self.seed, self.calls = seed, 0
        self.last_batch: ShardgenBatch | None = None
        """The last ``generate``'s rows as shardgen's ``RolloutBatch``: logprobs, finish reasons, seeds."""
        self.last_stats: dict[str, float] = {}
        """The last ``generate``'s decode counters on this rank (``step_stats``): with
        ``speculate=K`` among the engine options, how much its drafts saved."""
        self.shardgen_engine = shardgen.Engine(engine, tokenizer, backend="deepspeed", **engine_options)
        self._pause = contextlib.ExitStack()
        self._pause.enter_context(self.shardgen_engine.paused())  # collective: every rank, here

    # ------------------------------------------------------------------ RolloutEngine
    @torch.no_grad()
    def generate(self, request: Any, sampling: Any) -> Any:
        """Rollouts for ``request``'s prompts -> DeepSpeed's ``RolloutBatch`` (module docstring).

        Collective only through the pause around it: every rank calls it once per trainer step,
        in the same order as its other calls of ``generate``/``score`` (any number of rows,
        zero included). It leaves the pause (local), waits for its own rows only (peers still
        decoding are served meanwhile), and enters the pause again, which returns once every
        rank has entered it and no rank has a live row.
        """
        n, window = self._check(sampling)
        rows = unpadded_rows(request.prompt_ids, request.prompt_attention_mask)
        empty = [i for i, r in enumerate(rows) if len(r) == 0]
        if empty:
            raise ValueError(f"prompt rows {empty[:8]} have no token (prompt_attention_mask is all 0)")
        self.calls += 1
        if self.groups is not None:
            return self._quota(request, rows, n, sampling)
        options, seeds = self._options(sampling, len(rows), n)
        prompts = [r.tolist() for r in rows for _ in range(n)]
        before = self.shardgen_engine.stats()
        with self._running():
            done = self._serve(prompts, seeds, options, window)
        self.last_stats = step_stats(before, self.shardgen_engine.stats())
        if self.shardgen_engine.config.speculate:
            log.debug("ShardgenRollout.generate: %s", self.last_stats)
        self.last_batch = pack(done, pad_id=self.pad, n=n, seeds=seeds, device=request.prompt_ids.device)
        return self._layout(request, done, n, sampling)

    @property
    def held(self) -> int:
        """The groups this rank holds for its next ``generate`` (``groups=K``). Any thread."""
        return held_groups(self.shardgen_engine)

    def _quota(self, request: Any, rows: list[torch.Tensor], n: int, sampling: Any) -> Any:
        """A partial rollout's ``generate`` (module docstring): the served groups' rows."""
        if sampling.continuous_batch_size is not None:
            raise ValueError("continuous_batch_size does not go with groups= (the engine holds the rest)")
        options, seeds = self._options(sampling, len(rows), 1)  # one seed per prompt: rollout's
        with self._running():
            b = self.shardgen_engine.rollout(
                [r.tolist() for r in rows], n=n, groups=self.groups, max_staleness=self.max_staleness,
                stale=self.stale, seed=seeds if options["do_sample"] else None, **options,
            )  # fmt: skip
        self.last_batch = b.to(request.prompt_ids.device)
        device = request.prompt_ids.device
        return _ds.RolloutBatch(
            input_ids=b.input_ids.to(device),
            attention_mask=b.attention_mask.to(device, request.prompt_attention_mask.dtype),
            response_start_idx=torch.full((len(b),), b.prompt_width, dtype=torch.long, device=device),
        )

    def score(self, *args: Any, **kwargs: Any) -> Any:
        """``Engine.score`` outside the pause (the OPSD teacher, a reference KL), same arguments.

        Collective only through the pause, as ``generate``: every rank calls it the same number
        of times, in the same order as its ``generate`` calls (any rows, zero included)."""
        with self._running():
            return self.shardgen_engine.score(*args, **kwargs)

    def sync_weights(self, step: int) -> None:  # noqa: ARG002
        """No-op: the engine generates with the training weights themselves (their shards)."""
        return None

    def get_last_profile(self) -> None:
        """None, as ``HybridEngineRollout``'s without ``enable_profiling`` (refused here)."""
        return None

    def get_last_continuous_stats(self) -> None:
        """None: no ``HybridEngineRollout`` continuous-path statistics (``shardgen_engine.stats()``)."""
        return None

    def shutdown(self) -> None:
        """Close the engine. Collective: every rank calls it (``Engine.close``); idempotent."""
        self._pause.close()
        self.shardgen_engine.close()

    # ------------------------------------------------------------------ internals
    @contextlib.contextmanager
    def _running(self) -> Iterator[None]:
        """Out of the pause for the block (local), back in after it (collective: ``paused()``).

        The engine's forwards all run out of the pause, so the model is in eval mode (no dropout)
        for exactly that long, and back in the trainer's mode for its step."""
        module = getattr(self.engine, "module", self.engine)
        was_training = module.training
        module.eval()
        self._pause.close()
        try:
            yield
        finally:
            try:
                self._pause.enter_context(self.shardgen_engine.paused())
            finally:
                module.train(was_training)

    @staticmethod
    def _check(sampling: Any) -> tuple[int, int | None]:
        """``(n, continuous_batch_size)`` of ``sampling``; ``ValueError`` naming the field. What it
        maps to (``_sampling_options``) is judged by ``SamplingParams``' rules, as at every door."""
        n, window = sampling.n_samples_per_prompt, sampling.continuous_batch_size
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"n_samples_per_prompt must be an integer >= 1, got {n!r}")
        if window is not None and (not isinstance(window, int) or window < 1):
            raise ValueError(f"continuous_batch_size must be None or an integer >= 1, got {window!r}")
        for name in ("max_new_tokens", "temperature", "top_p", "top_k"):  # no unset values there
            if getattr(sampling, name) is None:
                raise ValueError(f"{name} must be set in a SamplingConfig, got None")
        SamplingParams(**ShardgenRollout._sampling_options(sampling)).validate()
        return n, window

    @staticmethod
    def _sampling_options(sampling: Any) -> dict[str, Any]:
        """DeepSpeed's ``SamplingConfig`` as ``SamplingParams`` fields, by its own convention (as
        ``HybridEngineRollout`` reads it): a temperature <= 0 is greedy (top-p and top-k unused),
        a top_k <= 0 is off. Anything else is passed on as given, for the rules to judge."""
        t, k = sampling.temperature, sampling.top_k
        options: dict[str, Any] = {"max_new_tokens": sampling.max_new_tokens}
        if _is_number(t) and t <= 0.0:
            return {**options, "do_sample": False}
        top_k = 0 if _is_number(k) and k <= 0 else k
        return {**options, "do_sample": True, "temperature": t, "top_p": sampling.top_p, "top_k": top_k}

    def _options(self, sampling: Any, prompts: int, n: int) -> tuple[dict[str, Any], list[int | None]]:
        """The engine's request settings (``_check``-ed), and one seed per row (None: greedy)."""
        options = self._sampling_options(sampling)
        options.update(eos_token_id=self.eos, pad_token_id=self.pad, logprobs=True)
        if not options["do_sample"]:
            return options, [None] * (prompts * n)
        base = self.seed if self.seed is not None else random.SystemRandom().randrange(2**63)
        rank = self.shardgen_engine.rank
        seeds: list[int | None] = [sample_seed(base, self.calls, f"{rank}:{r}") for r in range(prompts * n)]
        return options, seeds

    def _serve(
        self, prompts: list[list[int]], seeds: list[int | None], options: dict[str, Any], window: int | None
    ) -> list[Completion]:
        """Every row's completion; at most ``window`` rows in flight, a finished one's place going to
        the next. Not collective (the engine's requests)."""
        window = window or max(len(prompts), 1)
        futures: list[cf.Future] = []
        while len(futures) < len(prompts):
            running = [f for f in futures if not f.done()]
            if len(running) >= window:
                cf.wait(running, return_when=cf.FIRST_COMPLETED)
                continue
            take = range(len(futures), min(len(prompts), len(futures) + window - len(running)))
            futures += self.shardgen_engine.submit_many(
                [prompts[i] for i in take], None, seed=[seeds[i] for i in take], **options
            )
        return [f.result() for f in futures]

    def _layout(self, request: Any, done: list[Completion], n: int, sampling: Any) -> Any:
        """DeepSpeed's ``RolloutBatch`` of the rows, in ``HybridEngineRollout``'s layout."""
        device, dtype = request.prompt_ids.device, torch.long  # token ids, as HF's generate returns
        continuous = sampling.continuous_batch_size is not None
        rows, width = len(done), request.prompt_ids.shape[1]
        g = max((len(c.token_ids) for c in done), default=0) if continuous else int(sampling.max_new_tokens)
        resp = torch.full((rows, g), self.pad, dtype=dtype)
        made = torch.zeros((rows, g), dtype=torch.bool)
        for i, c in enumerate(done):
            resp[i, : len(c.token_ids)] = torch.tensor(c.token_ids, dtype=dtype)
            made[i, : len(c.token_ids)] = True
        if continuous:  # its continuous path: 1 on every generated token
            attn = made.to(request.prompt_attention_mask.dtype)
        else:  # its default path: masked by id, the first EOS kept (_pad_after_eos)
            is_eos = torch.isin(resp, torch.tensor(self.eos, dtype=dtype)) & made
            first = is_eos & (is_eos.long().cumsum(-1) == 1)
            attn = (((resp != self.pad) & made) | first).long()
        prompt_ids = request.prompt_ids.repeat_interleave(n, dim=0).to(dtype)
        prompt_mask = request.prompt_attention_mask.repeat_interleave(n, dim=0).to(attn.dtype)
        return _ds.RolloutBatch(
            input_ids=torch.cat([prompt_ids, resp.to(device)], dim=1),
            attention_mask=torch.cat([prompt_mask, attn.to(device)], dim=1),
            response_start_idx=torch.full((rows,), width, dtype=torch.long, device=device),
        )
