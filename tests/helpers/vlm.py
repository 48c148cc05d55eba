"""A tiny Qwen2-VL built in code (no download), its image inputs made by hand in the layout of its
image processor (``pixel_values``: one row of C x T x P x P values per patch; ``image_grid_thw``:
patches per image in time, height, width), prompts with their image tokens, and the oracle:
single-process HF ``generate()`` per request."""

from __future__ import annotations

from typing import Any

import torch

IMAGE, START, END = 120, 122, 123  # image, vision start and end token ids (LLaVA: IMAGE only)
EOS, PAD = 2, 0
MERGE, PATCH, TEMPORAL, CHANNELS = 2, 4, 2, 3


def _qwen_text(**over: Any) -> dict[str, Any]:
    """The 2-layer text config of the tiny Qwen-VL models (M-RoPE sections 2, 1, 1)."""
    return dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, bos_token_id=1,
        eos_token_id=EOS, pad_token_id=PAD,
        rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0},
        **over,
    )  # fmt: skip


def _qwen_vl(config: Any, model_class: Any, text: dict, vision: dict) -> Any:
    """A tiny Qwen-VL of ``model_class`` from its text and vision configs, in eval mode."""
    cfg = config(
        text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=121,
        vision_start_token_id=START, vision_end_token_id=END,
    )  # fmt: skip
    model = model_class(cfg).eval()
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = PAD
    return model


def tiny_qwen2_vl(seed: int = 0) -> Any:
    """A 2-layer Qwen2-VL with a 2-block vision tower, random weights of ``seed``, in eval mode."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    torch.manual_seed(seed)
    text = _qwen_text()
    vision = dict(
        depth=2, embed_dim=32, initializer_range=0.2, hidden_size=32, num_heads=4, mlp_ratio=2,
        patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL, in_channels=CHANNELS,
    )  # fmt: skip
    return _qwen_vl(Qwen2VLConfig, Qwen2VLForConditionalGeneration, text, vision)


def tiny_qwen2_5_vl(seed: int = 0) -> Any:
    """:func:`tiny_qwen2_vl`'s shape as a Qwen2.5-VL: its vision blocks windowed (a window of 2 x 2
    merged patches, the second block full attention), an MLP of gate/up/down."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    text = _qwen_text()
    vision = dict(
        depth=2, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=32, initializer_range=0.2,
        patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL, in_channels=CHANNELS,
        window_size=PATCH * MERGE * 2, fullatt_block_indexes=[1],
    )  # fmt: skip
    return _qwen_vl(Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, text, vision)


def tiny_qwen3_vl(seed: int = 0) -> Any:
    """:func:`tiny_qwen2_vl`'s shape as a Qwen3-VL: interleaved M-RoPE, learned vision positions
    (interpolated to each grid), deepstack features from the first vision block."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    torch.manual_seed(seed)
    text = _qwen_text(head_dim=8)
    text["rope_parameters"]["mrope_interleaved"] = True
    vision = dict(
        depth=2, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=32, initializer_range=0.2,
        patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL, in_channels=CHANNELS,
        num_position_embeddings=64, deepstack_visual_indexes=[0],
    )  # fmt: skip
    return _qwen_vl(Qwen3VLConfig, Qwen3VLForConditionalGeneration, text, vision)


#: The Qwen-VL families built here, by model type.
QWEN_VL = {"qwen2_vl": tiny_qwen2_vl, "qwen2_5_vl": tiny_qwen2_5_vl, "qwen3_vl": tiny_qwen3_vl}


def image(h: int, w: int, seed: int) -> dict[str, torch.Tensor]:
    """One image of ``h`` x ``w`` patches (even: the merger takes 2 x 2), random pixels of ``seed``."""
    g = torch.Generator().manual_seed(seed)
    dim = CHANNELS * TEMPORAL * PATCH * PATCH
    return {
        "pixel_values": torch.randn((h * w, dim), generator=g),
        "image_grid_thw": torch.tensor([[1, h, w]]),
    }


def images(*sizes: tuple[int, int], seed: int = 0) -> dict[str, torch.Tensor]:
    """Several images of one prompt, in order."""
    parts = [image(h, w, seed + i) for i, (h, w) in enumerate(sizes)]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def prompt(
    text: list[int], inputs: dict[str, torch.Tensor] | None, tail: list[int] | None = None
) -> list[int]:
    """``text``, then each image's tokens between its start and end ids, then ``tail``."""
    ids = list(text)
    if inputs is not None:
        for t, h, w in inputs["image_grid_thw"].tolist():
            ids += [START] + [IMAGE] * (t * h * w // MERGE**2) + [END]
    return ids + list(tail or [7, 8])


def hf_tokens(
    model: Any, ids: list[int], inputs: dict[str, torch.Tensor] | None, max_new_tokens: int
) -> list[int]:
    """Single-process HF ``generate()`` on one request, greedy: its new tokens up to its first EOS."""
    x = torch.tensor([ids])
    kw: dict[str, Any] = {}
    if inputs is not None:
        kw = dict(inputs, mm_token_type_ids=(x == IMAGE).int())
    with torch.no_grad():
        out = model.generate(
            input_ids=x, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=EOS, pad_token_id=PAD,
            synced_gpus=False, **kw,
        )[0, len(ids) :].tolist()  # fmt: skip
    return out[: out.index(EOS) + 1] if EOS in out else out


LLAVA_SIDE, LLAVA_PATCH = 16, 4  # a 16 x 16 image of 4 x 4 patches: 16 image tokens (CLS dropped)


def _llava_towers() -> tuple[Any, Any]:
    """The tiny LLaVA kinds' vision config (a 2-layer CLIP) and text config (a 2-layer Llama)."""
    from transformers import CLIPVisionConfig, LlamaConfig

    vision = CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        image_size=LLAVA_SIDE, patch_size=LLAVA_PATCH, projection_dim=32, initializer_range=0.2,
    )  # fmt: skip
    text = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, initializer_range=0.2, eos_token_id=EOS, pad_token_id=PAD, bos_token_id=1,
    )  # fmt: skip
    return vision, text


def tiny_llava(seed: int = 0) -> Any:
    """A 2-layer LLaVA (Llama text, a 2-layer CLIP vision tower, the projector), random weights."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(seed)
    vision, text = _llava_towers()
    cfg = LlavaConfig(
        vision_config=vision, text_config=text, image_token_id=IMAGE, vision_feature_layer=-1,
        vision_feature_select_strategy="default",
    )  # fmt: skip
    model = LlavaForConditionalGeneration(cfg).eval()
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = PAD
    return model


def llava_images(n: int, seed: int) -> dict[str, torch.Tensor]:
    """``n`` images of one prompt, ``[n, 3, 16, 16]``."""
    g = torch.Generator().manual_seed(seed)
    return {"pixel_values": torch.randn((n, 3, LLAVA_SIDE, LLAVA_SIDE), generator=g)}


def llava_prompt(
    text: list[int], inputs: dict[str, torch.Tensor] | None, tail: list[int] | None = None
) -> list[int]:
    ids = list(text)
    if inputs is not None:
        per = (LLAVA_SIDE // LLAVA_PATCH) ** 2
        for _ in range(inputs["pixel_values"].shape[0]):
            ids += [IMAGE] * per + [9]
    return ids + list(tail or [7, 8])


def hf_llava_tokens(
    model: Any, ids: list[int], inputs: dict[str, torch.Tensor] | None, max_new_tokens: int
) -> list[int]:
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(
            input_ids=x, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=EOS, pad_token_id=PAD,
            synced_gpus=False, **(inputs or {}),
        )[0, len(ids) :].tolist()  # fmt: skip
    return out[: out.index(EOS) + 1] if EOS in out else out


def tiny_llava_next(seed: int = 0) -> Any:
    """A 2-layer LLaVA-NeXT: :func:`tiny_llava`'s towers, images cut in 16 x 16 tiles up to 32 x 32
    (``image_grid_pinpoints``), a base view first; random weights."""
    from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration

    torch.manual_seed(seed)
    vision, text = _llava_towers()
    side = LLAVA_SIDE
    cfg = LlavaNextConfig(
        vision_config=vision, text_config=text, image_token_id=IMAGE, vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        image_grid_pinpoints=[[side, side], [side, 2 * side], [2 * side, side], [2 * side, 2 * side]],
    )  # fmt: skip
    model = LlavaNextForConditionalGeneration(cfg).eval()
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = PAD
    return model


def llava_next_image(model: Any, h: int, w: int, seed: int) -> tuple[dict[str, torch.Tensor], int]:
    """One ``h`` x ``w`` image for :func:`tiny_llava_next` as its processor lays it out
    (``[1, tiles, 3, 16, 16]`` and ``image_sizes``), and its number of image tokens (what the
    model's own ``get_image_features`` makes of it)."""
    from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

    cfg = model.config
    n = image_size_to_num_patches((h, w), cfg.image_grid_pinpoints, LLAVA_SIDE)
    g = torch.Generator().manual_seed(seed)
    x = {
        "pixel_values": torch.randn((1, n, 3, LLAVA_SIDE, LLAVA_SIDE), generator=g),
        "image_sizes": torch.tensor([[h, w]]),
    }
    with torch.no_grad():
        feats = model.model.get_image_features(
            x["pixel_values"],
            x["image_sizes"],
            vision_feature_layer=-1,
            vision_feature_select_strategy="default",
        ).pooler_output
    return x, int(feats[0].shape[0])


def tiny_idefics3(kind: str = "idefics3", seed: int = 0) -> Any:
    """A 2-layer Idefics3 or SmolVLM (``kind``): a 2-layer SigLIP-style vision model on 16 x 16
    images of 4 x 4 patches, the pixel-shuffle connector (scale 2: 4 image tokens per image),
    a Llama text model; random weights."""
    import transformers as tf

    config, model_class = {
        "idefics3": (tf.Idefics3Config, tf.Idefics3ForConditionalGeneration),
        "smolvlm": (tf.SmolVLMConfig, tf.SmolVLMForConditionalGeneration),
    }[kind]
    torch.manual_seed(seed)
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        image_size=LLAVA_SIDE, patch_size=LLAVA_PATCH, initializer_range=0.2,
    )  # fmt: skip
    text = dict(
        model_type="llama", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2, eos_token_id=EOS,
        pad_token_id=PAD, bos_token_id=1,
    )  # fmt: skip
    cfg = config(vision_config=vision, text_config=text, scale_factor=2, image_token_id=IMAGE)
    model = model_class(cfg).eval()
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = PAD
    return model


IDEFICS_TOKENS = (LLAVA_SIDE // LLAVA_PATCH) ** 2 // 4  # an image's tokens after the pixel shuffle


def idefics3_images(n: int, seed: int) -> dict[str, torch.Tensor]:
    """``n`` images of one prompt in Idefics3's layout, ``[1, n, 3, 16, 16]``."""
    g = torch.Generator().manual_seed(seed)
    return {"pixel_values": torch.randn((1, n, 3, LLAVA_SIDE, LLAVA_SIDE), generator=g)}


def tiny_llava_processor() -> Any:
    """A processor for :func:`tiny_llava`, as a LLaVA checkpoint ships one: a word-level tokenizer
    (``t<i>`` is id i, ``<image>`` the image token) and a PIL CLIP image processor to 16 x 16."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlavaProcessor, PreTrainedTokenizerFast
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    vocab = {f"t{i}": i for i in range(128)}
    for name, i in {"<pad>": PAD, "<s>": 1, "</s>": EOS, "<image>": IMAGE}.items():
        vocab.pop(f"t{i}")
        vocab[name] = i
    words = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=words, pad_token="<pad>", eos_token="</s>", bos_token="<s>",
        additional_special_tokens=["<image>"],
    )  # fmt: skip
    side = {"height": LLAVA_SIDE, "width": LLAVA_SIDE}
    pixels = CLIPImageProcessorPil(size={"shortest_edge": LLAVA_SIDE}, crop_size=side)
    # CLIP's class token: 17 features, the default strategy drops it: 16 image tokens
    kind = {"patch_size": LLAVA_PATCH, "vision_feature_select_strategy": "default"}
    kind["num_additional_image_tokens"] = 1
    return LlavaProcessor(image_processor=pixels, tokenizer=tok, **kind)


def hf_scores(
    model: Any, ids: list[int], response: list[int], inputs: dict[str, torch.Tensor] | None
) -> torch.Tensor:
    """Single-process HF teacher forcing on one row: ``model(prompt + response, images)``'s log
    softmax at each response token (Qwen2-VL with its token types; LLaVA takes the images alone)."""
    x = torch.tensor([list(ids) + list(response)])
    kw: dict[str, Any] = dict(inputs or {})
    if inputs is not None and "image_grid_thw" in inputs:
        kw["mm_token_type_ids"] = (x == IMAGE).int()
    with torch.no_grad():
        logits = model(input_ids=x, **kw).logits[0, len(ids) - 1 : len(ids) - 1 + len(response)]
    lp = torch.log_softmax(logits.float(), -1)
    return lp.gather(-1, torch.tensor(response, dtype=torch.long)[:, None]).squeeze(-1)
