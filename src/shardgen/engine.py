"""The Engine: a driver thread per rank that owns the model and runs the tick protocol.

    torchrun --nproc-per-node 2 examples/basic.py

User threads call ``generate()`` / ``generate_ids()`` / ``submit()`` (NOT collective:
any rank, any number of times, zero included); requests go to a queue; the
driver thread moves them into batches and, once per tick, agrees with the other
drivers (``protocol.py``) and runs exactly one forward or none. ``Engine(...)``,
``paused()`` and ``close()`` are collective.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from . import comm
from .backends import Backend, make_backend
from .backends.base import describe_model
from .config import EngineConfig, SamplingParams
from .errors import EngineClosedError, PeerFailedError, PeerStalledError, RendezvousTimeoutError
from .liveness import Liveness, is_comm_error
from .log import get_logger
from .memory import kv_cache_bytes, memory_budget
from .protocol import (
    FINGERPRINT,
    LIVE,
    NCOLS,
    OPEN,
    PAUSE,
    PENDING,
    ControlPlane,
    Decision,
    Fingerprint,
    TickState,
    check_fingerprints,
    decide,
)
from .requests import Completion, Request, build_request, completion_of, resolve_future
from .scheduler import LocalWork

if TYPE_CHECKING:
    from .rollout import RolloutBatch

log = get_logger()


@dataclass
class EngineStats:
    """Counters of one rank's driver (``engine.stats()``)."""

    ticks: int = 0
    forward_ticks: int = 0  # ticks that decided FORWARD (every rank forwarded)
    forwards: int = 0  # real forwards: prefills + decode steps
    prefills: int = 0  # waves and refills
    refills: int = 0  # prefills that joined a running batch
    decode_steps: int = 0
    shadow_forwards: int = 0
    idle_ticks: int = 0
    requests: int = 0
    generated_tokens: int = 0
    forward_s: float = 0.0  # time in real and shadow forwards
    control_s: float = 0.0  # time in the tick's all-reduce
    busy_s: float = 0.0  # time in real forwards only

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Engine:
    """Deadlock-free generation on a model sharded across all ranks.

    ``Engine(model, tokenizer=tok, backend="fsdp2")`` is collective: every rank
    constructs it, with the same settings and the same model architecture, and
    engines are constructed in the same order on every rank. In order, it:
    waits for every rank on the store (``init_timeout``, naming absent ranks);
    creates two groups with ``new_group`` on the default group; all-gathers the
    settings on the control group; shards the model on the parameter group; and,
    for ``gather="auto"``, all-reduces whether the full model fits.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        *,
        config: EngineConfig | None = None,
        device: torch.device | str | None = None,
        **overrides: Any,
    ) -> None:
        cfg = config if config is not None else EngineConfig()
        if overrides:
            unknown = set(overrides) - set(EngineConfig.__dataclass_fields__)
            if unknown:
                raise ValueError(f"unknown engine option(s): {', '.join(sorted(unknown))}")
            cfg = EngineConfig(**{**asdict(cfg), **overrides})
        cfg.validate()
        self.config = cfg
        self.tokenizer = tokenizer
        self._lock = threading.Lock()
        self._inbox: deque[Request] = deque()
        self._open_reqs: set[Request] = set()  # submitted, not yet resolved (under _lock)
        self._live: Liveness | None = None
        self._wake = threading.Event()
        self._closed = False
        self._failed: BaseException | None = None
        self._pause_wanted = False
        self._paused = threading.Event()
        self._resume = threading.Event()
        self._stats = EngineStats()
        self._fp = Fingerprint()
        self._last_state: TickState | None = None
        self._last_forward_t = time.monotonic()
        self.phase = "init"
        self.tick = 0

        if dist.is_available() and dist.is_initialized():
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
        elif cfg.backend == "local":
            self.rank, self.world = 0, 1
        else:
            raise ValueError(
                f"backend {cfg.backend!r} needs torch.distributed: call shardgen.init() first "
                "(or use backend='local')"
            )
        self.device = torch.device(device) if device is not None else _model_device(model)
        raw = getattr(model, "module", model)  # a DeepSpeedEngine wraps the HF model
        self._hf_config = raw.config
        self._gen_config = getattr(raw, "generation_config", None)

        self._control = self._params = None
        self._store: Any = None
        self._pause_epoch = 0
        if dist.is_initialized():
            self.engine_id = comm.next_engine_id()
            self._store = store = comm.default_store()
            comm.arrive(store, f"shardgen/engine{self.engine_id}", self.rank, self.world, cfg.init_timeout)
            # Liveness bounds every wait; the groups' own timeouts are only a backstop.
            self._control, self._params = comm.private_groups(
                control_timeout_s=max(3600.0, 10 * cfg.stall_timeout),
                param_timeout_s=cfg.stall_timeout + 30.0,
            )
            settings = {**cfg.agreed(), **describe_model(raw), "world_size": str(self.world)}
            comm.check_same_settings(settings, self._control, self.rank, self.world)
        options = {"ds_config": cfg.ds_config} if cfg.backend == "deepspeed" else {}
        self.backend: Backend = make_backend(
            cfg.backend, model, param_group=self._params, device=self.device, options=options
        )
        self.model = self.backend.hf_model
        if cfg.debug_collectives:
            self.backend.instrument()
        self._gathered = False
        self.gather_policy = self._resolve_gather_policy()
        self._cp = ControlPlane(self._control, self.rank, self.world)
        self._work = LocalWork(
            self.model, self.backend, self.device, cfg, self._stats, on_finished=self._finished
        )
        self._thread = threading.Thread(target=self._run, name=f"shardgen-driver-r{self.rank}", daemon=True)
        if self._store is not None and self.world > 1:
            self._live = Liveness(
                self._store,
                f"shardgen/engine{self.engine_id}",
                self.rank,
                self.world,
                cfg.stall_timeout,
                status=lambda: (self.tick, self.phase),
                on_failure=self._on_peer_failure,
            )
            self._live.start()
        _ENGINES.add(self)
        _lower_switch_interval(cfg.gil_switch_interval)
        self._thread.start()

    # ------------------------------------------------------------------ construction helpers
    @classmethod
    def from_pretrained(
        cls,
        path: str,
        *,
        dtype: torch.dtype | str | None = None,
        tokenizer: Any = None,
        **kwargs: Any,
    ) -> Engine:
        """Load an HF causal LM (and its tokenizer) from ``path`` and build the engine. Collective."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if isinstance(dtype, str):
            dtype = getattr(torch, dtype) if dtype != "auto" else None
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        if tokenizer is None:
            try:
                tokenizer = AutoTokenizer.from_pretrained(path)
            except (OSError, ValueError):
                tokenizer = None
        return cls(model, tokenizer, **kwargs)

    # ------------------------------------------------------------------ user API (not collective)
    def submit(self, prompt: str | Sequence[int] | torch.Tensor, **options: Any) -> Future:
        """Queue one request; returns a ``Future[Completion]``. Not collective."""
        return self._submit_many([prompt], options)[0]

    def generate(
        self, prompts: str | Sequence[str] | Sequence[Sequence[int]], **options: Any
    ) -> list[Completion]:
        """Generate for each prompt (text, or token ids); blocks until all are done. Not collective.

        ``options`` are ``SamplingParams`` fields; ``seed`` may be a list (one per prompt).
        """
        if isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        futures = self._submit_many(list(prompts), options)
        return [f.result() for f in futures]

    def generate_ids(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **options: Any
    ) -> torch.Tensor:
        """HF-shaped generation: ``[B, T]`` left-padded ids -> ``[B, T + G]``, post-EOS padded.

        Returns exactly what HF ``generate()`` returns for the same batch: the input
        columns unchanged, then G = the longest generation; finished rows are padded.
        Not collective.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask shape {tuple(attention_mask.shape)} != "
                f"input_ids shape {tuple(input_ids.shape)}"
            )
        rows = [ids[m.bool()] for ids, m in zip(input_ids.cpu(), attention_mask.cpu(), strict=True)]
        reqs = self._submit_many(rows, options, as_requests=True)
        done = [r.future.result() for r in reqs]
        width = max(len(c.token_ids) for c in done)
        out = torch.empty((input_ids.shape[0], input_ids.shape[1] + width), dtype=torch.long)
        out[:, : input_ids.shape[1]] = input_ids.cpu()
        for i, (r, c) in enumerate(zip(reqs, done, strict=True)):
            out[i, input_ids.shape[1] :] = r.seq.pad_id
            out[i, input_ids.shape[1] : input_ids.shape[1] + len(c.token_ids)] = torch.tensor(c.token_ids)
        return out.to(input_ids.device)

    def rollout(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        params: SamplingParams | None = None,
        *,
        n: int = 1,
        **overrides: Any,
    ) -> RolloutBatch:
        """``n`` samples per prompt as trainer-ready padded tensors (``shardgen.rollout``). Not collective."""
        from .rollout import rollout

        return rollout(self, prompts, params, n=n, **overrides)

    def stats(self) -> dict[str, Any]:
        """This rank's driver counters (a snapshot)."""
        return self._stats.as_dict()

    # ------------------------------------------------------------------ collective API
    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Collective: every rank enters; inside, the engine issues no traffic at all.

        The pause begins once every rank asked for it and every live sequence
        finished (requests still queued wait); it ends on each rank when its block exits.
        Ranks that never enter are named in a ``RendezvousTimeoutError`` once this rank
        has waited ``stall_timeout`` with no forward anywhere.
        """
        self._check_usable()
        with self._lock:
            self._pause_wanted = True
            self._resume.clear()
        self._wake.set()
        called = time.monotonic()
        try:
            while not self._paused.wait(0.05):
                self._raise_if_failed()
                self._bound_wait(called, self.config.stall_timeout, PAUSE, "paused()", "entered paused()")
            yield
        finally:
            with self._lock:
                self._pause_wanted = False
            self._resume.set()

    def close(self, timeout: float | None = None) -> None:
        """Collective join: stop taking requests, finish all work on every rank, stop the driver.

        Returns once every rank closed and all work is done. A rank that never closes
        is named in a ``RendezvousTimeoutError`` once this call has waited ``timeout``
        seconds (default: ``stall_timeout``) with no forward anywhere. Idempotent.
        """
        with self._lock:
            self._closed = True
        self._wake.set()
        limit = self.config.stall_timeout if timeout is None else timeout
        called = time.monotonic()
        while self._thread.is_alive() and self._failed is None:
            self._thread.join(0.05)
            if self._thread.is_alive():
                self._bound_wait(called, limit, OPEN, "close()", "called close()", absent_if=1)
        self._raise_if_failed()
        self._teardown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.close()
        else:  # the block raised: still join (peers may need our shadow forwards)
            with contextlib.suppress(Exception):
                self.close()

    # ------------------------------------------------------------------ internals: user side
    def _check_usable(self) -> None:
        if self._closed:
            raise EngineClosedError(f"rank {self.rank}: engine is closed")
        self._raise_if_failed()

    def _bound_wait(
        self, called: float, limit: float, col: int, what: str, never: str, absent_if: int = 0
    ) -> None:
        """Raise ``RendezvousTimeoutError`` naming the ranks whose column ``col`` (last tick) is
        ``absent_if``, once ``what`` has waited ``limit`` s with no forward anywhere. Idle time
        before the call does not count."""
        if time.monotonic() - max(called, self._last_forward_t) <= limit:
            return
        st = self._last_state
        absent = [r for r, v in enumerate(st.col(col)) if v == absent_if] if st is not None else []
        raise RendezvousTimeoutError(
            f"rank {self.rank}: {what} waited {limit:g}s with no work left; rank(s) {absent} never {never}"
        )

    def _raise_if_failed(self) -> None:
        if self._failed is not None:
            raise self._failed

    def _submit_many(
        self, prompts: list[Any], options: dict[str, Any], as_requests: bool = False
    ) -> list[Any]:
        self._check_usable()
        seeds = options.pop("seed", None)
        if isinstance(seeds, (list, tuple)):
            if len(seeds) != len(prompts):
                raise ValueError(f"got {len(seeds)} seeds for {len(prompts)} prompts")
        else:
            seeds = [seeds] * len(prompts)
        base = SamplingParams().replace(**options)
        reqs = [
            build_request(
                self._encode(p),
                base.replace(seed=s),
                model_config=self._hf_config,
                generation_config=self._gen_config,
                tokenizer=self.tokenizer,
            )
            for p, s in zip(prompts, seeds, strict=True)
        ]
        with self._lock:
            if self._closed:
                raise EngineClosedError(f"rank {self.rank}: engine is closed")
            self._inbox.extend(reqs)
            self._open_reqs.update(reqs)
        self._wake.set()
        return reqs if as_requests else [r.future for r in reqs]

    def _encode(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer: Engine(model, tokenizer=...)")
            if not prompt:
                raise ValueError("empty prompt: a request needs at least one prompt token")
            return list(self.tokenizer(prompt)["input_ids"])
        if isinstance(prompt, torch.Tensor):
            return [int(t) for t in prompt.reshape(-1).tolist()]
        return [int(t) for t in prompt]

    # ------------------------------------------------------------------ internals: driver thread
    def _run(self) -> None:
        torch.set_grad_enabled(False)  # grad mode is per thread
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - every failure must reach the user threads
            err = self._attribute(e)
            if err is e and self._live is not None and not isinstance(e, PeerFailedError):
                self._live.report_error(e)  # our own failure: peers raise PeerFailedError naming us
            self._fail(err)
        else:
            if self._live is not None:
                self._live.beat("closed")
                self._live.stop()

    def _loop(self) -> None:
        idle = 0
        while True:
            with self._lock:
                self._work.pending.extend(self._inbox)
                self._inbox.clear()
                closed, pause = self._closed, self._pause_wanted
            live = self._work.live
            row = [0] * NCOLS
            row[LIVE], row[PENDING], row[OPEN] = live, len(self._work.pending), int(not closed)
            row[PAUSE] = int(pause)
            row[FINGERPRINT] = self._fp.value if self.config.debug_collectives else 0
            self.phase = "tick"
            t0 = time.perf_counter()
            state = self._cp.agree(row, abort=lambda: self._failed)
            self._stats.control_s += time.perf_counter() - t0
            self._stats.ticks += 1
            self.tick += 1
            self._last_state = state
            if self.config.debug_collectives:
                check_fingerprints(state)
            decision = decide(state)
            if decision is Decision.FORWARD:
                idle = 0
                self._stats.forward_ticks += 1
                if self.gather_policy == "once" and not self._gathered:
                    self.phase = "gather"
                    self.backend.gather_all()  # collective: every rank, this same tick
                    self._gathered = True
                    if self.config.debug_collectives:
                        self._fp.fold("gather_all")
                self._forward_tick(state)
                self._last_forward_t = time.monotonic()
            elif decision is Decision.IDLE:
                self._release_if_gathered()  # nobody has work: give the memory back
                self._stats.idle_ticks += 1
                self.phase = "idle"
                self._wake.wait(min(self.config.idle_sleep_max, 0.0005 * (2**idle)))
                self._wake.clear()
                idle = min(idle + 1, 16)
            elif decision is Decision.PAUSE:
                self._release_if_gathered()  # a training step inside would make the copies stale
                self._pause_here()
                idle = 0
            else:
                assert decision is Decision.EXIT
                self._release_if_gathered()  # hand the model back sharded, as it came
                self.backend.enter_pause()  # with the user's own setup (their groups outlive ours)
                self.phase = "closed"
                return

    def _release_if_gathered(self) -> None:
        """Back to sharded weights. Every rank calls it on the same (agreed) tick."""
        if self._gathered:
            self.backend.release_all()
            self._gathered = False
            if self.config.debug_collectives:
                self._fp.fold("release_all")

    def _forward_tick(self, state: TickState) -> None:
        """Exactly one forward on this rank: prefill, decode, or shadow (protocol invariant).

        When forwards issue no parameter collectives (weights gathered, or the local
        backend), a rank with work runs a burst of real forwards instead and nobody
        shadows: the tick then only decides admission, pause, release and exit.
        """
        t0 = time.perf_counter()
        lockstep = self.backend.lockstep
        steps = 1 if lockstep else self.config.burst_steps
        did_work = False
        for _ in range(steps):
            if not self._work.step(state.admit):
                break
            self.phase = self._work.phase
            did_work = True
        if not did_work and lockstep:
            self.phase = "shadow"
            self.backend.shadow_forward()
            self._stats.shadow_forwards += 1
        if self.config.debug_collectives:
            signature = self.backend.collective_signature()  # always drained
            self._fp.fold("forward", signature if lockstep else ())
        self._stats.forward_s += time.perf_counter() - t0

    def _finished(self, seq: Any) -> None:
        """A request finished (driver thread): resolve its future."""
        req: Request = seq.tag
        with self._lock:
            self._open_reqs.discard(req)
        resolve_future(req.future, result=completion_of(seq, self.tokenizer, self.rank))

    def _pause_here(self) -> None:
        """Every rank agreed to pause: no traffic until this rank's ``paused()`` block exits."""
        self.phase = "paused"
        self._pause_epoch += 1
        self.backend.enter_pause()  # the model as the user set it up, for training
        self._paused.set()
        while not self._resume.wait(0.05):
            pass
        self._paused.clear()
        self.backend.exit_pause()  # back to the generation settings before the next tick
        if self._store is not None:
            # Peers may stay inside their block for long (a training step): wait on the store,
            # not in the next tick's all-reduce, whose group has a timeout.
            key = f"shardgen/engine{self.engine_id}/resume{self._pause_epoch}"
            self._store.add(key, 1)
            while int(self._store.add(key, 0)) < self.world:
                time.sleep(0.005)

    def _resolve_gather_policy(self) -> str:
        """``per-layer`` or ``once``; ``auto`` picks ``once`` only if it fits on EVERY rank.

        Collective on the control group (one all-reduce) when the policy is ``auto``.
        """
        policy = self.config.gather
        if not self.backend.lockstep:
            return "per-layer"  # nothing to gather
        if policy != "auto":
            return policy
        need = self.backend.full_param_bytes() + kv_cache_bytes(self._hf_config, self.config.max_batch_size)
        fits = need <= memory_budget(self.config.memory_budget_gb, self.device)
        if self.world > 1:
            flag = torch.tensor([int(fits)], dtype=torch.int64)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._control)
            fits = bool(flag.item())
        log.info(
            "gather='auto': %s (%.1f MB of weights + KV cache)", "once" if fits else "per-layer", need / 1e6
        )
        return "once" if fits else "per-layer"

    def _attribute(self, err: BaseException) -> BaseException:
        """Blame the right rank: a broken collective is a symptom; wait for liveness to name the cause."""
        if self._failed is not None:
            return self._failed
        if self._live is None or isinstance(err, (PeerFailedError, PeerStalledError)):
            return err
        if not is_comm_error(err):
            return err
        self.phase = "comm-error"
        deadline = time.monotonic() + self.config.stall_timeout + 2 * self._live.interval
        while self._failed is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return self._failed if self._failed is not None else err

    def _on_peer_failure(self, err: BaseException) -> None:
        """Called by the liveness thread: a peer stalled or raised."""
        log.error("rank %d: %s", self.rank, err)
        self._fail(err)

    def _fail(self, err: BaseException) -> None:
        """Fail every open request with ``err`` (any thread). The first failure wins."""
        with self._lock:
            if self._failed is None:
                self._failed = err
                if threading.current_thread() is self._thread:
                    log.error("rank %d: engine driver failed: %s: %s", self.rank, type(err).__name__, err)
            err = self._failed
            reqs = list(self._open_reqs)
            self._open_reqs.clear()
        self.phase = "failed"
        for r in reqs:
            resolve_future(r.future, error=err)
        self._paused.set()  # unblock a waiting paused()
        if self._live is not None and threading.current_thread() is self._thread:
            self._live.stop()

    def _teardown(self) -> None:
        if self._live is not None:
            self._live.stop()
        _ENGINES.discard(self)
        if not _ENGINES:
            _restore_switch_interval()
        self.backend.close()
        for g in {id(g): g for g in (self._params, self._control) if g is not None}.values():
            with contextlib.suppress(Exception):
                dist.destroy_process_group(g)
        self._control = self._params = None


_ENGINES: weakref.WeakSet[Engine] = weakref.WeakSet()


@atexit.register
def _exit_guard() -> None:
    """At interpreter exit, a driver stuck in a collective with a dead peer would hold the exit
    (process-group teardown waits for it): leave at once, non-zero, instead."""
    for eng in list(_ENGINES):
        if eng._failed is not None and eng._thread.is_alive():
            log.error("rank %d: exiting with a driver stuck after: %s", eng.rank, eng._failed)
            for h in log.handlers:
                with contextlib.suppress(Exception):
                    h.flush()
            os._exit(1)


_SAVED_SWITCH: list[float] = []


def _lower_switch_interval(target: float | None) -> None:
    """A user thread spinning in pure Python holds the GIL for a whole switch interval each
    time the driver wants it (after every op): benchmarks/spin.py measures it."""
    if target is None:
        return
    current = sys.getswitchinterval()
    if not _SAVED_SWITCH:
        _SAVED_SWITCH.append(current)
    if target < current:
        sys.setswitchinterval(target)


def _restore_switch_interval() -> None:
    if _SAVED_SWITCH:
        sys.setswitchinterval(_SAVED_SWITCH.pop())


def _model_device(model: Any) -> torch.device:
    """The model's device if it has real parameters there, else cuda:LOCAL_RANK / cpu."""
    for p in model.parameters():
        if p.device.type not in ("meta", "cpu"):
            return p.device
        break
    return comm.default_device()
