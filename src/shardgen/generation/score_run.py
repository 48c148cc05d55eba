"""The forwards of a score run on one rank: prompt + response rows prefilled, the LM head applied
at the response positions only, and each chunk's logits reduced at once (``score.reduce``).

No ``torch.distributed`` here: ``ScoreRun.step(forward)`` calls the ``forward`` it is given (the
backend's, bound by the scheduler to the tick's agreed plan) exactly once, as ``Batch`` does.

Layout: the prompt left-padded to P, the response right-padded to G, W = P + G columns (the
row HF's ``model(input_ids)`` would see, the last response token included). The logits of
column ``P - 1 + j`` predict response token ``j``: the useful columns are ``[P - 1, P + G - 1)``,
the same in every row. A chunk of columns ``[c0, c1)`` keeps the head on its last ``keep``
columns (``logits_to_keep``): those from ``max(c0, P - 1)`` on, or one column (discarded) when it
holds none, as a generation prefill's chunk does. So at most one chunk's logits exist.

Shared prompts (rows with one prompt, the n samples of a rollout): the prompt columns run on
the distinct prompts only, their KV cache is then forked into every row (and the logits of
column P - 1 with it), and the response columns run on every row.

Rows with inputs of their own (a VLM's images: ``ScoreRequest.inputs``): the scheduler plans their
run as one forward of every row (no chunks, no shared prompts), which takes the rows' images
concatenated in row order, the token types marking their image tokens, and for an M-RoPE model
(Qwen2-VL) the vision position rows of every column from the model's own ``get_rope_index``, as
a generation prefill's (``batch.py``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from transformers import DynamicCache

from shardgen.generation.plan import ScorePlan
from shardgen.generation.requests import joined_inputs
from shardgen.generation.score import RowScore, ScoreRequest, reduce

Forward = Callable[..., Any]


class ScoreRun:
    """The rows of one score run and their forwards, one ``step`` each; then ``results()``."""

    def __init__(
        self, hf_model: Any, reqs: list[ScoreRequest], device: torch.device, plan: ScorePlan
    ) -> None:
        assert reqs and plan.batch_rows == len(reqs), f"a plan of {plan.batch_rows} rows for {len(reqs)}"
        self.hf_model, self.reqs, self.device, self.plan = hf_model, reqs, device, plan
        self.params = reqs[0].params
        assert all(r.params == self.params for r in reqs), "one run, one setting"
        params = inspect.signature(hf_model.forward).parameters
        self._takes_positions = "position_ids" in params
        self._takes_logits_to_keep = "logits_to_keep" in params
        self._takes_mm_types = "mm_token_type_ids" in params  # Qwen2-VL marks its image tokens
        self._mrope = callable(getattr(getattr(hf_model, "model", None), "get_rope_index", None))
        prep = inspect.signature(hf_model.prepare_inputs_for_generation).parameters
        self._cache_kw = "cache" if "cache" in prep else "past_key_values"
        p_w, g_w = plan.prompt_width, plan.response_width
        ids = torch.zeros((len(reqs), p_w + g_w), dtype=torch.long)
        mask = torch.zeros((len(reqs), p_w + g_w), dtype=torch.long)
        for i, r in enumerate(reqs):
            p, g = len(r.prompt_ids), len(r.response_ids)
            ids[i, p_w - p : p_w] = torch.tensor(r.prompt_ids, dtype=torch.long)
            ids[i, p_w : p_w + g] = torch.tensor(r.response_ids, dtype=torch.long)
            mask[i, p_w - p :] = 1  # right padding stays visible: causal, it never reaches a kept column
        self.targets = ids[:, p_w:]  # [B, G]: the token each useful column predicts
        self.ids = ids.to(device)
        mask = mask.to(device)
        self.pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
        self.mask: torch.Tensor | None = (
            None if bool((mask == 1).all()) else mask
        )  # as HF: None when all ones
        self._own, self._vision = self._own_inputs()
        self.cache = DynamicCache(config=hf_model.config.get_text_config(decoder=True))
        self._pieces: list[dict[str, torch.Tensor]] = []
        self._chunk = 0

    def _own_inputs(self) -> tuple[dict[str, Any], torch.Tensor | None]:
        """The first forward's inputs beside the ids: the rows' own (their images, concatenated in
        row order, and the token types); for an M-RoPE model the 3 vision position rows of every
        column, ``[3, B, W]`` (each row's text positions where it has no image)."""
        with_inputs = [r.inputs for r in self.reqs if r.inputs is not None]
        if with_inputs:
            assert self.plan.distinct is None and len(self.plan.chunks) == 1, "image rows: one forward"
        own = joined_inputs(with_inputs, self.ids, self.hf_model.config, self._takes_mm_types, self.device)
        if not self._mrope:
            return own, None
        if "image_grid_thw" not in own:
            return own, self.pos[None].expand(3, -1, -1)
        vision, _ = self.hf_model.model.get_rope_index(
            self.ids, mm_token_type_ids=own["mm_token_type_ids"],
            image_grid_thw=own["image_grid_thw"], attention_mask=self.mask,
        )  # fmt: skip
        return own, vision.to(self.device)

    @property
    def done(self) -> bool:
        return self._chunk == len(self.plan.chunks)

    def next_shape(self) -> tuple[int, int]:
        assert not self.done
        return self.plan.shape(self._chunk)

    def step(self, forward: Forward) -> int:
        """ONE forward: the next chunk; its useful logits reduced before it returns. The tokens computed."""
        plan, ch = self.plan, self.plan.chunks[self._chunk]
        self._chunk += 1
        ids, pos, mask, vision = self.ids, self.pos, self.mask, self._vision
        if not ch.every:
            assert plan.distinct is not None
            idx = torch.tensor(plan.distinct, dtype=torch.long, device=self.device)
            ids, pos = ids.index_select(0, idx), pos.index_select(0, idx)
            mask = None if mask is None else mask.index_select(0, idx)
            vision = None if vision is None else vision.index_select(1, idx)
        kw: dict[str, Any] = {self._cache_kw: self.cache, "use_cache": True}
        kw["attention_mask"] = None if mask is None else mask[:, : ch.c1]
        if self._takes_positions:
            p = pos[:, : ch.c1]
            kw["position_ids"] = p if vision is None else torch.cat([p[None], vision[..., : ch.c1]], dim=0)
        if ch.c0 == 0:  # the rows' own inputs (their images) go with their tokens
            kw.update(self._own)
        inputs = self.hf_model.prepare_inputs_for_generation(
            ids[:, : ch.c1],
            next_sequence_length=ch.c1 - ch.c0 if ch.c0 else None,
            is_first_iteration=ch.c0 == 0,
            **kw,
        )
        if self._takes_logits_to_keep:
            inputs["logits_to_keep"] = ch.keep
        out = forward(**inputs, return_dict=True)
        returned = getattr(out, self._cache_kw, None)
        if returned is not None:
            self.cache = returned
        logits = out.logits  # [rows, keep, V] (every column where the model keeps no fewer)
        del out
        if logits.shape[1] > ch.keep:
            logits = logits[:, -ch.keep :]
        last_prompt = not ch.every and (self._chunk == len(plan.chunks) or plan.chunks[self._chunk].every)
        if last_prompt:
            assert plan.fork is not None
            fork = torch.tensor(plan.fork, dtype=torch.long, device=self.device)
            self.cache.reorder_cache(fork)  # every row takes a copy of its prompt's cache
            logits = logits.index_select(0, fork.to(logits.device))
        first_kept = ch.c1 - ch.keep
        lo, hi = (
            max(first_kept, plan.prompt_width - 1),
            min(ch.c1, plan.prompt_width + plan.response_width - 1),
        )
        if hi > lo and (ch.every or last_prompt):
            part = logits[:, lo - first_kept : hi - first_kept]  # [B, n, V]
            j0 = lo - (plan.prompt_width - 1)
            toks = self.targets[:, j0 : j0 + (hi - lo)]
            red = reduce(part.reshape(-1, part.shape[-1]), toks.reshape(-1), self.params)
            self._pieces.append({k: v.reshape(*toks.shape, *v.shape[1:]) for k, v in red.items()})
        del logits
        return ids.shape[0] * (ch.c1 - ch.c0) if mask is None else int(mask[:, ch.c0 : ch.c1].sum())

    def results(self) -> list[tuple[ScoreRequest, RowScore]]:
        """Each row's scores, its own length (after the last ``step``)."""
        assert self.done
        cat: dict[str, torch.Tensor] = {}
        for key in self._pieces[0] if self._pieces else ():
            cat[key] = torch.cat([p[key] for p in self._pieces], dim=1)
        out = []
        for i, r in enumerate(self.reqs):
            g = len(r.response_ids)
            row = {k: v[i, :g] for k, v in cat.items()}
            lps = row.get("logprobs", torch.zeros(g, dtype=torch.float32))
            out.append(
                (
                    r,
                    RowScore(
                        lps,
                        row.get("entropy"),
                        row.get("top_ids"),
                        row.get("top_logprobs"),
                        row.get("logits"),
                    ),
                )
            )
        return out
