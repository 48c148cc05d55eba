"""Which transformers auto class builds a checkpoint's model: the causal LM's, a VLM's, or an
encoder-decoder's."""

from __future__ import annotations

from typing import Any


def auto_class(config: Any) -> Any:
    """The transformers auto class that builds ``config``'s model with its LM head: the causal LM's,
    else (a VLM: Qwen2-VL, LLaVA, Idefics3 ...) the image-text-to-text one, and for an
    encoder-decoder (T5, BART) the seq2seq LM's, for a speech one (Whisper) the speech seq2seq's.
    Not collective."""
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoModelForSeq2SeqLM,
        AutoModelForSpeechSeq2Seq,
    )
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES,
    )

    kind = getattr(config, "model_type", None)
    if getattr(config, "is_encoder_decoder", False) and kind in MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES:
        return AutoModelForSpeechSeq2Seq
    if getattr(config, "is_encoder_decoder", False) and kind in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:
        return AutoModelForSeq2SeqLM  # BART is a causal-LM kind too (its decoder alone)
    if kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and kind in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return AutoModelForImageTextToText
    return AutoModelForCausalLM
