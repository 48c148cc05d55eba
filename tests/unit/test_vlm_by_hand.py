"""Qwen-VL inputs without a processor (``generation/images.py``: ``qwen_vl_pixel_values``,
``qwen_vl_image_ids``): the layout of transformers' own image processor, prompts that generate
as HF ``generate()`` on the local backend, and docs/USAGE.md's block run as written."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig
from vlm import EOS, MERGE, PAD, PATCH, QWEN_VL, TEMPORAL, hf_tokens, prompt, tiny_qwen2_vl

import shardgen
from shardgen import toy
from shardgen.generation.images import qwen_vl_image_ids, qwen_vl_pixel_values

USAGE = Path(__file__).resolve().parents[2] / "docs" / "USAGE.md"
SNIPPET = re.compile(r"```python\n(# Qwen-VL images without a processor.*?)```", re.S)
SIDE = PATCH * MERGE


def _pixels(sizes: list[tuple[int, int]], seed: int) -> list[torch.Tensor]:
    """Normalized images [3, H, W] of ``sizes`` (in merged blocks of patches)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(3, h * SIDE, w * SIDE, generator=g) for h, w in sizes]


def test_pixel_values_are_laid_out_as_the_image_processor_does():
    """transformers' Qwen2-VL image processor (its PIL backend: no torchvision) on uint8 images, and
    the helper on the same images rescaled and normalized: the same rows, the same grids."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    model = tiny_qwen2_vl(0)
    proc = Qwen2VLImageProcessorPil(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=TEMPORAL)
    rng = np.random.default_rng(0)
    raw = [rng.integers(0, 256, (h * SIDE, w * SIDE, 3), dtype=np.uint8) for h, w in ((2, 3), (1, 1))]
    want = proc(images=raw, do_resize=False, return_tensors="pt")
    mean, std = (torch.tensor(v)[:, None, None] for v in (proc.image_mean, proc.image_std))
    norm = [(torch.from_numpy(r).permute(2, 0, 1).float() / 255 - mean) / std for r in raw]
    got = qwen_vl_pixel_values(norm, model.config)
    assert got["image_grid_thw"].tolist() == want["image_grid_thw"].tolist() == [[1, 4, 6], [1, 2, 2]]
    assert got["pixel_values"].shape == want["pixel_values"].shape == (24 + 4, 3 * TEMPORAL * PATCH**2)
    torch.testing.assert_close(got["pixel_values"], want["pixel_values"].float(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", sorted(QWEN_VL))
def test_prompts_built_by_hand_generate_as_hf(family):
    """Ids from ``image_grid_thw`` (two images in one prompt, one in another, a text-only row),
    pixel_values from the helper: greedy tokens equal HF ``generate()`` given the same inputs."""
    model = QWEN_VL[family](0)
    two, one = _pixels([(2, 3), (1, 1)], seed=1), _pixels([(3, 1)], seed=2)
    xs = [qwen_vl_pixel_values(two, model.config), None, qwen_vl_pixel_values(one, model.config)]
    rows = []
    for x, text, tail in zip(xs, ([5, 6], [9, 10, 11], [3]), ([7, 8], [12], [4, 4]), strict=True):
        images = [] if x is None else [qwen_vl_image_ids(g, model.config) for g in x["image_grid_thw"]]
        rows.append(text + sum(images, []) + tail)
        assert rows[-1] == prompt(text, x, tail)  # the tests' own image prompts: one layout
    with shardgen.Engine(model, backend="local") as eng:
        got = eng.generate(rows, inputs=xs, max_new_tokens=6, eos_token_id=EOS, pad_token_id=PAD)
    assert [c.token_ids for c in got] == [hf_tokens(model, r, x, 6) for r, x in zip(rows, xs, strict=True)]


def test_the_usage_block_runs_and_generates_as_hf():
    blocks = SNIPPET.findall(USAGE.read_text(encoding="utf-8"))
    assert len(blocks) == 1, blocks
    torch.manual_seed(0)
    model = tiny_qwen2_vl(0)
    tok = AutoTokenizer.from_pretrained(toy.toy_model_path())  # its ids lie below the image ids
    with shardgen.Engine(model, backend="local") as engine:
        ns = {"model": model, "engine": engine, "tok": tok}
        exec(compile(blocks[0], str(USAGE), "exec"), ns)  # exactly the doc's text
    x, ids = ns["x"], ns["ids"]
    assert x["image_grid_thw"].tolist() == [[1, 8, 12]] and ids.count(model.config.image_token_id) == 24
    assert ns["out"][0].token_ids == hf_tokens(model, ids, x, 8)


def test_shapes_that_do_not_fit_are_value_errors_with_the_numbers():
    cfg = tiny_qwen2_vl(0).config
    with pytest.raises(
        ValueError,
        match=r"multiples of patch_size \* spatial_merge_size = 4 \* 2 = 8 expected, got shape \(3, 8, 12\)",
    ):
        qwen_vl_pixel_values([torch.zeros(3, 8, 12)], cfg)
    with pytest.raises(
        ValueError, match=r"\(1, 3, 4\): h and w must be positive multiples of spatial_merge_size = 2"
    ):
        qwen_vl_image_ids([1, 3, 4], cfg)
    with pytest.raises(ValueError, match="a Qwen-VL config .* got model_type 'llama'"):
        qwen_vl_image_ids([1, 2, 2], LlamaConfig())
