"""Where a request's images sit in its prompt, and what they are: the prefix cache's key for an
image row (``prefix_cache.py``).

The KV of a token after an image depends on the image's pixels, which the ids do not say (every
image's placeholder tokens carry the one image token id). So an image row's cache key is its
prompt with each image's placeholder tokens salted by that image's digest (a hash of its
``pixel_values`` rows and its ``image_grid_thw`` row): two rows share a cached prefix only where
their ids AND the images up to there are the same. The vision tower's features of an image come
in whole, so a shared prefix may not end inside an image's placeholder tokens (``cut``); the
images after it go with the forward of their tokens (``inputs_of``).

Layouts known: Qwen2-VL (``image_grid_thw``: image k takes ``prod(grid[k])`` rows of
``pixel_values`` and ``prod(grid[k]) / merge**2`` tokens) and LLaVA (``pixel_values[k]`` is image
k; every image takes the same number of tokens). Any other inputs: one span from the first image
token to the last, salted by a digest of every input, so a prefix is shared before the first
image or past the last one, never between.

Pure, no model: the driver thread and the caller's (``requests.build_request``) only.

And, for the user, a Qwen-VL image's inputs and prompt ids without a processor (a trainer with its
own data pipeline, or no torchvision): ``qwen_vl_pixel_values`` lays images out as the Qwen2-VL
image processor does, ``qwen_vl_image_ids`` gives an image's tokens from its ``image_grid_thw``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch


def digest(*tensors: torch.Tensor) -> bytes:
    """A digest of ``tensors``' dtypes, shapes and bytes (equal tensors, equal digests)."""
    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        t = t.detach().to("cpu").contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.digest()


@dataclass(frozen=True)
class ImageLayout:
    """One prompt's images: the prompt columns ``[start, end)`` of each image's placeholder tokens
    (``spans``, in order), each image's digest, where each image's rows begin in every input
    tensor (``rows[key][k]``; ``rows[key][n]`` its end), and the prompt as the prefix cache keys
    it (``keys``: the ids, an image's tokens as ``(id, digest, column within the image)``)."""

    spans: tuple[tuple[int, int], ...]
    digests: tuple[bytes, ...]
    rows: dict[str, tuple[int, ...]]
    keys: tuple[Hashable, ...]

    @property
    def key(self) -> bytes:
        """The images' identity: rows with the same prompt and key may share a prefill."""
        return b"".join(self.digests)

    def cut(self, n: int) -> int:
        """``n`` prompt columns shared, lowered so that no image is cut: an image's tokens are
        all in the prefix or all after it."""
        for s, e in self.spans:
            if s < n < e:
                return s
        return n

    def whole_before(self, n: int) -> int:
        """How many images lie wholly within the first ``n`` prompt columns."""
        return sum(1 for _, e in self.spans if e <= n)

    def inputs_of(self, inputs: dict[str, Any], k0: int, k1: int) -> dict[str, Any] | None:
        """``inputs`` for images ``k0`` to ``k1`` (excluded; the others' rows cut out); None when
        there are none."""
        k1 = min(k1, len(self.spans))
        if k0 >= k1:
            return None
        if k0 == 0 and k1 == len(self.spans):
            return inputs
        out = {}
        for name, v in inputs.items():
            at = self.rows.get(name)
            out[name] = v if v is None or at is None else v[at[k0] : at[k1]]
        return out


def image_layout(ids: list[int], inputs: dict[str, Any] | None, config: Any) -> ImageLayout | None:
    """The layout of ``inputs``' images in the prompt ``ids`` (validated: ``input_problems``);
    None without images or image tokens (the row then takes no prefix cache)."""
    token = getattr(config, "image_token_id", None)
    if not inputs or token is None:
        return None
    at = [j for j, t in enumerate(ids) if t == int(token)]
    if not at:
        return None
    tensors = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    per = _per_image(tensors, len(at), config)
    spans: list[tuple[int, int]] = []
    if per is not None:
        counts, rows = per
        first = 0
        for c in counts:
            s, e = at[first], at[first + c - 1] + 1
            if e - s != c:  # not one run of tokens: the whole-inputs fallback
                per = None
                break
            spans.append((s, e))
            first += c
    if per is None:
        rows = {}
        spans = [(at[0], at[-1] + 1)]
        digests = [digest(*(tensors[k] for k in sorted(tensors)))]
    else:
        digests = [
            digest(*(tensors[name][r[k] : r[k + 1]] for name, r in sorted(rows.items())))
            for k in range(len(spans))
        ]
    keys: list[Hashable] = list(ids)
    for (s, e), d in zip(spans, digests, strict=True):
        for j in range(s, e):
            keys[j] = (ids[j], d, j - s)
    return ImageLayout(tuple(spans), tuple(digests), rows, tuple(keys))


def _per_image(
    tensors: dict[str, torch.Tensor], tokens: int, config: Any
) -> tuple[list[int], dict[str, tuple[int, ...]]] | None:
    """Per image: its placeholder tokens, and where its rows begin in each input tensor; None for
    a layout not known here."""
    pixels, grid = tensors.get("pixel_values"), tensors.get("image_grid_thw")
    if pixels is None:
        return None
    if grid is not None:  # Qwen2-VL: image k's patches are prod(grid[k]) rows of pixel_values
        merge = int(getattr(getattr(config, "vision_config", None), "spatial_merge_size", 1))
        patches = [int(p) for p in grid.prod(-1).tolist()]
        counts = [p // merge**2 for p in patches]
        rows = {"pixel_values": _starts(patches), "image_grid_thw": _starts([1] * len(patches))}
    else:  # LLaVA: pixel_values[k] is image k, every image the same number of tokens
        n = pixels.shape[0]
        if pixels.dim() != 4 or n == 0 or tokens % n:
            return None
        counts = [tokens // n] * n
        rows = {"pixel_values": _starts([1] * n)}
    if set(tensors) - set(rows) or sum(counts) != tokens:
        return None  # inputs beside the images' (videos, sizes): not known here
    if int(rows["pixel_values"][-1]) != pixels.shape[0]:
        return None
    return counts, rows


def _starts(sizes: list[int]) -> tuple[int, ...]:
    out, n = [0], 0
    for s in sizes:
        n += s
        out.append(n)
    return tuple(out)


# ----------------------------------------------------------------------- Qwen-VL inputs by hand
def _qwen_vision(config: Any) -> Any:
    vision = getattr(config, "vision_config", None)
    if vision is None or getattr(config, "image_token_id", None) is None:
        raise ValueError(
            f"a Qwen-VL config (vision_config, image_token_id) is needed, got model_type "
            f"{getattr(config, 'model_type', None)!r}"
        )
    return vision


def qwen_vl_pixel_values(images: Sequence[torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """A Qwen-VL model's (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) ``pixel_values`` and ``image_grid_thw``
    for ``images``, each ``[C, H, W]`` already resized (H and W multiples of ``patch_size *
    spatial_merge_size``) and normalized, as its image processor lays them out: image after image,
    each patch one row of ``C x temporal_patch_size x P x P`` values (a still image repeated
    ``temporal_patch_size`` times), the rows in merge order (each ``merge x merge`` block of
    patches together, blocks row by row). ``config``: the model's."""
    vision = _qwen_vision(config)
    p, t, m = int(vision.patch_size), int(vision.temporal_patch_size), int(vision.spatial_merge_size)
    rows, grids = [], []
    for k, img in enumerate(images):
        if img.dim() != 3 or img.shape[1] % (p * m) or img.shape[2] % (p * m):
            raise ValueError(
                f"image {k}: [C, H, W] with H and W multiples of patch_size * spatial_merge_size = "
                f"{p} * {m} = {p * m} expected, got shape {tuple(img.shape)}"
            )
        c, h, w = img.shape
        gh, gw = h // p, w // p
        x = img.reshape(c, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)  # gh/m gw/m m m C P P
        x = x.unsqueeze(5).expand(-1, -1, -1, -1, -1, t, -1, -1)  # the frame repeated in time
        rows.append(x.reshape(gh * gw, c * t * p * p))
        grids.append([1, gh, gw])
    if not rows:
        raise ValueError("qwen_vl_pixel_values needs at least one image, got none")
    return {"pixel_values": torch.cat(rows), "image_grid_thw": torch.tensor(grids, dtype=torch.long)}


def qwen_vl_image_ids(grid_thw: Sequence[int] | torch.Tensor, config: Any) -> list[int]:
    """One image's prompt ids for a Qwen-VL model, from its ``image_grid_thw`` row ``(t, h, w)``:
    ``vision_start_token_id``, then ``t * h * w // spatial_merge_size**2`` times
    ``image_token_id``, then ``vision_end_token_id`` (what its processor puts in place of
    ``<|vision_start|><|image_pad|><|vision_end|>``). ``config``: the model's."""
    vision = _qwen_vision(config)
    m = int(vision.spatial_merge_size)
    t, h, w = (int(v) for v in (grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else grid_thw))
    if min(t, h, w) < 1 or h % m or w % m:
        raise ValueError(
            f"image_grid_thw (t, h, w) = ({t}, {h}, {w}): h and w must be positive multiples of "
            f"spatial_merge_size = {m}"
        )
    ids = (config.vision_start_token_id, config.image_token_id, config.vision_end_token_id)
    start, image, end = (int(i) for i in ids)
    return [start] + [image] * (t * h * w // m**2) + [end]
