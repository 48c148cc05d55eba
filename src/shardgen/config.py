"""Configuration dataclasses: the one source for the Python API and the CLI.

Every field has a docstring-style comment under it; ``shardgen.flags`` builds
flags from these fields, so a setting is declared exactly once.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass, field
from typing import Any

from shardgen import rules
from shardgen.rules import Rule, boolean, integer, mapping, number, one_of, strings, token_ids
from shardgen.suggest import did_you_mean

LIBRARY_DEFAULTS: dict[str, Any] = {
    "max_new_tokens": 64,
    "do_sample": False,
    "temperature": 1.0,
    "top_k": 0,
    "top_p": 1.0,
}
"""The values of the model-defaulted ``SamplingParams`` fields when neither the user nor the
model's ``generation_config`` sets them."""

BACKEND_NAMES = ("fsdp2", "deepspeed", "local")


def check_backend_name(name: str) -> None:
    """Raise ``ValueError`` unless ``name`` is a backend (``backend="fsdp"``: did you mean fsdp2?).
    Not collective: checked before any."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"backend must be one of {', '.join(BACKEND_NAMES)}, got {name!r}{_nearest(name)}")


def _nearest(name: Any) -> str:
    """`` (did you mean fsdp2?)`` for a mistyped backend name, as the CLI says it of a flag."""
    return did_you_mean(name, BACKEND_NAMES) if isinstance(name, str) else ""


GATHER_POLICIES = ("per-layer", "stationary", "once", "auto")
NUMERICS = ("fast", "invariant")
DTYPES = ("auto", "float32", "bfloat16", "float16", "float64")
CLAIM_ORDERS = ("longest", "input")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


@dataclass(kw_only=True)
class SamplingParams:
    """How one request is decoded. Defaults: the model's ``generation_config``, else greedy.

    ``max_new_tokens``, ``do_sample``, ``temperature``, ``top_k`` and ``top_p`` left at None take
    the model's ``generation_config`` value where it sets one (as HF ``generate()`` does), else
    ``LIBRARY_DEFAULTS``; ``resolved()`` fills them, once per request.
    """

    max_new_tokens: int | None = None
    """Most tokens to generate for the request (EOS included). None: the model's, else 64."""
    do_sample: bool | None = None
    """Sample from the distribution (True) or take the argmax (False, greedy). None: the model's, else
    False."""
    temperature: float | None = None
    """Softmax temperature when sampling: a finite number >= 0, and > 0 when sampling (greedy
    ignores it). None: the model's, else 1.0."""
    top_k: int | None = None
    """Keep only the k most likely tokens when sampling; 0 disables. None: the model's, else 0."""
    top_p: float | None = None
    """Nucleus sampling: keep the smallest set with cumulative probability >= top_p; in (0, 1].
    None: the model's, else 1.0."""
    seed: int | None = None
    """Per-request sampling seed: the same seed gives the same tokens on any rank, in any batch."""
    eos_token_id: int | list[int] | None = None
    """EOS id or ids; None takes the model's ``generation_config`` (as HF's ``generate`` does);
    ``[]`` none at all: every row runs to ``max_new_tokens``."""
    pad_token_id: int | None = None
    """Pad id written after EOS; None takes the model's, else the first EOS id (as HF does)."""
    stop: list[str] | None = None
    """Stop strings: a request ends (finish reason ``stop``) at the first token whose decoded text
    completes one of them; that token is kept. Matched on the text the tokenizer decodes (special
    tokens skipped), so the engine needs a tokenizer."""
    logprobs: bool = False
    """Return the log-probability of each chosen token under ``softmax(logits / temperature)``, the
    distribution RL trainers recompute (never truncated by top-k / top-p)."""
    raw_logprobs: bool = False
    """Take logprobs under the untempered ``softmax(logits)`` instead."""

    def resolved(self, generation_config: Any = None) -> SamplingParams:
        """Every model-defaulted field filled: this object's value if set, else the model's
        ``generation_config`` value where the model sets it (``model_defaults``), else
        ``LIBRARY_DEFAULTS``."""
        unset = [k for k in LIBRARY_DEFAULTS if getattr(self, k) is None]
        if not unset:  # (resolved already: the model's config is not read again, per request)
            return self
        model = model_defaults(generation_config)
        return dataclasses.replace(self, **{k: model.get(k, LIBRARY_DEFAULTS[k]) for k in unset})

    def validate(self) -> None:
        """Raise ``ValueError`` (with the numbers) on a setting no request can run with; the
        message names every such setting (``problems()``)."""
        problems = self.problems()
        if problems:
            raise ValueError("; ".join(problems))

    def problems(self) -> list[str]:
        """What makes this request impossible to run, one message per setting (with the numbers).

        Every field is judged by its rule (``SAMPLING_RULES``, the same at every door: the API,
        the CLI, the prompts file, ``ShardgenRollout``); unset fields at their library default
        (the model's come from HF's own checks). Then the one rule between fields, HF's:
        sampling needs a temperature > 0 (greedy ignores it).
        """
        p = self.resolved()
        values = {f.name: getattr(p, f.name) for f in dataclasses.fields(p)}
        out = rules.problems(SAMPLING_RULES, values)
        temperature_ok = SAMPLING_RULES["temperature"].problem("temperature", p.temperature) is None
        if p.do_sample is True and temperature_ok and p.temperature == 0:
            out.append(f"temperature must be > 0 when sampling, got {p.temperature!r}")
        return out

    def token_id_problems(self, vocab_size: int | None) -> list[str]:
        """The EOS and pad ids this request sets that a model of ``vocab_size`` tokens cannot
        produce (an EOS id out of range would never end the request: it would run to
        ``max_new_tokens``). None: nothing to check against."""
        if not isinstance(vocab_size, int) or vocab_size <= 0:
            return []
        out = []
        for name in ("eos_token_id", "pad_token_id"):
            v = getattr(self, name)
            if v is None or SAMPLING_RULES[name].problem(name, v) is not None:
                continue  # unset, or not ids at all (its rule says so: ``problems()``)
            ids = list(v) if isinstance(v, list | tuple) else [v]
            bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < vocab_size)]
            if bad:
                said = ", ".join(map(repr, bad))
                out.append(f"{name} {said} is outside the model's vocabulary [0, {vocab_size})")
        return out

    def replace(self, **changes: Any) -> SamplingParams:
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ValueError(f"unknown generation option(s): {', '.join(sorted(unknown))}")
        return dataclasses.replace(self, **changes)


TEMPERATURE = number(0).optional()
"""``temperature``'s rule, also ``--temperature``'s (``JobConfig``): a finite number >= 0; 0 is
greedy (HF: sampling needs > 0, greedy ignores it)."""

SAMPLING_RULES: dict[str, Rule] = {
    "max_new_tokens": integer(1).optional(),
    "do_sample": boolean().optional(),
    "temperature": TEMPERATURE,
    "top_k": integer(0).optional(),
    "top_p": number(0, above=True, high=1).optional(),
    "seed": integer().optional(),
    "eos_token_id": token_ids().optional(),
    "pad_token_id": integer(0).optional(),
    "stop": strings().optional(),
    "logprobs": boolean(),
    "raw_logprobs": boolean(),
}
"""One rule per ``SamplingParams`` field, the same at every door (None: unset, where allowed)."""


def model_defaults(generation_config: Any) -> dict[str, Any]:
    """The model-defaulted fields the model's ``generation_config`` sets, decided as HF
    ``generate()`` decides (transformers 5.x ``_prepare_generation_config``): a value counts
    as set when it is not None and differs from a bare ``GenerationConfig()``'s."""
    if generation_config is None:
        return {}
    bare = _bare_generation_config()
    out = {}
    for name in LIBRARY_DEFAULTS:
        value = getattr(generation_config, name, None)
        if value is not None and value != getattr(bare, name, None):
            out[name] = value
    return out


@functools.cache
def _bare_generation_config() -> Any:
    from transformers import GenerationConfig

    return GenerationConfig()


@dataclass(kw_only=True)
class EngineConfig:
    """How the engine runs on every rank. Ranks must agree on every field marked (agreed)."""

    backend: str = field(default="fsdp2", metadata={"choices": BACKEND_NAMES})
    """(agreed) ``fsdp2``, ``deepspeed`` or ``local`` (no sharding). ``Engine(model, backend=None)``
    picks it from the model (a ``DeepSpeedEngine`` or ZeRO-3-partitioned module: ``deepspeed``;
    a ``fully_shard``-ed or plain module: ``fsdp2``); a backend that cannot run the model given
    is a ``ValueError`` at construction, before any collective (``backends/kinds.py``)."""
    gather: str = field(default="auto", metadata={"choices": GATHER_POLICIES})
    """(agreed) ``per-layer`` (gather each unit on every forward), ``stationary`` (no big weight
    moves: each rank computes its rows' outputs for every rank's tokens; activations are
    exchanged), ``once`` (gather the whole model when work starts, decode without parameter
    traffic; freed when every rank is idle, kept between a multi-turn call's turns) or ``auto``
    (``once`` if it fits ``memory_budget_gb``, else per forward the cheaper of ``stationary``
    and ``per-layer`` for its token count)."""
    max_batch_size: int | None = None
    """Requests decoded together on one rank. None: sized from ``memory_budget_gb``, as many rows as
    their KV cache (2048 tokens a row, capped by the model's context) fits next to the weights a
    forward holds, at most 256 (``engine.config`` holds the size chosen)."""
    refill: bool = True
    """Continuous batching: a finished slot takes a waiting request without waiting for the whole
    batch. False decodes in waves (a batch is exactly what HF would run)."""
    burst_steps: int = 8
    """Forwards a rank runs per tick when forwards need no gathers (gathered weights, local backend)."""
    gil_switch_interval: float | None = 0.0002
    """While an engine is open, Python's thread switch interval (s) is lowered to this, so a user
    thread busy in pure Python cannot starve the driver (in lockstep, one slow driver paces every
    rank). Restored while every open engine is paused (no driver has a forward to pace) and when
    the last engine closes; None leaves the interpreter's setting alone."""
    idle_sleep_max: float = 0.05
    """Longest sleep (s) between ticks when no rank has work: bounds the latency of a new request.
    For the first second of idleness the sleeps stay under 5 ms (``core/driver.py``), so only a
    request after a long idle waits up to this; meanwhile an idle engine ticks 20 times a second."""
    init_timeout: float = 300.0
    """Seconds the collective constructor waits for every rank to arrive before naming the absent ones."""
    stall_timeout: float = 60.0
    """Seconds without a heartbeat after which a peer is declared stalled."""
    debug_collectives: bool = False
    """(agreed) Fold a fingerprint of each rank's collective sequence into every tick; a mismatch raises
    ``CollectiveDivergenceError`` instead of hanging."""
    timeline: bool = False
    """Record what the driver does over time (``engine.timeline()``: prefill, decode, shadow, gather,
    tick, idle spans); off by default (one list append per tick phase when on)."""
    memory_budget_gb: float | None = None
    """Budget for ``gather='auto'`` and an unset ``max_batch_size``; None uses 80% of the memory free
    once the model is loaded (CPU: the host's available memory split between its local ranks)."""
    ds_config: dict[str, Any] | None = field(default=None)
    """DeepSpeed config (ZeRO stage 3) when shardgen partitions a plain model with ``backend='deepspeed'``."""
    bucket_mb: float | None = None
    """(agreed) ``backend='deepspeed'``, per-layer gathers: full parameters fetched by one coalesced
    all-gather (consecutive modules in module order; on accelerators the next bucket travels while
    one computes). None: 4 on CPU (measured best there: large buffers cost more than collectives),
    64 on accelerators. 0 gathers module by module, as DeepSpeed's own hooks do."""
    chunk_mb: float | None = None
    """(agreed) Per-layer gathers of a model shardgen shards (fsdp2, deepspeed): the input
    embeddings and the LM head are gathered in row chunks of at most this many MB of full
    weights, never whole. None: half the largest decoder layer (gloo gathers through a temporary
    copy: a chunk then costs at most a layer); 0: whole (one gather)."""
    share_prefill: bool = True
    """Requests with the same prompt (the n samples of a rollout) in one batch prefill it once; its
    KV cache is copied into each row and the LM head runs on every row. Off: every row computes
    its prompt (the same batches, the same rows). Per rank: one forward per tick either way."""
    max_prefill_tokens: int | None = None
    """(agreed) Most tokens (rows x prompt columns, padding included) one prefill forward computes:
    a larger prefill runs in chunks, one per tick, so that a long prompt does not hold every
    rank's tick for many decode steps (at least one column of every row per chunk). None: whole
    prompts (docs/PERFORMANCE.md: 1024-2048 evens ticks at the same throughput on CPU)."""
    numerics: str = field(default="fast", metadata={"choices": NUMERICS})
    """``fast``: the kernels torch picks for each shape (a row's logits may differ in the last
    bits with the batch it is in). ``invariant``: every row's result depends on that row alone
    (``shardgen.numerics``): the same request and seed give the same bits batched or alone,
    chunked, shared or from the prefix cache, and a trainer forward inside
    ``shardgen.invariant_numerics()`` gives the rollout's logprobs bit for bit. A model it cannot
    serve (sliding-window attention, mixture of experts, attention other than sdpa) is a
    ``ValueError`` at construction."""
    prefix_cache_tokens: int | None = None
    """The prefix cache (``generation/prefix_cache.py``): finished sequences' KV, kept per rank up to
    this many tokens, least recently used out, so that a prompt that extends one (the next turn
    of a conversation) or shares a prefix with one (a system prompt) prefills only the rest.
    Dropped whenever the weights may change (``paused()``, a ``train()``/``eval()`` switch,
    ``close()``). None: a quarter of ``memory_budget_gb`` left beside the batch's KV cache; 0: off."""
    speculate: int | None = None
    """Speculative decoding from history (``generation/drafts.py``, ``verify.py``): a decode step
    may feed each row's draft of up to this many tokens, taken from text the engine has seen (its
    prompt, the other samples of its prompt, earlier rollouts of it on any rank), and keep the
    tokens the plain engine draws (the same rows: bit for bit under ``numerics="invariant"``).
    The forward's width follows the rows' acceptance; a verify forward's tokens stay within
    ``max_prefill_tokens``. Rows of an encoder-decoder, an M-RoPE VLM or a model whose cache is
    not plain per column (sliding windows, recurrent states) decode plainly. 0: off. None: on
    (``DEFAULT_SPECULATE``) under ``numerics="invariant"``, where the rows are the plain engine's
    bit for bit; off on the fast path, where a verify forward's logits may differ from a
    one-token step's in the last bits (the rows are then the same tokens except at near-ties,
    and no longer always HF ``generate()``'s); ``engine.config`` holds the length chosen. On or
    off alike on every rank (checked at construction); the length may differ."""
    speculate_history_tokens: int = 50_000
    """With ``speculate``: tokens of finished rollouts kept per rank to draft from (its own and
    those the other ranks share), indexed by prompt (least recently used prompt out) and across
    prompts (the latest), kept across calls and training steps (a stale draft only lowers the
    acceptance; about 200 bytes a token per index). 0: drafts from the live rows only, nothing
    shared (the tick carries no payload, as with ``speculate_share=False``)."""
    speculate_share: bool = True
    """With ``speculate`` on more than one rank: each rank's finished rollouts ride in the tick's
    all-gather to the other ranks (at most ``16384 // world`` ints a rank per tick, 64 to 512),
    so a prompt a trainer's sampler deals to another rank next epoch drafts from its earlier
    rollouts there. False: each rank drafts from its own rollouts and the tick carries its rows
    alone (the same on every rank where ``speculate`` is on: it sets the tick's size). Off too
    where ``speculate_history_tokens`` is 0 (nothing is kept to share)."""

    def validate(self) -> None:
        """Raise ``ValueError`` naming every field its rule refuses (``ENGINE_RULES``, the same
        for ``Engine(...)``, ``shardgen run``'s flags and ``ShardgenRollout``'s options)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        problems = rules.problems(ENGINE_RULES, values)
        bad_backend = ENGINE_RULES["backend"].problem("backend", self.backend)
        if bad_backend is not None:  # a mistyped name gets the nearest one
            problems[problems.index(bad_backend)] += _nearest(self.backend)
        if problems:
            raise ValueError("; ".join(problems))

    def replace(self, **changes: Any) -> EngineConfig:
        """A copy with ``changes`` (``EngineConfig`` fields) applied; ``ValueError`` on unknown names."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ValueError(f"unknown engine option(s): {', '.join(sorted(unknown))}")
        return dataclasses.replace(self, **changes) if changes else self

    @property
    def shares_rollouts(self) -> bool:
        """Finished rollouts go to the other ranks in the tick (where there are some):
        ``speculate`` and ``speculate_share`` on, and a history to keep them in."""
        return bool(self.speculate) and self.speculate_share and self.speculate_history_tokens > 0

    def agreed(self) -> dict[str, str]:
        """The settings every rank must share (checked collectively at construction)."""
        return {
            "backend": self.backend,
            "gather": self.gather,
            "debug_collectives": str(self.debug_collectives),
            "bucket_mb": str(self.bucket_mb),
            "chunk_mb": str(self.chunk_mb),
            "max_prefill_tokens": str(self.max_prefill_tokens),
            # On or off (its length may differ per rank): with it on, the tick carries shared rollouts.
            "speculate": "on" if self.speculate else "off",
            # Whether the tick carries a payload of shared rollouts: ranks that do not speculate
            # may differ in speculate_share, and ranks that keep no history share nothing.
            "speculate_share and speculate_history_tokens > 0": str(self.shares_rollouts),
        }


#: Most draft tokens a verify forward feeds per row (longer drafts are rarely all accepted).
MAX_SPECULATE = 16
#: ``speculate`` where it is unset and the rows are the plain engine's bit for bit
#: (``numerics="invariant"``): the length the speed figures were measured at (PERFORMANCE 22).
DEFAULT_SPECULATE = 16


def resolved_speculate(config: EngineConfig) -> EngineConfig:
    """``config`` with ``speculate`` set: unset, ``DEFAULT_SPECULATE`` under invariant numerics
    (speculation changes no bit there), else 0."""
    if config.speculate is not None:
        return config
    return config.replace(speculate=DEFAULT_SPECULATE if config.numerics == "invariant" else 0)


SECONDS = number(0, above=True)  # finite: nothing waits without a bound
ENGINE_RULES: dict[str, Rule] = {
    "backend": one_of(BACKEND_NAMES).optional(),  # None: Engine(...) picks it from the model
    "gather": one_of(GATHER_POLICIES),
    "max_batch_size": integer(1).optional(),
    "refill": boolean(),
    "burst_steps": integer(1),
    "gil_switch_interval": number(0, above=True).optional(),
    "idle_sleep_max": number(0),
    "init_timeout": SECONDS,
    "stall_timeout": SECONDS,
    "debug_collectives": boolean(),
    "timeline": boolean(),
    "memory_budget_gb": number(0).optional(),
    "ds_config": mapping().optional(),
    "bucket_mb": number(0).optional(),
    "chunk_mb": number(0).optional(),
    "share_prefill": boolean(),
    "max_prefill_tokens": integer(1).optional(),
    "prefix_cache_tokens": integer(0).optional(),
    "numerics": one_of(NUMERICS),
    "speculate": integer(0, MAX_SPECULATE).optional(),
    "speculate_history_tokens": integer(0),
    "speculate_share": boolean(),
}
"""One rule per ``EngineConfig`` field, the same at every door (None: unset, where allowed)."""


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
    dtype: str = field(default="auto", metadata={"choices": DTYPES})
    """Weights dtype: auto (the checkpoint's) or the one named."""
    nproc: int | None = None
    """Spawn this many local ranks with torch's launcher. Without it: one rank, or this process
    as one rank when launched by torchrun (RANK is set)."""
    max_restarts: int = 0
    """Restarts torch's elastic agent may make after a rank fails (with --nproc); a restarted job
    resumes from the journals."""
    resume: bool = False
    """Skip the prompts already answered in the journals of an earlier run or in --out."""
    temperature: float | None = None
    """Sampling temperature: > 0 samples (do_sample), 0 is greedy; unset: the model's
    generation_config decides (else greedy). A prompt line may set its own."""
    seed: int = 0
    """Base seed: a sampled request without its own seed gets one derived from (seed, id), so its
    tokens do not depend on the rank that served it."""
    shard_size: int | None = None
    """Ranks per replica: world/K replicas of K consecutive ranks, each sharding the model K ways
    with its own engine, all claiming from the one prompts file (K must divide the world).
    Default: one engine over all ranks."""
    claim_order: str = field(default="longest", metadata={"choices": CLAIM_ORDERS})
    """Order in which ranks claim prompts: longest (largest max_new_tokens, then longest prompt,
    first, so that no rank starts a long request last) or input."""
    quiet: bool = False
    """No progress bar, no summary table, no log lines but errors (unless --log-level says otherwise)."""
    log_level: str | None = field(default=None, metadata={"choices": LOG_LEVELS})
    """Log lines shown (rank 0; the other ranks show warnings and errors): unset is warning (error
    with --quiet), or SHARDGEN_LOG_LEVEL when set."""
    json_summary: str | None = None
    """Also write the summary as JSON to this file."""
    timeline: str | None = None
    """Draw each rank's timeline (prefill, decode, shadow, gather, idle over time) to this PNG
    (needs matplotlib: pip install 'shardgen[plot]')."""
    no_claim_ranks: list[int] = field(default_factory=list, metadata={"hidden": True})
    """Ranks that never claim prompts (demo and tests: a rank with no work must not block others)."""
    away_rank: int | None = field(default=None, metadata={"hidden": True})
    """Rank whose main thread sleeps away_s once it has work in flight (demo and tests)."""
    away_s: float = field(default=3.0, metadata={"hidden": True})
    """Seconds the away_rank's main thread sleeps."""

    @property
    def model_path(self) -> str:
        """``--model`` (``~`` expanded: ``--model=~/x`` reaches us unexpanded), else the toy model."""
        if self.model is not None:
            return os.path.expanduser(self.model)
        from shardgen.toy import toy_model_path

        return toy_model_path()

    def validate(self) -> None:
        if self.nproc is not None and self.nproc < 1:
            raise ValueError(f"--nproc must be >= 1, got {self.nproc}")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        said = TEMPERATURE.problem("--temperature", self.temperature)  # a prompt line's rule too
        if said is not None:
            raise ValueError(said)
        if self.shard_size is not None and self.shard_size < 1:
            raise ValueError(f"--shard-size must be >= 1, got {self.shard_size}")
        if self.shard_size is not None and self.nproc is not None and self.nproc % self.shard_size:
            # the launcher's check; a rank checks its world (torchrun) in jobs.run_job
            k, n = self.shard_size, self.nproc
            raise ValueError(f"--shard-size {k} must divide the world of {n} ranks (--nproc {n})")
        if self.claim_order not in CLAIM_ORDERS:
            raise ValueError(f"--claim-order must be longest or input, got {self.claim_order!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.log_level is not None and self.log_level not in LOG_LEVELS:
            raise ValueError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")


def context_length(config: Any) -> int | None:
    """The model's context window, from the names HF configs use for it."""
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx"):
        v = getattr(config, name, None)
        if isinstance(v, int) and v > 0:
            return v
    return None
