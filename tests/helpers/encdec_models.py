"""Tiny encoder-decoders built in code (no download): a T5 and a BART with random weights
(embeddings tied to the LM head, as both tie them by default), and the oracle: single-process HF
``generate()`` per request."""

from __future__ import annotations

from typing import Any

import torch
from score_scenarios import reference_row

VOCAB = 48
T5_EOS, T5_PAD = 1, 0  # T5 starts its decoder at the pad id
BART_EOS, BART_PAD = 2, 1  # BART starts its decoder at the EOS id


#: The tiny T5 / mT5 and BART / kin shapes and special ids.
_T5_SHAPE: dict[str, Any] = dict(
    vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
    relative_attention_num_buckets=8, decoder_start_token_id=T5_PAD, pad_token_id=T5_PAD, eos_token_id=T5_EOS,
)  # fmt: skip
_BART_SHAPE: dict[str, Any] = dict(
    vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
    decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
    pad_token_id=BART_PAD, bos_token_id=0, eos_token_id=BART_EOS, forced_eos_token_id=BART_EOS,
)  # fmt: skip


def tiny_t5(seed: int = 2, init: float = 5.0) -> Any:
    """A 2+2-layer T5 (gated GELU, relative attention bias), eval mode. ``init``: its
    ``initializer_factor`` (5: wide logits, so that tokens depend on every part; scores compared
    in float32 take 1, logits of a few units)."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(seed)
    cfg = T5Config(**_T5_SHAPE, initializer_factor=init, feed_forward_proj="gated-gelu")
    return T5ForConditionalGeneration(cfg).eval()


def tiny_bart(seed: int = 1) -> Any:
    """A 2+2-layer BART, its learned positions drawn wide (so that tokens depend on them), eval
    mode. As BART checkpoints (bart-large-cnn) do, it forces BOS first and EOS at the length
    limit (``forced_bos_token_id``, ``forced_eos_token_id``)."""
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(seed)
    cfg = BartConfig(**_BART_SHAPE, decoder_start_token_id=BART_EOS, init_std=0.2)
    model = BartForConditionalGeneration(cfg).eval()
    model.generation_config.forced_bos_token_id = 0
    with torch.no_grad():
        model.model.decoder.embed_positions.weight.normal_(0, 1.0)
        model.model.encoder.embed_positions.weight.normal_(0, 1.0)
    return model


def tiny_mt5(seed: int = 2, init: float = 5.0) -> Any:
    """:func:`tiny_t5`'s shape as an mT5 (its own classes; untied LM head)."""
    from transformers import MT5Config, MT5ForConditionalGeneration

    torch.manual_seed(seed)
    cfg = MT5Config(**_T5_SHAPE, initializer_factor=init)
    return MT5ForConditionalGeneration(cfg).eval()


def tiny_bart_kin(kind: str, seed: int = 2) -> Any:
    """A 2+2-layer mBART (pre-norm, learned positions), Marian or Pegasus (sinusoidal positions,
    the decoder started at the pad id), weights and positions drawn wide (tokens that vary
    along a row), eval mode."""
    import transformers as tf

    config, model = {
        "mbart": (tf.MBartConfig, tf.MBartForConditionalGeneration),
        "marian": (tf.MarianConfig, tf.MarianMTModel),
        "pegasus": (tf.PegasusConfig, tf.PegasusForConditionalGeneration),
    }[kind]
    start = BART_EOS if kind == "mbart" else BART_PAD
    torch.manual_seed(seed)
    cfg = config(**_BART_SHAPE, decoder_start_token_id=start, init_std=0.5)
    m = model(cfg).eval()
    with torch.no_grad():  # positions drawn wide (sinusoids too): tokens that depend on them
        m.model.decoder.embed_positions.weight.normal_(0, 3.0)
        m.model.encoder.embed_positions.weight.normal_(0, 3.0)
    return m


#: BART's kin and mT5: encoder-decoders of the same layouts as BART and T5.
KIN = ("mbart", "marian", "pegasus", "mt5")


def tiny(kind: str, seed: int | None = None, **over: Any) -> Any:
    if kind in ("mbart", "marian", "pegasus"):
        return tiny_bart_kin(kind) if seed is None else tiny_bart_kin(kind, seed)
    make = {"t5": tiny_t5, "bart": tiny_bart, "mt5": tiny_mt5}[kind]
    return make(**over) if seed is None else make(seed, **over)


def tiny_scored(kind: str) -> Any:
    """``tiny(kind)`` for comparing scores in float32: logits of a few units (T5 at ``init=1``;
    at 5 its logprobs reach -150, where float32 rounding alone is 1e-5)."""
    return tiny(kind, init=1.0) if kind == "t5" else tiny(kind)


def hf_tokens(model: Any, ids: list[int], max_new_tokens: int) -> list[int]:
    """Single-process HF ``generate()`` on one request, greedy: the decoder's new tokens (after
    the start token HF returns first) up to the first EOS."""
    eos = model.generation_config.eos_token_id
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, synced_gpus=False
        )[0, 1:].tolist()
    return out[: out.index(eos) + 1] if eos in out else out


def hf_teacher(
    model: Any, prompts: list[list[int]], responses: list[list[int]], temperature: float = 1.0, top_k: int = 0
) -> list[dict[str, Any]]:
    """Per row, single-process HF teacher forcing, unpadded: ``model(input_ids=prompt,
    decoder_input_ids=[start] + response[:-1])``, log softmax at the response; the rows in the
    format of ``score_scenarios.reference`` (for ``score_scenarios.worst``)."""
    start = model.generation_config.decoder_start_token_id
    out = []
    for p, r in zip(prompts, responses, strict=True):
        with torch.no_grad():
            logits = model(
                input_ids=torch.tensor([p]), decoder_input_ids=torch.tensor([[start, *r[:-1]]])
            ).logits[0]
        out.append(reference_row(logits, r, temperature, top_k))
    return out


WHISPER_MELS, WHISPER_FRAMES = 8, 12  # the encoder takes 2 * max_source_positions frames


def tiny_whisper(seed: int = 3) -> Any:
    """A 2+2-layer Whisper (8 mel bins, 6 encoder positions: 12 frames), no suppressed tokens,
    its weights drawn wide (so that scores depend on the features), eval mode. Its prompts are
    decoder prefixes, from the start token (1)."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(seed)
    cfg = WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=WHISPER_MELS, encoder_layers=2, decoder_layers=2, d_model=16,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
        max_source_positions=WHISPER_FRAMES // 2, max_target_positions=32, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, decoder_start_token_id=1, suppress_tokens=None,
        begin_suppress_tokens=None, init_std=0.2,
    )  # fmt: skip
    return WhisperForConditionalGeneration(cfg).eval()


def features(seed: int) -> dict[str, torch.Tensor]:
    """One Whisper row's ``inputs``: random ``[mels, frames]`` features."""
    g = torch.Generator().manual_seed(seed)
    return {"input_features": torch.randn((WHISPER_MELS, WHISPER_FRAMES), generator=g)}


def hf_whisper(
    model: Any, prompts: list[list[int]], responses: list[list[int]], xs: list[dict]
) -> list[dict]:
    """Per row, single-process HF teacher forcing of a Whisper row, unpadded:
    ``model(input_features=x, decoder_input_ids=(prompt + response)[:-1])``, log softmax at the
    response (the format of ``score_scenarios.reference``)."""
    out = []
    for p, r, x in zip(prompts, responses, xs, strict=True):
        with torch.no_grad():
            logits = model(
                input_features=x["input_features"][None], decoder_input_ids=torch.tensor([(p + r)[:-1]])
            ).logits[0, len(p) - 1 :]
        lp = torch.log_softmax(logits.float(), -1)
        row = {"logprobs": lp.gather(-1, torch.tensor(r, dtype=torch.long)[:, None]).squeeze(-1)}
        row["entropy"] = -(lp.exp() * lp).sum(-1)
        row["logits"], row["all"] = logits, lp
        out.append(row)
    return out
