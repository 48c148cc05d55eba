"""One batch on one rank: its rows built from their prompts, the prefill, the decode step, each
step's tokens chosen, EOS/pad bookkeeping (refill merges and dropped rows: ``rows.py``).

No ``torch.distributed`` here: each ``prefill_step(forward)`` or ``step(forward)`` calls the
``forward`` it is given (the backend's, bound by the scheduler to the tick's agreed plan: it may
gather shards or exchange rows) exactly once.

The inputs mirror Hugging Face ``generate()`` step for step so greedy output is
token-identical where the shapes are HF's: left padding, ``position_ids`` from the mask's
cumsum, the mask dropped when it is all ones, the model's own ``prepare_inputs_for_generation``
and a ``DynamicCache``, ``logits_to_keep=1``, float32 logits of the last position, the first EOS
kept and ``pad_token_id`` after it.

Shared prefill: rows with the same prompt (the ``n`` samples of a rollout) compute it once. The
prefill forward runs on the distinct prompts only; its KV cache is then forked into every row
(``Cache.reorder_cache``: an ``index_select``, so each row owns a copy and a sample's decode never
touches its siblings'), and the LM head runs on every row, as without sharing. Chunked prefill:
under a token budget the prompt columns go through the model in chunks, one forward each, the
cache growing between them (as HF ``generate(prefill_chunk_size=...)`` does). Which rows and
chunks: the ``PrefillPlan`` (``plan.py``) the scheduler computed.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from shardgen.generation.cache import ReservedLayer
from shardgen.generation.plan import PrefillPlan
from shardgen.generation.requests import joined_inputs
from shardgen.generation.rows import BatchRows
from shardgen.generation.sampling import chosen_logprobs, select_tokens
from shardgen.generation.sequence import SeqState
from shardgen.generation.verify import Verified, draft_columns, settle

#: One forward of the model (the backend's, bound to this tick's plan): HF's keyword inputs in,
#: HF's output out.
Forward = Callable[..., Any]


def _mrope_model(hf_model: Any) -> bool:
    """The model takes M-RoPE positions (Qwen2-VL: a text row and 3 vision rows per column)."""
    return callable(getattr(getattr(hf_model, "model", None), "get_rope_index", None))


def verifiable(hf_model: Any) -> bool:
    """``hf_model``'s text rows can verify drafts from their prefill on (what ``can_verify`` asks
    of a running batch): plain cache layers and plain positions. Pure."""
    cache = DynamicCache(config=hf_model.config.get_text_config(decoder=True))
    layers = getattr(cache, "layers", None) or []
    plain = bool(layers) and all(type(layer) is DynamicLayer for layer in layers)
    return plain and not _mrope_model(hf_model)


class Batch(BatchRows):
    """Sequences decoding together: a left-padded ``[B, T]`` batch with one KV cache.

    Finished rows stay in the batch and are fed ``pad_id`` (as HF does), so a
    row's numerics never depend on when its neighbours finish. Their bookkeeping between
    forwards (dropped, refilled, the prefix cache's columns): ``BatchRows`` (``rows.py``).
    """

    _chunk_inputs: tuple[dict[str, Any], ...] = ()  # per prefill forward, its images (none: {})
    folded: Verified | None = None  # what a prefill that fed drafts did (``prefill_step``)

    def __init__(self, hf_model: Any, seqs: list[SeqState], device: torch.device, plan: PrefillPlan) -> None:
        """``plan``: the prefill's rows and chunks (``PrefillPlan.of`` the rows' prompts), as the
        scheduler computed it for the tick."""
        assert seqs, "empty batch"
        assert plan.batch_rows == len(seqs), f"a plan of {plan.batch_rows} rows for {len(seqs)}"
        self.hf_model = hf_model
        self.seqs = seqs
        self.device = device
        self.steps = 0
        params = inspect.signature(hf_model.forward).parameters
        self._takes_positions = "position_ids" in params
        self._takes_logits_to_keep = "logits_to_keep" in params
        self._takes_mm_types = "mm_token_type_ids" in params  # Qwen2-VL marks its image tokens
        # transformers 5.24 renamed the cache argument (past_key_values -> cache).
        prep = inspect.signature(hf_model.prepare_inputs_for_generation).parameters
        self._cache_kw = "cache" if "cache" in prep else "past_key_values"

        width = max(len(s.prompt_ids) for s in seqs)
        ids = torch.full((len(seqs), width), 0, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            n = len(s.prompt_ids)
            ids[i, width - n :] = torch.tensor(s.prompt_ids, dtype=torch.long)
            ids[i, : width - n] = s.pad_id
            mask[i, width - n :] = 1
        self.input_ids = ids.to(device)  # [B, T]: prompt, then one column per step
        self.prompt_width = width
        mask = mask.to(device)
        self.position_ids = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)  # [B, T]
        # HF drops an all-ones mask (no padding), which selects a different attention path.
        self.attention_mask: torch.Tensor | None = None if bool((mask == 1).all()) else mask
        self.cache = DynamicCache(config=hf_model.config.get_text_config(decoder=True))
        layers = getattr(self.cache, "layers", None) or []
        for i, layer in enumerate(layers):  # plain layers only: sliding windows keep their own
            if type(layer) is DynamicLayer and not layer.is_initialized:
                layers[i] = ReservedLayer()
        self._reserve()
        self._mrope = _mrope_model(hf_model)
        self.rope_deltas: torch.Tensor | None = None  # [B, 1]: M-RoPE's offset of each row's positions
        self._plan_prefill(plan)
        if plan.start:
            self._install_cached(plan)

    def _plan_prefill(self, plan: PrefillPlan) -> None:
        """The prefill's inputs: the rows ``plan`` computes (one per distinct prompt when sharing)."""
        self._prefill = plan
        self.fork: torch.Tensor | None = None  # row i takes the prefill of computed row fork[i]
        if plan.fork is not None:
            self.fork = torch.tensor(plan.fork, dtype=torch.long, device=self.device)
        idx = torch.tensor(plan.rows, dtype=torch.long, device=self.device)
        self._pre = (self.input_ids.index_select(0, idx), self.position_ids.index_select(0, idx))
        self._pre_mask = None if self.attention_mask is None else self.attention_mask.index_select(0, idx)
        self._chunks = plan.chunks
        self._chunk = 0
        self._chunk_inputs, self._pre_vision = self._own_inputs(plan)

    def _own_inputs(self, plan: PrefillPlan) -> tuple[tuple[dict[str, Any], ...], torch.Tensor | None]:
        """The prefill's own inputs beside the ids, per forward of ``plan``: the computed rows'
        inputs (``SeqState.inputs``: a VLM's images, concatenated in row order, with the token
        types marking their tokens) for the images whose tokens the forward computes (none of
        the columns the prefix cache gives), and for an M-RoPE model (Qwen2-VL) the 3 vision
        position rows of every column, ``[3, U, T]``, from every image of the rows (a cached
        prefix's and a later chunk's included: the positions after an image hang on its grid);
        each row's offset (``rope_deltas``) is kept for its decode steps, as HF ``generate()``
        keeps it."""
        cfg, ids = self.hf_model.config, self._pre[0]
        per_chunk = []
        for j in range(len(plan.chunks)):
            carried = [x for x in plan.inputs(self.seqs, j) if x is not None]
            per_chunk.append(joined_inputs(carried, ids, cfg, self._takes_mm_types, self.device))
        if not self._mrope:
            return tuple(per_chunk), None
        pos = self._pre[1]
        every = [s.inputs for s in (self.seqs[r] for r in plan.rows) if s.inputs is not None]
        grids = [{"image_grid_thw": x.get("image_grid_thw")} for x in every]  # the pixels not needed
        whole = joined_inputs(grids, ids, cfg, True, self.device)
        if "image_grid_thw" not in whole:
            vision = pos[None].expand(3, -1, -1)
            deltas = torch.zeros((len(self.seqs), 1), dtype=torch.long, device=self.device)
        else:
            vision, d = self.hf_model.model.get_rope_index(
                ids, mm_token_type_ids=whole["mm_token_type_ids"],
                image_grid_thw=whole["image_grid_thw"], attention_mask=self._pre_mask,
            )  # fmt: skip
            d = d.to(self.device)
            deltas = d if self.fork is None else d.index_select(0, self.fork)
            vision = vision.to(self.device)
        self.rope_deltas = deltas
        return tuple(per_chunk), vision

    def _positions(self, pos: torch.Tensor, vision: torch.Tensor | None = None) -> torch.Tensor:
        """``position_ids`` as the model takes them: ``pos`` ``[B, T]``, or for an M-RoPE model
        ``[4, B, T]``: the text positions, then the 3 vision rows (``vision``; by default each
        row's text positions plus its offset, which is what every text column after the images
        takes)."""
        if not self._mrope:
            return pos
        if vision is None:
            assert self.rope_deltas is not None
            vision = (pos + self.rope_deltas)[None].expand(3, -1, -1)
        return torch.cat([pos[None], vision], dim=0)

    def next_prefill_inputs(self) -> dict[str, Any]:
        """The own inputs (images) of the next ``prefill_step()``: the tick carries their towers."""
        assert self.prefilling
        return self._chunk_inputs[self._chunk] if self._chunk < len(self._chunk_inputs) else {}

    def next_prefill_shape(self) -> tuple[int, int]:
        """``PrefillPlan.shape`` of the next ``prefill_step()``."""
        assert self.prefilling
        return self._prefill.shape(self._chunk)

    def _model_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {self._cache_kw: self.cache, "use_cache": True}
        kw["attention_mask"] = self.attention_mask
        if self._takes_positions:
            kw["position_ids"] = self._positions(
                self.position_ids[:, -1:] if self._mrope else self.position_ids
            )
        if self._takes_logits_to_keep:
            kw["logits_to_keep"] = 1
        return kw

    def prefill(self, forward: Forward) -> None:
        """Run the whole prompt through the model and choose each row's first token."""
        while self.prefilling:
            self.prefill_step(forward)

    def prefill_step(self, forward: Forward) -> int:
        """ONE forward of the prefill: the prompt, or its next chunk under the token budget; the
        last one chooses each row's first token, or (the plan's ``drafts``) feeds each computed
        row's draft after its prompt and commits each row's tokens as a verify forward does
        (``verify.settle``; what it did: ``folded``). Returns the prompt tokens it computed."""
        assert self.prefilling, "prefill runs once"
        c0, c1 = self._chunks[self._chunk]
        self._chunk += 1
        ids, pos = self._pre
        mask = self._pre_mask
        last = self._chunk == len(self._chunks)
        tokens = (c1 - c0) * ids.shape[0] if mask is None else int(mask[:, c0:c1].sum())
        ids, pos = ids[:, :c1], pos[:, :c1]
        mask = None if mask is None else mask[:, :c1]  # past and current columns
        k = self._prefill.draft_width if last else 0
        columns = None
        if k:  # the drafts' columns after the prompt, each computed row's (holes: mask 0)
            drafts = self.prefill_drafts()
            columns = draft_columns(self, drafts)
            idx = torch.tensor(self._prefill.rows, dtype=torch.long, device=self.device)
            ids_d, fed, pos_d = (t.index_select(0, idx) for t in columns)
            if mask is not None or not bool((fed == 1).all()):  # HF drops an all-ones mask
                mask = torch.cat([torch.ones_like(ids) if mask is None else mask, fed], dim=-1)
            ids, pos = torch.cat([ids, ids_d], dim=-1), torch.cat([pos, pos_d], dim=-1)
        kw: dict[str, Any] = {self._cache_kw: self.cache, "use_cache": True}
        kw["attention_mask"] = mask
        if self._takes_positions:
            vision = None if self._pre_vision is None else self._pre_vision[..., :c1]
            kw["position_ids"] = self._positions(pos, vision)
        if self._takes_logits_to_keep:
            kw["logits_to_keep"] = k + 1
        own = self._chunk_inputs[self._chunk - 1]  # the images of its columns go with their tokens
        kw.update(own)
        inputs = self.hf_model.prepare_inputs_for_generation(
            ids, next_sequence_length=c1 - c0 + k if c0 else None,
            is_first_iteration=c0 == 0 or bool(own), **kw,
        )  # fmt: skip
        with self._head_on_every_row(last):
            outputs = forward(**inputs, return_dict=True)
        if not last:
            returned = getattr(outputs, self._cache_kw, None)
            if returned is not None:
                self.cache = returned
            return tokens
        if columns is None:
            self._consume(outputs, fork=self.fork)
        else:
            logits = self._forked(self.last_logits(outputs, k + 1), self.fork)
            self.folded = settle(self, logits, drafts, columns)
        self._pre = self._pre_mask = None  # type: ignore[assignment]
        self._chunk_inputs, self._pre_vision = (), None
        return tokens

    def prefill_drafts(self) -> tuple[tuple[int, ...], ...]:
        """Every row's draft at the prefill: its computed row's (``PrefillPlan.drafts``)."""
        plan = self._prefill
        if plan.fork is None:
            return plan.drafts
        return tuple(plan.drafts[u] for u in plan.fork)

    def last_logits(self, outputs: Any, width: int) -> torch.Tensor:
        """A forward's logits of its last ``width`` positions, float32 ``[rows, width, V]``; the
        cache it returned becomes the batch's (a verify forward's, a prefill's that fed drafts)."""
        logits = outputs.logits[:, -width:].to(dtype=torch.float32)
        returned = getattr(outputs, self._cache_kw, None)
        if returned is not None:
            self.cache = returned
        return logits

    def _forked(self, logits: torch.Tensor, fork: torch.Tensor | None) -> torch.Tensor:
        """Shared prefill (``fork``; None: none): every row takes a copy of its prompt's cache and
        logits (the logits are forked already where the head ran on every row)."""
        if fork is not None:
            if logits.shape[0] != fork.shape[0]:
                logits = logits.index_select(0, fork)
            self.cache.reorder_cache(fork)
        return logits

    @contextlib.contextmanager
    def _head_on_every_row(self, last: bool) -> Iterator[None]:
        """The last forward of a shared prefill: the LM head's input is forked to every row, so the
        head (one position per row: cheap) runs the same GEMM, on the same rows, as without
        sharing. Its logits computed on the distinct rows only could differ in the last bit (one
        row alone is a GEMV). Where the model computes them elsewhere (the gathered replica of
        ``gather='once'``), the logits are forked after the forward instead."""
        head = self.hf_model.get_output_embeddings() if last and self.fork is not None else None
        if head is None:
            yield
            return
        fork = self.fork

        def widen(_module: Any, args: tuple) -> tuple | None:
            if not args:
                return None
            x = args[0]  # [U, 1, H], a slice of the [U, T, H] hidden states
            # With the strides of the unshared input (a slice of [B, T, H]): GEMM kernels may pick
            # their path by them (the sharded heads' chunked GEMMs do). The buffer's other columns
            # are never written (on CPU their pages are never even committed).
            shape, strides = (fork.shape[0], *x.shape[1:]), x.stride()
            wide = torch.empty_strided(shape, strides, dtype=x.dtype, device=x.device)
            return (wide.copy_(x.index_select(0, fork)), *args[1:])

        handle = head.register_forward_pre_hook(widen)
        try:
            yield
        finally:
            handle.remove()

    def step(self, forward: Forward) -> None:
        """Feed the last tokens and choose the next ones. One forward."""
        assert 0 < self.steps and not self.done, "step needs a prefilled, unfinished batch"
        inputs = self.hf_model.prepare_inputs_for_generation(
            self.input_ids, next_sequence_length=1, **self._model_kwargs()
        )
        self._consume(forward(**inputs, return_dict=True))

    def _consume(self, outputs: Any, fork: torch.Tensor | None = None) -> None:
        # Same as HF: float32 copy of the last position's logits.
        logits = outputs.logits[:, -1].to(copy=True, dtype=torch.float32)  # [B, V]
        returned = getattr(outputs, self._cache_kw, None)
        if returned is not None:
            self.cache = returned
        del outputs
        logits = self._forked(logits, fork)
        tokens = select_tokens(
            logits, [s.params for s in self.seqs], [s.generator for s in self.seqs], self.input_ids
        )
        forced = [
            (i, t) for i, s in enumerate(self.seqs) if not s.finished and (t := s.forced_token()) is not None
        ]
        if forced:  # HF's forced BOS / EOS (BART's): the draw is made, the forced token taken
            tokens = tokens.clone()
            for i, t in forced:
                tokens[i] = t
        want_lp = any(s.params.logprobs for s in self.seqs)
        lps = chosen_logprobs(logits, tokens, [s.params for s in self.seqs]).tolist() if want_lp else None
        column = tokens.tolist()
        for i, s in enumerate(self.seqs):
            if s.finished:
                column[i] = s.pad_id  # finished rows are padded, exactly like HF
                continue
            s.append(column[i], lps[i] if (lps is not None and s.params.logprobs) else None)
        new = torch.tensor(column, dtype=torch.long, device=self.device)[:, None]  # [B, 1]
        self.input_ids = torch.cat([self.input_ids, new], dim=-1)
        self.position_ids = torch.cat([self.position_ids, self.position_ids[:, -1:] + 1], dim=-1)
        if self.attention_mask is not None:
            ones = self.attention_mask.new_ones((self.attention_mask.shape[0], 1))
            self.attention_mask = torch.cat([self.attention_mask, ones], dim=-1)
        self.steps += 1
