"""A model's towers: the parts a forward runs only for some inputs (a VLM's vision encoder, an
encoder-decoder's encoder).

A decoder forward runs every decoder layer whatever its input, so its gathers depend on the
module structure only. A tower breaks that: Qwen2-VL's ``visual`` runs only when the forward
has ``pixel_values``. On a sharded model its units are gathered only on the ranks whose batch
has an image, and the others go on to the decoder's gathers: they hang. So every model kind
with towers names them here (a ``Tower`` each: where it lives, which input runs it, a shadow
input and where a shadow run goes in the forward), the tick agrees on the set of towers each
forward runs (``core/protocol.py``: a bit per tower, OR-ed over the ranks in the tick's one
all-reduce), and a rank whose forward runs a tower that its own inputs do not feed runs it on
the shadow input, at the point of the forward where the real inputs would run it
(``shadow_towers``), so the gathers match. Per-layer, ``once`` and stationary gathers apply to
a tower's units as to the decoder's (FSDP2 shards a tower's blocks as units: ``parts.decoder_layers``
finds them in the model's list of blocks never split). In the stationary mode
(``backends/stationary``) a tower's linears and embeddings stay in their shards; their token
counts (a rank's image patches, its encoder's length) are no function of the tick's agreed
shapes, so each of their exchanges first all-gathers every rank's count (``stationary/layout.py``: rule
``"free"``); an encoder-decoder's cross-attention keys and values go with the encoder's agreed
bit (``stationary/runner.py``).

An encoder-decoder (T5, BART) has its encoder as a tower, run by the prompt's ``input_ids``: a
request's first forward runs it once (its output then stays with the request's row), its decode
steps never. So a forward in which one rank starts a request while another only decodes runs
the encoder on both, the second on one shadow token. Whisper's encoder is run by the request's
``input_features`` (its shadow: zero features of the one length it takes).

Nothing here is collective; what runs inside the hook is the forward's own traffic.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardgen.backends.parts import float_dtype


@dataclass(frozen=True)
class Tower:
    """One tower of a model kind.

    ``path``: the tower module (dotted, from the top model); ``keys``: the forward inputs that
    run it (any present and not None); ``before``: the module whose forward follows the tower's
    in the model's own forward (a shadow run goes in its forward pre-hook, so the tower's
    gathers come where a real run's do); ``shadow``: the tower's call on a shadow input (the
    tower module, its device) -> None."""

    name: str
    path: str
    keys: tuple[str, ...]
    before: str
    shadow: Callable[[nn.Module, torch.device], None]


def _qwen2_vl_shadow(visual: nn.Module, device: torch.device) -> None:
    """One image of the smallest grid the merger takes (1 x m x m patches, m the spatial merge)."""
    cfg = visual.config
    m = int(cfg.spatial_merge_size)
    dim = int(cfg.in_channels) * int(cfg.temporal_patch_size) * int(cfg.patch_size) ** 2
    dtype = float_dtype(visual)
    pixels = torch.zeros((m * m, dim), dtype=dtype, device=device)
    visual(pixels, grid_thw=torch.tensor([[1, m, m]], device=device))


def _llava_shadow(model: nn.Module, device: torch.device) -> None:
    """One image of the vision tower's size through ``get_image_features`` (the tower, then the
    projector: the order of a real image's run)."""
    cfg = model.config
    vision = cfg.vision_config
    side = int(vision.image_size)
    dtype = float_dtype(model)
    pixels = torch.zeros((1, int(getattr(vision, "num_channels", 3)), side, side), dtype=dtype, device=device)
    model.get_image_features(
        pixels,
        vision_feature_layer=cfg.vision_feature_layer,
        vision_feature_select_strategy=cfg.vision_feature_select_strategy,
    )


def _llava_next_shadow(model: nn.Module, device: torch.device) -> None:
    """One image of the vision tower's size, as LLaVA-NeXT's processor cuts it (its base view and
    its tiles: ``image_size_to_num_patches``), through ``get_image_features`` (the tower, the
    projector, the packing with the learned newline)."""
    from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

    cfg = model.config
    vision = cfg.vision_config
    side = int(vision.image_size)
    n = int(image_size_to_num_patches((side, side), cfg.image_grid_pinpoints, side))
    dtype = float_dtype(model)
    shape = (1, n, int(getattr(vision, "num_channels", 3)), side, side)
    model.get_image_features(
        torch.zeros(shape, dtype=dtype, device=device),
        torch.tensor([[side, side]], device=device),
        vision_feature_layer=cfg.vision_feature_layer,
        vision_feature_select_strategy=cfg.vision_feature_select_strategy,
    )


def _idefics3_shadow(model: nn.Module, device: torch.device) -> None:
    """One image of ones, of the vision tower's size, through ``get_image_features`` (the tower,
    then the connector): not zeros, which Idefics3 drops as padding (SmolVLM keeps one when none
    is left, Idefics3 runs its tower on none)."""
    vision = model.config.vision_config
    side = int(vision.image_size)
    dtype = float_dtype(model)
    shape = (1, 1, int(getattr(vision, "num_channels", 3)), side, side)
    model.get_image_features(torch.ones(shape, dtype=dtype, device=device))


def _encoder_shadow(encoder: nn.Module, device: torch.device) -> None:
    """The encoder on one token (id 0), unmasked."""
    ids = torch.zeros((1, 1), dtype=torch.long, device=device)
    encoder(input_ids=ids, attention_mask=torch.ones_like(ids), return_dict=True)


def _features_shadow(encoder: nn.Module, device: torch.device) -> None:
    """Whisper's encoder on zero features of the one length it takes (two convolutions, the
    second of stride 2: twice its positions)."""
    cfg = encoder.config
    dtype = float_dtype(encoder)
    frames = 2 * int(cfg.max_source_positions)
    encoder(torch.zeros((1, int(cfg.num_mel_bins), frames), dtype=dtype, device=device), return_dict=True)


def _encoder(path: str, before: str) -> tuple[Tower, ...]:
    """An encoder-decoder's encoder at ``path``, run by the prompt ids, just before the decoder."""
    return (Tower("encoder", path, ("input_ids", "inputs_embeds"), before, _encoder_shadow),)


#: Encoder-decoder model types whose decoding shardgen supports, -> their towers (the encoder).
ENCODER_DECODERS: dict[str, tuple[Tower, ...]] = {
    "t5": _encoder("encoder", "decoder"),
    "mt5": _encoder("encoder", "decoder"),
    "bart": _encoder("model.encoder", "model.decoder"),
    # BART's kin: the same layout, learned (mBART) or sinusoidal (Marian, Pegasus) positions that
    # take position_ids as BART's do (backends/encdec.decoder_positions).
    "mbart": _encoder("model.encoder", "model.decoder"),
    "marian": _encoder("model.encoder", "model.decoder"),
    "pegasus": _encoder("model.encoder", "model.decoder"),
    # Whisper: the encoder runs on the request's own input_features; the prompt ids are the
    # decoder's prefix (its start and task tokens).
    "whisper": (Tower("encoder", "model.encoder", ("input_features",), "model.decoder", _features_shadow),),
}

#: Encoder-decoders whose encoder takes the request's ``inputs`` (features), the prompt ids being
#: the decoder's prefix: ``score()`` only (their decoding is not built).
FEATURE_ENCODERS: frozenset[str] = frozenset({"whisper"})


def feature_encoder(config: object) -> bool:
    """``config``'s model kind takes its encoder input from ``inputs`` (Whisper). Local."""
    return getattr(config, "model_type", None) in FEATURE_ENCODERS


#: Qwen2-VL's vision tower, run on its grid of patches before the language model.
_QWEN_VL = (Tower("vision", "model.visual", ("pixel_values",), "model.language_model", _qwen2_vl_shadow),)
#: Idefics3's vision model and connector, run by the inner model's get_image_features before its
#: text model.
_IDEFICS3 = (Tower("vision", "model", ("pixel_values",), "model.text_model", _idefics3_shadow),)

#: Model types (``config.model_type``) -> their towers.
TOWERS: dict[str, tuple[Tower, ...]] = {
    "qwen2_vl": _QWEN_VL,
    # Qwen2.5-VL: Qwen2-VL's layout (its vision blocks windowed, an MLP of gate/up/down).
    "qwen2_5_vl": _QWEN_VL,
    # Qwen3-VL: the same, its tower's deepstack features added into the first decoder layers'
    # image positions (local to the rank that has images: no traffic).
    "qwen3_vl": _QWEN_VL,
    # LLaVA: the vision tower and the projector, run by get_image_features of the inner model.
    "llava": (Tower("vision", "model", ("pixel_values",), "model.language_model", _llava_shadow),),
    # LLaVA-NeXT: LLaVA's layout, each image cut in tiles (``image_sizes``), packed with a newline.
    "llava_next": (Tower("vision", "model", ("pixel_values",), "model.language_model", _llava_next_shadow),),
    "idefics3": _IDEFICS3,
    "smolvlm": _IDEFICS3,  # SmolVLM: Idefics3's layout
    **ENCODER_DECODERS,
}


def undeclared_inputs_problem(config: object, inputs: Any) -> str | None:
    """Why a request's own forward ``inputs`` cannot go to a sharded model of ``config``'s kind: a
    kind with no towers named here, whose inputs would run a part of the model (an unnamed vision
    tower) on the ranks that have them only, where the tick cannot agree on it. (A replica, the
    ``local`` backend, runs whatever its inputs run: no peer to part from.) Local."""
    kind = getattr(config, "model_type", None)
    if not isinstance(inputs, dict) or str(kind) in TOWERS:
        return None
    given = sorted(k for k, v in inputs.items() if v is not None)
    if not given:
        return None
    vlms = sorted(k for k in TOWERS if k not in ENCODER_DECODERS)
    return (
        f"inputs {given} for model type {kind!r}, which has no towers shardgen knows: on sharded "
        f"weights a part of the model run on some ranks only would part them (inputs= is taken by "
        f"{', '.join(vlms)}; backend='local' runs any)"
    )


def encoder_decoder_problem(model: nn.Module) -> str | None:
    """Why shardgen cannot decode ``model`` (an encoder-decoder of a kind it has no towers for, or
    with no decoder start token), or None. Local, before any collective."""
    cfg = getattr(model, "config", None)
    if not getattr(cfg, "is_encoder_decoder", False):
        return None
    kind = getattr(cfg, "model_type", None)
    if kind not in ENCODER_DECODERS:
        return (
            f"encoder-decoder model type {kind!r} is not supported (supported: "
            f"{', '.join(sorted(ENCODER_DECODERS))})"
        )
    gen = getattr(model, "generation_config", None)
    names = ("decoder_start_token_id", "bos_token_id")
    if not any(isinstance(getattr(c, n, None), int) for c in (gen, cfg) for n in names):
        return f"{kind} model without decoder_start_token_id (or bos_token_id): no first decoder input"
    return None


def towers_of(model: nn.Module) -> tuple[Tower, ...]:
    """The towers of ``model``'s kind (none for a plain decoder). A function of the model's
    config only, so every rank finds the same. Not collective."""
    kind = getattr(getattr(model, "config", None), "model_type", None)
    return TOWERS.get(str(kind), ())


def tower_mask(towers: tuple[Tower, ...], inputs: dict[str, Any] | None) -> int:
    """The towers (bit i: ``towers[i]``) that ``inputs`` run: those with an input present."""
    if not inputs:
        return 0
    return sum(1 << i for i, t in enumerate(towers) if any(inputs.get(k) is not None for k in t.keys))


def module_at(model: nn.Module, path: str) -> nn.Module:
    """The submodule of ``model`` at the dotted ``path``."""
    m = model
    for part in path.split("."):
        m = getattr(m, part)
    return m


@contextlib.contextmanager
def shadow_towers(
    model: nn.Module, towers: tuple[Tower, ...], run: int, own: int, device: torch.device
) -> Iterator[None]:
    """Within: the next forward of ``model`` runs every tower in ``run`` (the agreed bits) that
    ``own`` (what its inputs run) lacks on its shadow input, once, just before the tower's
    ``before`` module. Local; the forward's own gathers are what make it match its peers'."""
    missing = [t for i, t in enumerate(towers) if run >> i & 1 and not own >> i & 1]
    if not missing:
        yield
        return
    handles = []
    done: set[str] = set()
    for t in missing:
        tower = module_at(model, t.path)

        def hook(_m: nn.Module, _args: Any, t: Tower = t, tower: nn.Module = tower) -> None:
            if t.name not in done:
                done.add(t.name)
                t.shadow(tower, device)

        handles.append(module_at(model, t.before).register_forward_pre_hook(hook))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
