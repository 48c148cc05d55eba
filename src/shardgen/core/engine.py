"""The Engine: the user-facing side of a rank; its driver thread (``driver.py``) runs the protocol.

    torchrun --nproc-per-node 2 examples/basic.py

User threads call ``generate()`` / ``generate_ids()`` / ``submit()`` (NOT collective:
any rank, any number of times, zero included); requests go to a queue; the
driver thread moves them into batches and, once per tick, agrees with the other
drivers (``protocol.py``) and runs exactly one forward or none. ``Engine(...)``,
``paused()`` and ``close()`` are collective.

Construction is collective on the engine's group: exactly the ranks of the group construct
it, with the same settings and the same model architecture; ranks outside the group never
call it and never wait for it. Over the whole world, every rank constructs every engine, in
the same order (``new_group`` on the default group). Over a subgroup, its members construct
their engines over those ranks in the same order as each other (the private groups come from
``new_group(ranks, use_local_synchronization=True)``, which only members call); they must
have created the same number of process groups before (torch names a subgroup by that count:
checked, ``ValueError``), and engines over overlapping groups must be constructed in the same
order on every rank. In order, it: waits for the group's ranks on the store (``init_timeout``,
naming absent ranks); creates two private groups over those ranks; all-gathers the settings
on the control group; shards the model on the parameter group (``build.build_backend``); and,
for ``gather="auto"``, all-reduces whether the full model fits.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist

from shardgen.backends import Backend
from shardgen.backends.base import describe_model
from shardgen.backends.towers import feature_encoder, undeclared_inputs_problem
from shardgen.config import EngineConfig, SamplingParams, context_length
from shardgen.core import comm, groups, process
from shardgen.core.build import build_backend, engine_config
from shardgen.core.driver import Driver, DriverSetup
from shardgen.core.shared import EngineStats, Failure, Shared
from shardgen.core.timeline import Span
from shardgen.errors import EngineClosedError
from shardgen.faults import leaving
from shardgen.generation import partial as partial_api
from shardgen.generation import per_call
from shardgen.generation import rollout as rollout_api
from shardgen.generation import score as score_api
from shardgen.generation.encdec import decoder_start
from shardgen.generation.requests import (
    Completion,
    build_requests,
    encode_prompt,
    id_batch,
    padded_output,
    unpadded_rows,
)
from shardgen.timeouts import derive

__all__ = ["Engine", "EngineStats"]


class Engine:
    """Deadlock-free generation on a model sharded across the ranks of a group.

    ``Engine(model, tokenizer=tok, backend="fsdp2", group=None)`` spans ``group``: the world
    by default, or the shard group derived from a model sharded over a subgroup (HSDP, a
    DeepSpeed data-parallel subgroup). Constructing it is collective on the group, in the
    order written in the module docstring. ``rank`` is the global rank (messages name global
    ranks), ``ranks`` the group's global ranks, ``world`` its size.

    Its own fields are the user side's (set at construction, then read-only); what user
    threads share with the driver lives in ``self._shared``, the driver's own in ``self._driver``.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        *,
        config: EngineConfig | None = None,
        device: torch.device | str | None = None,
        group: Any = None,
        **overrides: Any,
    ) -> None:
        cfg = engine_config(model, config, overrides)  # ValueError before any collective
        self.config, self.tokenizer = cfg, tokenizer
        self.timeouts = derive(cfg.stall_timeout, cfg.init_timeout)
        self._shared = Shared()
        self._held = partial_api.Held()  # partial rollouts' groups not yet returned
        self.rank, self.world = comm.rank_and_world(cfg.backend)
        self.ranks = groups.engine_ranks(group, model) if dist.is_initialized() else [self.rank]
        self.world = len(self.ranks)
        self.device = torch.device(device) if device is not None else comm.model_device(model)
        raw = getattr(model, "module", model)  # a DeepSpeedEngine wraps the HF model
        self._hf_config, self._gen_config = raw.config, getattr(raw, "generation_config", None)
        self._control = self._params = self._store = None
        prefix = "shardgen/engine0"
        if dist.is_initialized():  # arrival, the private groups, the settings check: collective
            prefix, self._store, self._control, self._params = comm.engine_groups(
                {**cfg.agreed(), **describe_model(raw)}, self.rank, self.ranks, self.timeouts
            )
        self._prefix = prefix  # this engine's keys in the store
        self.backend: Backend = build_backend(cfg, model, param_group=self._params, device=self.device)
        self.model = self.backend.hf_model
        # The gather policy is resolved in there: all-reduces on the control group (every rank, here).
        self._driver = Driver(
            DriverSetup(
                config=cfg, backend=self.backend, shared=self._shared, rank=self.rank, ranks=self.ranks,
                device=self.device, hf_config=self._hf_config, tokenizer=tokenizer, timeouts=self.timeouts,
                on_failure=Failure(self._shared, self.rank), control=self._control, store=self._store,
                key_prefix=prefix,
            )
        )  # fmt: skip
        self.gather_policy = self._driver.gather_policy
        self.config = self._driver.config  # max_batch_size sized when unset
        process.opened(self._driver, cfg.gil_switch_interval)
        self._driver.start()

    #: The checkpoint's processor when ``from_pretrained`` found one (a VLM's: its image processor
    #: and tokenizer), for building a request's ids and ``inputs=``; else None.
    processor: Any = None

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        *,
        dtype: torch.dtype | str | None = None,
        tokenizer: Any = None,
        processor: Any = None,
        **kwargs: Any,
    ) -> Engine:
        """Load an HF model (and its tokenizer, and its processor where it has one) from ``path``
        and build the engine. Collective.

        The weights go straight into each rank's shard (``shardgen.loading``): no rank holds the
        full model. ``dtype``: ``"auto"``/None (the checkpoint's), ``"bfloat16"``, ...
        ``processor``: the one to keep as ``engine.processor`` (default: ``AutoProcessor`` of
        ``path`` when it has processor files); the tokenizer comes from it when ``path`` has none.
        """
        from shardgen.loading.pretrained import pretrained, processor_of

        model, tokenizer = pretrained(path, dtype=dtype, tokenizer=tokenizer)
        processor = processor_of(path) if processor is None else processor
        if tokenizer is None and processor is not None:
            tokenizer = getattr(processor, "tokenizer", None)
        engine = cls(model, tokenizer, **kwargs)
        engine.processor = processor
        return engine

    # ------------------------------------------------------------------ user API (not collective)
    def submit(
        self,
        prompt: str | Sequence[int] | torch.Tensor,
        params: SamplingParams | None = None,
        *,
        inputs: dict[str, Any] | None = None,
        **overrides: Any,
    ) -> Future:
        """Queue one request; returns a ``Future[Completion]``. Not collective.

        ``params`` (a ``SamplingParams``; None: the model's generation defaults), then ``overrides``
        (``SamplingParams`` fields) on top. ``inputs``: the model's own forward inputs for the
        prompt beside its ids (a VLM's ``{"pixel_values": ..., "image_grid_thw": ...}``).
        """
        return self._submit_many([prompt], params, overrides, inputs=None if inputs is None else [inputs])[0]

    def submit_many(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        params: SamplingParams | None = None,
        *,
        inputs: Sequence[dict[str, Any] | None] | None = None,
        **overrides: Any,
    ) -> list[Future]:
        """Queue several requests at once, in order (they reach the driver together, so rows with
        one prompt join a batch together); one ``Future[Completion]`` each. Not collective.

        ``params`` and ``overrides`` as in ``submit()``; ``seed`` may be a list (one per prompt);
        ``inputs`` one dict (or None) per prompt, as in ``submit()``.
        """
        return self._submit_many(list(prompts), params, overrides, inputs=inputs)

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        params: SamplingParams | None = None,
        *,
        inputs: Sequence[dict[str, Any] | None] | None = None,
        tokens_per_call: int | None = None,
        **overrides: Any,
    ) -> list[Completion]:
        """Generate for each prompt (text, or token ids); blocks until all are done. Not collective.

        ``params`` and ``overrides`` as in ``submit()``; ``seed`` may be a list (one per prompt);
        ``inputs`` one dict (or None) per prompt, as in ``submit()``. ``tokens_per_call=B``: rows
        cut at B tokens come back ``"held"``, for ``resume()`` (``generation/per_call.py``).
        """
        if isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if tokens_per_call is not None:
            return per_call.generate(self, list(prompts), params, inputs, tokens_per_call, overrides)
        futures = self._submit_many(list(prompts), params, overrides, inputs=inputs)
        return [f.result() for f in futures]

    def generate_ids(
        self,
        input_ids: torch.Tensor | Sequence[Sequence[int]],
        attention_mask: torch.Tensor | Sequence[Sequence[int]] | None = None,
        params: SamplingParams | None = None,
        **overrides: Any,
    ) -> torch.Tensor:
        """HF-shaped generation: ``[B, T]`` left-padded ids -> ``[B, T + G]``, post-EOS padded.

        Returns exactly what HF ``generate()`` returns for the same batch: the input
        columns unchanged, then G = the longest generation; finished rows are padded. An
        encoder-decoder's input is the encoder's: its output, as HF's, is the decoder's
        ``[B, 1 + G]``, the decoder start token first.
        ``input_ids`` (and ``attention_mask``) may also be a list of ``B`` id lists of one length.
        Not collective.
        """
        input_ids, attention_mask = id_batch(input_ids, attention_mask)
        reqs = self._submit_many(
            unpadded_rows(input_ids, attention_mask), params, overrides, as_requests=True
        )
        done = [r.future.result() for r in reqs]
        if getattr(self._hf_config, "is_encoder_decoder", False):
            start = decoder_start(self.model)
            input_ids = torch.full((input_ids.shape[0], 1), start, dtype=torch.long, device=input_ids.device)
        return padded_output(input_ids, reqs, done)

    # n samples per prompt as a RolloutBatch, or streamed by prompt (shardgen.rollout); held rows of
    # generate(tokens_per_call=) continued (generation/per_call.py). Not collective.
    rollout, rollout_iter, resume = rollout_api.rollout, rollout_api.rollout_iter, per_call.resume

    def score(
        self,
        source: Any = None,
        responses: Any = None,
        *,
        prompts: Any = None,
        response_mask: torch.Tensor | None = None,
        temperature: float = 1.0,
        top_k: int = 0,
        logits: bool = False,
        entropy: bool = True,
        inputs: Sequence[dict[str, Any] | None] | None = None,
    ) -> score_api.ScoreBatch:
        """Teacher forcing: the model's logprobs of each given response token. Not collective: any
        rank, any number of calls, zero rows included, from any thread, beside ``generate()``s.

        ``score(prompts, responses)``: prompts as text (needs the tokenizer) or ids, responses as
        id lists (or a ``[R, G]`` tensor with ``response_mask``). ``score(batch)``: a
        ``RolloutBatch``'s own rows; ``score(batch, prompts=other)``: its responses under other
        prompts, one per row (a teacher's). Returns a ``ScoreBatch`` (``generation/score.py``):
        ``logprobs`` / ``mask`` / ``entropy`` ``[R, G]`` (log softmax(logits / temperature)),
        ``top_ids`` / ``top_logprobs`` ``[R, G, k]`` with ``top_k``, ``logits`` ``[R, G, V]`` (model
        dtype, CPU) with ``logits=True``. The rows run through the tick like prefills, in
        ``max_prefill_tokens`` chunks, rows of one prompt computing it once. ``inputs``: one dict (or
        None) per row, the model's own forward inputs for its prompt, as ``generate()``'s (a VLM's
        ``{"pixel_values": ..., "image_grid_thw": ...}``); a run holding image rows goes in one
        forward (no chunks, no shared prompts: the images go with their tokens).

        An encoder-decoder (T5, BART): the prompt is the encoder's input and the response the
        decoder's tokens, scored as HF's ``model(input_ids=prompt, decoder_input_ids=[start] +
        response[:-1])`` does (``start``: ``decoder_start_token_id``); a ``RolloutBatch``'s rows
        split at its ``prompt_width``. The model's own logits: no forced-token processor applies
        (BART's ``forced_bos_token_id`` / ``forced_eos_token_id`` shape what ``generate()`` draws,
        not what this scores). A run is one forward of every row (the encoder runs whole: no
        ``max_prefill_tokens`` chunks, no shared prompts); ``inputs=`` is not taken. Whisper: the
        prompt ids are the decoder's prefix (its start and task tokens) and each row's
        ``inputs={"input_features": x}`` the encoder's input, scored as HF's
        ``model(input_features=x, decoder_input_ids=(prompt + response)[:-1])``.
        """
        self._check_usable()
        text = self._hf_config.get_text_config(decoder=True)
        context = context_length(text)
        # the prompt ids: the encoder's input (T5, BART), or the decoder's prefix (Whisper, whose
        # decoder then holds prompt + response as a decoder-only model's does)
        prefix = feature_encoder(self._hf_config)
        encdec = bool(getattr(self._hf_config, "is_encoder_decoder", False)) and not prefix
        if prefix:
            context = getattr(self._hf_config, "max_target_positions", None)
        vocab = int(text.vocab_size)
        params = score_api.check_params(temperature, top_k, logits, entropy, vocab)
        p, r = score_api.rows_of(source, responses, prompts, response_mask, self.tokenizer)
        score_api.check_rows(p, r, vocab, context, encdec)
        each = score_api.check_inputs(p, inputs, self._hf_config)
        self._check_towers(each)
        dtype = getattr(self.model, "dtype", torch.float32)
        if all(len(x) == 0 for x in r):  # nothing to score (zero rows included): no engine work
            empty = [score_api.RowScore(torch.zeros(0, dtype=torch.float32)) for _ in r]
            return score_api.pack(empty, params, vocab, dtype)
        reqs = score_api.requests_of(p, r, params, each)
        if not self._shared.enqueue(reqs):  # type: ignore[arg-type]
            raise EngineClosedError(f"rank {self.rank}: engine is closed")
        return score_api.pack([q.future.result() for q in reqs], params, vocab, dtype)

    def timeline(self) -> list[Span]:
        """The driver's ``(t0, t1, kind)`` spans so far (``EngineConfig.timeline``; ``core/timeline.py``)."""
        return self._driver.spans()

    def stats(self) -> dict[str, Any]:
        """This rank's driver counters (a snapshot)."""
        return self._driver.stats_dict()

    @property
    def phase(self) -> str:
        """What this rank's driver is doing (a ``Phase``; reads as its word)."""
        return self._driver.phase_word()

    @property
    def version(self) -> int:
        """The weights' version on this rank: the pauses it went through (``paused()`` blocks),
        which every generated token records (``Completion.versions``, ``RolloutBatch.versions``)."""
        return self._shared.version

    @property
    def tick(self) -> int:
        return self._driver.tick

    # ------------------------------------------------------------------ collective API
    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Collective: every rank enters; inside, the engine issues no traffic at all.

        The pause begins once every rank asked for it and every live sequence
        finished (requests still queued wait); it ends on each rank when its block exits.
        Ranks that never enter are named in a ``RendezvousTimeoutError`` once this rank
        has waited ``stall_timeout`` with no forward anywhere. An exception that leaves the
        block fails the engine on every rank, naming this one (``faults/leaving.py``).
        """
        self._check_usable()
        sh = self._shared
        sh.want_pause(True)
        called = time.monotonic()
        try:
            while not sh.wait_pause_entered(0.05):
                self._raise_if_failed()
                self._driver.check_wait(
                    called, self.timeouts.paused, "pause", "paused()", "entered paused()", verdict=False
                )
            self._raise_if_failed()  # a failure also ends the wait: no pause then
            try:
                yield
            except BaseException as e:
                err = leaving.leave(self._driver, e, "inside paused()")
                if err is not e:
                    raise err from e
                raise
        finally:
            sh.want_pause(False)

    def close(self, timeout: float | None = None) -> None:
        """Collective join: stop taking requests, finish all work on every rank, stop the driver.

        Returns once every rank closed and all work is done. A rank that never closes
        is named in a ``RendezvousTimeoutError`` once this call has waited ``timeout``
        seconds (default: ``stall_timeout``) with no forward anywhere. Idempotent.
        """
        sh, driver = self._shared, self._driver
        sh.close()
        limit = self.timeouts.close if timeout is None else timeout
        called = time.monotonic()
        while sh.failed is None and not driver.join(0.05):
            driver.check_wait(called, limit, "open", "close()", "called close()", absent_if=1)
        self._raise_if_failed()
        self._teardown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, tp: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is None:
            self.close()
            return
        # The block raised: this rank will not do what its peers wait for, so they learn it now
        # (faults/leaving.py); a broken collective of the user's is a peer's doing: name it.
        err = leaving.leave(self._driver, exc, "in its `with engine:` block")
        with contextlib.suppress(Exception):
            self.close()
        if err is not exc:
            raise err from exc

    # ------------------------------------------------------------------ internals (user side)
    def _check_usable(self) -> None:
        if self._shared.closed:
            raise EngineClosedError(f"rank {self.rank}: engine is closed")
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        failed = self._shared.failed
        if failed is not None:
            raise failed

    def _submit_many(
        self,
        prompts: list[Any],
        params: SamplingParams | None,
        overrides: dict[str, Any],
        as_requests: bool = False,
        inputs: Sequence[dict[str, Any] | None] | None = None,
        holding: Any = None,
    ) -> list[Any]:
        """``holding``: a partial rollout's rows (``sequence.Holding``), which may be parked."""
        self._check_usable()
        self._check_towers(inputs)
        # A text prompt encoded once per call (a rollout's n rows of a prompt repeat it).
        texts: dict[str, list[int]] = {}
        ids = []
        for p in prompts:
            if not isinstance(p, str):
                ids.append(encode_prompt(p, self.tokenizer))
                continue
            if p not in texts:
                texts[p] = encode_prompt(p, self.tokenizer)
            ids.append(texts[p])
        reqs = build_requests(
            ids,
            params,
            overrides,
            model_config=self._hf_config,
            generation_config=self._gen_config,
            tokenizer=self.tokenizer,
            inputs=None if inputs is None else list(inputs),
        )
        for r in reqs:
            r.seq.holding = holding
        if not self._shared.enqueue(reqs):
            raise EngineClosedError(f"rank {self.rank}: engine is closed")
        return reqs if as_requests else [r.future for r in reqs]

    def _check_towers(self, inputs: Sequence[Any] | None) -> None:
        """``ValueError`` for ``inputs=`` that a sharded model of a kind with no named towers
        would run on this rank only (``towers.undeclared_inputs_problem``). Local, before the
        requests reach the driver."""
        if not inputs or self.config.backend == "local" or self.world == 1:
            return
        for i, x in enumerate(inputs):
            why = undeclared_inputs_problem(self._hf_config, x)
            if why:
                raise ValueError(f"rank {self.rank}, request {i}: {why}")

    def _teardown(self) -> None:
        self._driver.teardown()
        self.backend.uninstrument()
        self.backend.close()
        whole = not dist.is_initialized() or len(self.ranks) == dist.get_world_size()
        names = comm.group_names(self._params, self._control) if whole else []  # a subgroup's are pooled
        comm.destroy_groups(self._params, self._control, ranks=self.ranks)
        self._control = self._params = None
        if self._store is not None:  # once (close() may be called again): the keys go with the last rank
            store, self._store = self._store, None
            args = (store, self._prefix, self.ranks, self._shared.pauses_entered, names)
            comm.bounded(comm.forget_engine, args, self.timeouts.store_call, f"rank {self.rank}: close")
