"""One batch of an encoder-decoder (T5, BART): the decoder's batch, each row's encoder output
kept beside it.

No ``torch.distributed`` here. The prompt is the encoder's input. A request's first forward (its
prefill) runs the encoder on its prompt and the decoder on ``decoder_start_token_id``, as HF
``generate()`` does; the encoder runs inside the model's one forward, so the tick's agreement on
towers covers its gathers (``backends/towers.py``: the encoder is a tower run by ``input_ids``).
The encoder's last hidden state and its mask then stay with the row, and each decode step feeds
the decoder's last token against them, with the ``EncoderDecoderCache`` (the cross-attention
keys and values are written once, at the prefill; the model reuses them after).

Rows of different prompt lengths: the encoder inputs are right-padded (masked; BART's learned
encoder positions count from the first column). Refill: a new row's encoder runs in a later
tick, in its own prefill; its rows then merge into the running batch: the decoder's columns
(ids, mask, self-attention cache) left-padded as a decoder-only batch's, the cross-attention
cache, encoder states and encoder mask right-padded to the longest prompt. A decoder with
learned positions (BART) then takes each row's own (``decoder_position_ids``, which the backend
feeds its positional embedding); T5's relative bias sees the same distances either way.

What enc-dec rows do without: the prefix cache, chunked prefill (the encoder runs whole). The
``n`` samples of a prompt share one encoder run and one first decoder step (shared prefill).
Outputs: the decoder's new tokens, without the start token (HF's ``generate()`` returns it
first).

Scoring (``EncDecScoreRun``): teacher forcing as HF's ``model(input_ids=prompt,
decoder_input_ids=[start] + response[:-1])``, the logits of decoder column ``j`` scoring response
token ``j``; Whisper's (score only): ``model(input_features=x, decoder_input_ids=(prompt +
response)[:-1])``, the prompt the decoder's prefix. A run is one forward of every row (the
encoder runs whole, inside it).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, EncoderDecoderCache

from shardgen.generation.batch import Batch, Forward
from shardgen.generation.cache import ReservedLayer
from shardgen.generation.plan import PrefillPlan, ScorePlan
from shardgen.generation.rows import combine_rows
from shardgen.generation.score import ScoreRequest, reduce
from shardgen.generation.score_run import ScoreRun
from shardgen.generation.sequence import SeqState


def is_encoder_decoder(hf_model: Any) -> bool:
    """The model decodes against an encoder's output (T5, BART)."""
    return bool(getattr(getattr(hf_model, "config", None), "is_encoder_decoder", False))


def decoder_start(hf_model: Any) -> int | None:
    """The decoder's first input, as HF ``generate()`` takes it: the generation config's
    ``decoder_start_token_id``, else the model config's, else BOS."""
    for cfg in (getattr(hf_model, "generation_config", None), hf_model.config):
        for name in ("decoder_start_token_id", "bos_token_id"):
            v = getattr(cfg, name, None)
            if isinstance(v, int):
                return v
    return None


class EncDecBatch(Batch):
    """Sequences of an encoder-decoder decoding together: the decoder's left-padded ``[B, T]``
    ids (the start token, then the tokens so far), the encoder's ``[B, S, d]`` output and
    ``[B, S]`` mask (right-padded), one ``EncoderDecoderCache``."""

    def __init__(self, hf_model: Any, seqs: list[SeqState], device: torch.device, plan: PrefillPlan) -> None:
        assert seqs, "empty batch"
        assert plan.batch_rows == len(seqs), f"a plan of {plan.batch_rows} rows for {len(seqs)}"
        assert plan.start == 0 and len(plan.chunks) == 1, "an encoder-decoder prefill runs whole"
        self.hf_model, self.seqs, self.device = hf_model, seqs, device
        self.steps = 0
        self._takes_positions = self._takes_logits_to_keep = self._takes_mm_types = False
        self._mrope, self.rope_deltas = False, None
        self._cache_kw = "cache"
        start = decoder_start(hf_model)
        assert start is not None, "an encoder-decoder with no decoder start token"
        width = max(len(s.prompt_ids) for s in seqs)
        enc = torch.full((len(seqs), width), seqs[0].pad_id, dtype=torch.long)
        enc_mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            enc[i, : len(s.prompt_ids)] = torch.tensor(s.prompt_ids, dtype=torch.long)
            enc_mask[i, : len(s.prompt_ids)] = 1
        self.prompt_width = 1
        self.input_ids = torch.full((len(seqs), 1), start, dtype=torch.long, device=device)  # [B, T]
        self.position_ids = torch.zeros_like(self.input_ids)  # [B, T]: each row's decoder positions
        self.attention_mask: torch.Tensor | None = None  # the decoder's; None: no padding
        self.encoder_mask = enc_mask.to(device)  # [B, S]
        self.encoder_hidden: torch.Tensor | None = None  # [B, S, d], from the prefill on
        self._enc_ids = enc.to(device)
        text = hf_model.config.get_text_config(decoder=True)
        self.cache = EncoderDecoderCache(DynamicCache(config=text), DynamicCache(config=text))
        layers = self.cache.self_attention_cache.layers
        for i, layer in enumerate(layers):
            if type(layer) is DynamicLayer and not layer.is_initialized:
                layers[i] = ReservedLayer()
        self._reserve()
        self._plan_prefill(plan)

    def _layers(self) -> list[Any]:
        return self.cache.self_attention_cache.layers

    def _cross(self) -> list[Any]:
        return self.cache.cross_attention_cache.layers

    def cacheable(self) -> bool:
        """Never: the prefix cache is keyed by token ids, and an enc-dec row's decoder columns
        depend on its encoder's input too."""
        return False

    def can_refill(self) -> bool:
        layers = self._layers()
        plain = all(type(layer) in (DynamicLayer, ReservedLayer) and layer.is_initialized for layer in layers)
        return self.steps > 0 and bool(layers) and plain

    def _plan_prefill(self, plan: PrefillPlan) -> None:
        self._prefill = plan
        self.fork: torch.Tensor | None = None
        if plan.fork is not None:
            self.fork = torch.tensor(plan.fork, dtype=torch.long, device=self.device)
        idx = torch.tensor(plan.rows, dtype=torch.long, device=self.device)
        self._pre = (self._enc_ids.index_select(0, idx), self.encoder_mask.index_select(0, idx))
        self._chunks, self._chunk = plan.chunks, 0

    def prefill_step(self, forward: Forward) -> int:
        """The prefill's one forward: the encoder on the computed rows' prompts, the decoder on the
        start token; each row's first token. Returns the prompt tokens the encoder computed."""
        assert self.prefilling, "prefill runs once"
        self._chunk += 1
        ids, mask = self._pre
        start = self.input_ids[: ids.shape[0]]  # every row starts with the same token
        inputs = self.hf_model.prepare_inputs_for_generation(
            start, cache=self.cache, attention_mask=mask, use_cache=True, is_first_iteration=True
        )
        inputs["input_ids"] = ids  # the encoder's input: it runs inside this forward
        with self._head_on_every_row(True):
            outputs = forward(**inputs, return_dict=True)
        hidden = outputs.encoder_last_hidden_state  # [U, S, d]
        self.encoder_hidden = hidden if self.fork is None else hidden.index_select(0, self.fork)
        self._consume(outputs, fork=self.fork)
        self._pre, self._enc_ids = None, None  # type: ignore[assignment]
        return int(mask.sum())

    def step(self, forward: Forward) -> None:
        """Feed the decoder's last tokens against the rows' encoder outputs; choose the next ones."""
        assert 0 < self.steps and not self.done, "step needs a prefilled, unfinished batch"
        kw: dict[str, Any] = {"cache": self.cache, "use_cache": True, "attention_mask": self.encoder_mask}
        kw["encoder_outputs"] = (self.encoder_hidden,)
        if self.attention_mask is not None:  # rows of different decoder lengths (refills)
            kw["decoder_attention_mask"] = self.attention_mask
        inputs = self.hf_model.prepare_inputs_for_generation(self.input_ids, next_sequence_length=1, **kw)
        if self.attention_mask is not None:
            inputs["decoder_position_ids"] = self.position_ids[:, -1:]
        self._consume(forward(**inputs, return_dict=True))

    # ------------------------------------------------------------------ refill and dropped rows
    def _keep_rows(self, idx: torch.Tensor) -> None:
        assert self.encoder_hidden is not None
        self.encoder_hidden = self.encoder_hidden.index_select(0, idx)
        self.encoder_mask = self.encoder_mask.index_select(0, idx)
        for layer in self._cross():
            layer.keys = layer.keys.index_select(0, idx.to(layer.keys.device))
            layer.values = layer.values.index_select(0, idx.to(layer.values.device))
        self._trim_encoder()

    def _merge_rows(self, mini: Batch, slots: list[int]) -> None:
        assert isinstance(mini, EncDecBatch) and self.encoder_hidden is not None
        assert mini.encoder_hidden is not None
        width = max(self.encoder_mask.shape[1], mini.encoder_mask.shape[1])

        def right(t: torch.Tensor, dim: int) -> torch.Tensor:  # right-pad along dim to the common width
            extra = width - t.shape[dim]
            if extra == 0:
                return t
            shape = list(t.shape)
            shape[dim] = extra
            return torch.cat([t, t.new_zeros(shape)], dim=dim)

        hidden = (right(self.encoder_hidden, 1), right(mini.encoder_hidden, 1))
        self.encoder_hidden = combine_rows(*hidden, slots)
        self.encoder_mask = combine_rows(right(self.encoder_mask, 1), right(mini.encoder_mask, 1), slots)
        for la, lb in zip(self._cross(), mini._cross(), strict=True):
            la.keys = combine_rows(right(la.keys, -2), right(lb.keys, -2), slots)
            la.values = combine_rows(right(la.values, -2), right(lb.values, -2), slots)
        self._trim_encoder()

    def _trim_encoder(self) -> None:
        """Drop the trailing encoder columns that are padding in every row."""
        assert self.encoder_hidden is not None
        used = int(self.encoder_mask.any(0).nonzero().max()) + 1
        if used == self.encoder_mask.shape[1]:
            return
        self.encoder_hidden = self.encoder_hidden[:, :used]
        self.encoder_mask = self.encoder_mask[:, :used]
        for layer in self._cross():
            layer.keys = layer.keys[..., :used, :]
            layer.values = layer.values[..., :used, :]


class EncDecScoreRun(ScoreRun):
    """The rows of one encoder-decoder score run (``ScorePlan.encdec``). Each row's decoder
    holds its prefix and its response, fed but the last token: the prefix is
    ``[decoder_start_token_id]`` (T5, BART: the prompt ids are the encoder's input) or the prompt
    ids (Whisper: the encoder's input is the row's ``input_features``); the logits of decoder
    column ``len(prefix) - 1 + j`` score response token ``j``. The encoder ids and the decoder
    inputs are right-padded: the encoder's padding is masked; the decoder's is causal, so it
    never reaches a row's own columns, and every row's decoder positions count from 0 (BART's and
    Whisper's learned positions need nothing more). The scores are the model's own logits: no
    forced-token processor applies (BART's ``forced_bos_token_id`` / ``forced_eos_token_id``
    shape what ``generate()`` draws, not what teacher forcing scores)."""

    def __init__(
        self, hf_model: Any, reqs: list[ScoreRequest], device: torch.device, plan: ScorePlan
    ) -> None:
        assert reqs and plan.batch_rows == len(reqs), f"a plan of {plan.batch_rows} rows for {len(reqs)}"
        assert len(plan.chunks) == 1 and plan.distinct is None, "an encoder-decoder score run is one forward"
        self.hf_model, self.reqs, self.device, self.plan = hf_model, reqs, device, plan
        self.params = reqs[0].params
        assert all(r.params == self.params for r in reqs), "one run, one setting"
        pad = getattr(hf_model.config, "pad_token_id", None)
        pad = pad if isinstance(pad, int) else 0
        self.features = all(r.inputs is not None for r in reqs)  # Whisper: the prompt is the prefix
        assert self.features or all(r.inputs is None for r in reqs), "one kind of row a run"
        start = decoder_start(hf_model)
        assert start is not None, "an encoder-decoder with no decoder start token"
        prefixes = [r.prompt_ids if self.features else [start] for r in reqs]
        width = max(1, max(len(x) + len(r.response_ids) - 1 for x, r in zip(prefixes, reqs, strict=True)))
        dec = torch.full((len(reqs), width), pad, dtype=torch.long)
        targets = torch.zeros((len(reqs), plan.response_width), dtype=torch.long)  # 0 past a row: dropped
        cols = torch.zeros((len(reqs), plan.response_width), dtype=torch.long)  # the column scoring each
        for i, (x, r) in enumerate(zip(prefixes, reqs, strict=True)):
            fed, g = (x + r.response_ids)[:-1], len(r.response_ids)
            dec[i, : len(fed)] = torch.tensor(fed, dtype=torch.long)
            targets[i, :g] = torch.tensor(r.response_ids, dtype=torch.long)
            cols[i] = (len(x) - 1 + torch.arange(plan.response_width)).clamp(max=width - 1)
        self.dec, self.targets, self._cols = dec.to(device), targets, cols.to(device)
        if self.features:
            feats = [r.inputs["input_features"] for r in reqs]  # type: ignore[index]
            feats = [f if f.dim() == 3 else f[None] for f in feats]
            self.encoder_inputs: dict[str, torch.Tensor] = {"input_features": torch.cat(feats).to(device)}
            self._encoder_tokens = 0
        else:
            s_w = max(len(r.prompt_ids) for r in reqs)
            enc = torch.full((len(reqs), s_w), pad, dtype=torch.long)
            enc_mask = torch.zeros((len(reqs), s_w), dtype=torch.long)
            for i, r in enumerate(reqs):
                enc[i, : len(r.prompt_ids)] = torch.tensor(r.prompt_ids, dtype=torch.long)
                enc_mask[i, : len(r.prompt_ids)] = 1
            self.encoder_inputs = {"input_ids": enc.to(device), "attention_mask": enc_mask.to(device)}
            self._encoder_tokens = int(enc_mask.sum())
        self._pieces: list[dict[str, torch.Tensor]] = []
        self._chunk = 0

    def step(self, forward: Forward) -> int:
        """The run's ONE forward (the encoder inside it: the tick's tower bit covers it); its
        logits reduced before it returns. The tokens computed (encoder ids and decoder, no padding)."""
        assert not self.done, "an encoder-decoder score run is one forward"
        self._chunk += 1
        out = forward(**self.encoder_inputs, decoder_input_ids=self.dec, use_cache=False, return_dict=True)
        logits = out.logits  # [B, W, V]
        del out
        if self.features:  # each row's response columns start after its own prefix
            logits = logits.gather(1, self._cols[..., None].expand(-1, -1, logits.shape[-1]))
        red = reduce(logits.reshape(-1, logits.shape[-1]), self.targets.reshape(-1), self.params)
        del logits
        self._pieces.append({k: v.reshape(*self.targets.shape, *v.shape[1:]) for k, v in red.items()})
        fed = sum(
            max(0, len(r.prompt_ids if self.features else [0]) + len(r.response_ids) - 1) for r in self.reqs
        )
        return self._encoder_tokens + fed
