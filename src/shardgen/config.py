"""Configuration dataclasses: the one source for the Python API and the CLI.

Every field has a docstring-style comment under it; ``shardgen.flags`` builds
flags from these fields, so a setting is declared exactly once.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

LIBRARY_DEFAULTS: dict[str, Any] = {
    "max_new_tokens": 64,
    "do_sample": False,
    "temperature": 1.0,
    "top_k": 0,
    "top_p": 1.0,
}
"""The values of the model-defaulted ``SamplingParams`` fields when neither the user nor the
model's ``generation_config`` sets them."""


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
    """Softmax temperature when sampling; must be > 0. None: the model's, else 1.0."""
    top_k: int | None = None
    """Keep only the k most likely tokens when sampling; 0 disables. None: the model's, else 0."""
    top_p: float | None = None
    """Nucleus sampling: keep the smallest set with cumulative probability >= top_p; in (0, 1].
    None: the model's, else 1.0."""
    seed: int | None = None
    """Per-request sampling seed: the same seed gives the same tokens on any rank, in any batch."""
    eos_token_id: int | list[int] | None = None
    """EOS id or ids; None takes the model's ``generation_config``."""
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
        model = model_defaults(generation_config)
        fill = {
            k: model.get(k, default) for k, default in LIBRARY_DEFAULTS.items() if getattr(self, k) is None
        }
        return dataclasses.replace(self, **fill) if fill else self

    def validate(self) -> None:
        """Raise ``ValueError`` (with the numbers) on a setting no request can run with.

        Unset fields are checked at their library default (the model's come from HF's own checks).
        """
        p = self.resolved()
        if not isinstance(p.max_new_tokens, int) or p.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {p.max_new_tokens!r}")
        if not (0.0 < float(p.top_p) <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {p.top_p!r}")
        if p.do_sample and not float(p.temperature) > 0.0:
            raise ValueError(f"temperature must be > 0 when sampling, got {p.temperature!r}")
        if not isinstance(p.top_k, int) or p.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {p.top_k!r}")
        if p.stop is not None:
            if isinstance(p.stop, str) or not all(isinstance(s, str) and s for s in p.stop):
                raise ValueError(f"stop must be a list of non-empty strings, got {p.stop!r}")

    def replace(self, **changes: Any) -> SamplingParams:
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ValueError(f"unknown generation option(s): {', '.join(sorted(unknown))}")
        return dataclasses.replace(self, **changes)


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


GATHER_POLICIES = ("per-layer", "stationary", "once", "auto")


@dataclass(kw_only=True)
class EngineConfig:
    """How the engine runs on every rank. Ranks must agree on every field marked (agreed)."""

    backend: str = "fsdp2"
    """(agreed) ``fsdp2``, ``deepspeed`` or ``local`` (no sharding)."""
    gather: str = "auto"
    """(agreed) ``per-layer`` (gather each unit on every forward), ``stationary`` (no big weight
    moves: each rank computes its rows' outputs for every rank's tokens; activations are
    exchanged), ``once`` (gather the whole model when work starts, decode without parameter
    traffic) or ``auto`` (``once`` if it fits ``memory_budget_gb``, else per forward the cheaper
    of ``stationary`` and ``per-layer`` for its token count)."""
    max_batch_size: int = 16
    """Requests decoded together on one rank."""
    refill: bool = True
    """Continuous batching: a finished slot takes a waiting request without waiting for the whole
    batch. False decodes in waves (a batch is exactly what HF would run)."""
    burst_steps: int = 8
    """Forwards a rank runs per tick when forwards need no gathers (gathered weights, local backend)."""
    gil_switch_interval: float | None = 0.0002
    """While an engine is open, Python's thread switch interval (s) is lowered to this, so a user
    thread busy in pure Python cannot starve the driver (in lockstep, one slow driver paces every
    rank). Restored when the last engine closes; None leaves the interpreter's setting alone."""
    idle_sleep_max: float = 0.005
    """Longest sleep (s) between ticks when no rank has work: bounds the latency of a new request."""
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
    """Budget for ``gather='auto'``; None uses 80% of the memory free once the model is loaded
    (CPU: the host's available memory split between its local ranks)."""
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

    def validate(self) -> None:
        if self.gather not in GATHER_POLICIES:
            names = ", ".join(map(repr, GATHER_POLICIES))
            raise ValueError(f"gather must be one of {names}, got {self.gather!r}")
        if self.gil_switch_interval is not None and not self.gil_switch_interval > 0:
            raise ValueError(
                f"gil_switch_interval must be > 0 seconds or None, got {self.gil_switch_interval}"
            )
        if self.bucket_mb is not None and not self.bucket_mb >= 0:
            raise ValueError(f"bucket_mb must be >= 0, got {self.bucket_mb}")
        if self.chunk_mb is not None and not self.chunk_mb >= 0:
            raise ValueError(f"chunk_mb must be >= 0, got {self.chunk_mb}")
        if self.burst_steps < 1:
            raise ValueError(f"burst_steps must be >= 1, got {self.burst_steps}")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        for name in ("init_timeout", "stall_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")

    def replace(self, **changes: Any) -> EngineConfig:
        """A copy with ``changes`` (``EngineConfig`` fields) applied; ``ValueError`` on unknown names."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ValueError(f"unknown engine option(s): {', '.join(sorted(unknown))}")
        return dataclasses.replace(self, **changes) if changes else self

    def agreed(self) -> dict[str, str]:
        """The settings every rank must share (checked collectively at construction)."""
        return {
            "backend": self.backend,
            "gather": self.gather,
            "debug_collectives": str(self.debug_collectives),
            "bucket_mb": str(self.bucket_mb),
            "chunk_mb": str(self.chunk_mb),
        }


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
    dtype: str = "auto"
    """Weights dtype: auto (the checkpoint's), float32, bfloat16, float16."""
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
    claim_order: str = "longest"
    """Order in which ranks claim prompts: longest (largest max_new_tokens, then longest prompt,
    first, so that no rank starts a long request last) or input."""
    quiet: bool = False
    """No progress bar and no summary table."""
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
        if self.model is not None:
            return self.model
        from shardgen.toy import toy_model_path

        return toy_model_path()

    def validate(self) -> None:
        if self.nproc is not None and self.nproc < 1:
            raise ValueError(f"--nproc must be >= 1, got {self.nproc}")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if self.temperature is not None and self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if self.shard_size is not None and self.shard_size < 1:
            raise ValueError(f"--shard-size must be >= 1, got {self.shard_size}")
        if self.shard_size is not None and self.nproc is not None and self.nproc % self.shard_size:
            # the launcher's check; a rank checks its world (torchrun) in jobs.run_job
            k, n = self.shard_size, self.nproc
            raise ValueError(f"--shard-size {k} must divide the world of {n} ranks (--nproc {n})")
        if self.claim_order not in ("longest", "input"):
            raise ValueError(f"--claim-order must be longest or input, got {self.claim_order!r}")
        if self.dtype != "auto" and self.dtype not in ("float32", "float16", "bfloat16", "float64"):
            raise ValueError(f"--dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")


def context_length(config: Any) -> int | None:
    """The model's context window, from the names HF configs use for it."""
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx"):
        v = getattr(config, name, None)
        if isinstance(v, int) and v > 0:
            return v
    return None
