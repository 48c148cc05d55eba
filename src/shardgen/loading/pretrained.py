"""Load a checkpoint straight into shards: no rank ever holds the full model.

``Engine.from_pretrained(path, backend=...)`` builds a *skeleton* (:func:`skeleton`): the
model from its config with every parameter on the ``meta`` device (no memory) and every
buffer real, computed by the modules' own ``__init__`` on the CPU (rotary ``inv_freq``
and other non-persistent buffers are right by construction, nothing to recompute). Tied
weights are tied by transformers' ``post_init`` on the skeleton, so they are one
parameter from then on and are loaded once. The skeleton carries a :class:`Source`
(checkpoint folder, dtype). The engine constructor creates its private groups, then calls
:func:`materialize` (before ``make_backend``), which shards on shardgen's parameter group
and reads each rank's part from the safetensors files:

* ``fsdp2`` (:func:`load_fsdp2`): ``fully_shard`` in the fsdp2 backend's units (each decoder
  layer, the embeddings, the head, the root: ``shard_model``), on the still-empty skeleton; the meta shards
  are then allocated on the device (each rank: its padded dim-0 shard, i.e. model / N) and
  each rank reads rows ``[r * ceil(d0 / N), ...)`` of every parameter (FSDP2 splits dim 0
  with ``torch.chunk`` semantics, padding the last shards) straight from the file.
* ``deepspeed`` (``loading/deepspeed.py``): the model is built under ``zero.Init`` on the
  parameter group, and each rank reads its flat ZeRO partition.

Every read is of this rank's bytes only (``checkpoint.py``), converted to the target dtype
on the way (through 16 MB chunks), so ``dtype="bfloat16"`` never makes an fp32 copy of the
model. Peak per rank: the shard, plus one parameter's shard in flight (FSDP2 allocates a
shard unpadded, then pads it); measured in docs/PERFORMANCE.md.

What torch and transformers provide, and why this module does not use it:

* ``torch.distributed.checkpoint.state_dict.set_model_state_dict`` takes either full
  tensors (``full_state_dict=True``: every rank, or rank 0 with ``broadcast_from_rank0``,
  holds the whole model: the very copy this module exists to avoid) or DTensors already
  sharded like the model (which means building exactly the shard reads done here, then
  copying them once more).
* transformers 5's ``from_pretrained(..., device_mesh=..., tp_plan=...)`` loads each rank's
  slice, but for *tensor* parallelism: parameters sharded along the plan's dims (column /
  row), computed with collectives inside the forward, not FSDP2's dim-0 shards gathered
  per layer. The engine's lockstep guarantee is built on the latter. Its FSDP mode
  (``is_fsdp_enabled``: rank 0 loads everything, the others get zeros and a broadcast)
  still puts the full model on rank 0.

So the reads are done here, in ~100 lines, with no collective at all: ranks only share
the file system. Keys are matched by the model's parameter names (a tied parameter by any
of its names); a checkpoint whose keys need transformers' conversion mappings is refused
with the missing names.

Collectives: :func:`skeleton` and :func:`load_fsdp2` issue none (``fully_shard`` records
the mesh; the first gather happens in the first forward). The DeepSpeed path issues none
either (see ``loading/deepspeed.py``). ``materialize`` is called by every rank from the
(collective) engine constructor, after the groups exist and before the backend is built.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardgen.loading.auto import auto_class
from shardgen.loading.checkpoint import Checkpoint, checkpoint_names, is_safetensors_checkpoint
from shardgen.loading.paths import missing_model_path
from shardgen.log import get_logger

log = get_logger()

DTYPES = ("auto", "float32", "bfloat16", "float16", "float64")


@dataclass(frozen=True)
class Source:
    """Where a skeleton's weights are: the checkpoint folder and the dtype to load them in."""

    path: str
    dtype: torch.dtype
    #: Parameters the model computes itself, which transformers never saves: ``computed``.
    computed: dict[str, torch.Tensor] = field(default_factory=dict)


def resolve_dtype(dtype: torch.dtype | str | None, config: Any) -> torch.dtype:
    """``"auto"`` / None: the checkpoint's (``config.dtype``, legacy ``torch_dtype``), else float32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in (None, "auto"):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        return getattr(torch, dtype)
    saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(saved, str):
        saved = getattr(torch, saved, None)
    return saved if isinstance(saved, torch.dtype) else torch.float32


class _ParamsOnMeta:
    """Create every ``nn.Parameter`` on the meta device; buffers stay where their module puts them."""

    def __enter__(self) -> None:
        self._orig = nn.Module.register_parameter

        def register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
            if param is not None and not param.is_meta:
                param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            self._orig(module, name, param)

        nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]

    def __exit__(self, *exc: Any) -> None:
        nn.Module.register_parameter = self._orig  # type: ignore[method-assign]


def skeleton(path: str, dtype: torch.dtype | str | None = None) -> nn.Module:
    """The model of ``path`` with parameters on ``meta`` and real buffers, tagged with its :class:`Source`.

    Costs no parameter memory: ``nn.Linear`` & co allocate an uninitialised tensor that
    is moved to ``meta`` before anything writes to it (weight init is off). Not collective.
    """
    from transformers import AutoConfig
    from transformers.initialization import no_init_weights

    config = AutoConfig.from_pretrained(path)
    target = resolve_dtype(dtype, config)
    with no_init_weights(), _ParamsOnMeta():
        model = auto_class(config).from_config(config, dtype=target)
    model.tie_weights()  # part of init_weights in transformers 5, which no_init_weights skips
    model.eval()
    _load_generation_config(model, path)
    model.shardgen_source = Source(path, target, computed(model))
    return model


def computed(model: nn.Module) -> dict[str, torch.Tensor]:
    """``name -> value`` of the parameters transformers never saves (``_keys_to_ignore_on_save``:
    Marian's sinusoidal positions) but makes at load by the model's own ``_init_weights``: each
    owning module copied to real CPU tensors and initialised there, as ``from_pretrained`` does.
    Small (positional tables); the loaders read them as checkpoint entries. Not collective."""
    patterns = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_save", None) or []]
    init = getattr(model, "_init_weights", None)
    out: dict[str, torch.Tensor] = {}
    if not patterns or not callable(init):
        return out
    modules = dict(model.named_modules())
    for name, _ in model.named_parameters():
        if not any(p.search(name) for p in patterns):
            continue
        owner, _, attr = name.rpartition(".")
        module = copy.deepcopy(modules[owner]).to_empty(device="cpu")
        with torch.no_grad():
            init(module)
        out[name] = getattr(module, attr).detach()
    return out


def _load_generation_config(model: nn.Module, path: str) -> None:
    if os.path.isfile(os.path.join(path, "generation_config.json")):
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(path)


def source_of(model: Any) -> Source | None:
    """The :class:`Source` of a skeleton built by :func:`skeleton`, else None."""
    return getattr(model, "shardgen_source", None)


def materialize(
    backend: str, model: nn.Module, *, param_group: Any, device: torch.device, options: dict
) -> Any:
    """Shard the skeleton ``model`` on ``param_group`` and load each rank's part; return the model.

    Called by every rank of ``param_group`` in the engine constructor, before the backend
    is built. Issues no collective itself (see the module docstring); the returned model
    is what the backend then adopts: an FSDP2-sharded model on ``param_group``, or a
    ZeRO-3 partitioned one whose parameters' ``ds_process_group`` is ``param_group``.
    """
    src = source_of(model)
    assert src is not None, "materialize() takes a skeleton()"
    t0 = time.perf_counter()
    if backend == "fsdp2":
        out = load_fsdp2(model, src, param_group=param_group, device=device)
    elif backend == "deepspeed":
        from shardgen.loading.deepspeed import load_deepspeed

        out = load_deepspeed(
            model, src, param_group=param_group, device=device, ds_config=options.get("ds_config")
        )
    elif backend == "local":
        out = load_full(model, src, device=device)
    else:
        raise ValueError(f"cannot load into backend {backend!r}")
    if device.type == "cpu":
        from shardgen.backends.buffer_pool import trim_heap

        trim_heap()  # the checkpoint reads and dtype conversions are freed: back to the OS
    how = "unsharded (backend local)" if backend == "local" else f"as {backend} shards"
    log.info("loaded %s %s in %.2fs", src.path, how, time.perf_counter() - t0)
    return out


# ---------------------------------------------------------------------------- FSDP2
def load_fsdp2(model: nn.Module, src: Source, *, param_group: Any, device: torch.device) -> nn.Module:
    """``fully_shard`` the skeleton on ``param_group``, allocate the shards, read them. No collective.

    Every rank of ``param_group`` calls it (from the engine constructor), same model.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    from shardgen.backends.fsdp2 import shard_model

    shard_model(model, DeviceMesh.from_group(param_group, device.type))
    # Allocate only what is still on meta (the shards); real buffers just move to the device.
    model._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t.to(device))
    rank, world = dist.get_rank(param_group), dist.get_world_size(param_group)
    with Checkpoint(src.path, src.computed) as ckpt, torch.no_grad():
        for key, tensor in checkpoint_names(model, ckpt).values():
            if isinstance(tensor, DTensor):
                assert tensor.placements == (Shard(0),), tensor.placements
                local = tensor.to_local()
                rows = -(-tensor.shape[0] // world)  # torch.chunk: ceil(d0 / N) rows per rank
                assert local.shape[0] == max(0, min(rows, tensor.shape[0] - rank * rows)), (key, local.shape)
                ckpt.check_shape(key, tensor.shape)
                ckpt.read_rows(key, rank * rows, local)
            else:  # a persistent buffer: replicated, small
                ckpt.check_shape(key, tensor.shape)
                ckpt.read_flat(key, 0, tensor)
    return model


# ---------------------------------------------------------------------------- local
def load_full(model: nn.Module, src: Source, *, device: torch.device) -> nn.Module:
    """Allocate every parameter and read it whole (the ``local`` backend: one replica per rank)."""
    model._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t.to(device))
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # _apply gave each module its own new tensor: tie lm_head to the embedding again
    with Checkpoint(src.path, src.computed) as ckpt, torch.no_grad():
        for key, tensor in checkpoint_names(model, ckpt).values():
            ckpt.check_shape(key, tensor.shape)
            ckpt.read_flat(key, 0, tensor)
    return model


def pretrained(path: str, *, dtype: torch.dtype | str | None, tokenizer: Any = None) -> tuple[Any, Any]:
    """``(model, tokenizer)`` for ``Engine.from_pretrained``: a skeleton the engine loads sharded.

    A checkpoint without safetensors files is loaded whole on every rank (transformers'
    ``from_pretrained``), with a warning. Not collective.
    """
    from transformers import AutoTokenizer

    missing = missing_model_path(path)
    if missing is not None:
        raise FileNotFoundError(missing)
    path = os.path.expanduser(path)  # ~/models/x, as a shell would (transformers would not)
    if is_safetensors_checkpoint(path):
        model = skeleton(path, dtype)
    else:
        from transformers import AutoConfig

        log.warning("%s has no safetensors files: every rank loads the full model before sharding", path)
        config = AutoConfig.from_pretrained(path)
        target = resolve_dtype(dtype, config)
        with _progress_bar_on_rank0():
            model = auto_class(config).from_pretrained(path, dtype=target).eval()
    # A folder without tokenizer files has no tokenizer: skip the failing lookup (seconds).
    has_files = not os.path.isdir(path) or any(
        os.path.exists(os.path.join(path, f)) for f in _TOKENIZER_FILES
    )
    if tokenizer is None and has_files:
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError):
            tokenizer = None
    return model, tokenizer


def processor_of(path: str) -> Any:
    """The checkpoint's processor (``AutoProcessor``: a VLM's image processor with its tokenizer),
    or None when ``path`` has no processor files, or transformers cannot build the one it names
    (a missing optional package, such as torchvision for a video processor: logged). Not collective."""
    path = os.path.expanduser(path)
    if not os.path.isdir(path) or not any(os.path.exists(os.path.join(path, f)) for f in _PROCESSOR_FILES):
        return None
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(path)
    except (OSError, ValueError, ImportError, AttributeError) as e:
        log.warning("%s names a processor that could not be loaded (%s: %s); engine.processor is None",
                    path, type(e).__name__, e)  # fmt: skip
        return None


_PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")


@contextlib.contextmanager
def _progress_bar_on_rank0() -> Iterator[None]:
    """transformers' progress bars ("Loading weights") inside the block on rank 0 only."""
    from transformers.utils import logging as hf_logging

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    hide = rank != 0 and hf_logging.is_progress_bar_enabled()
    if hide:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if hide:
            hf_logging.enable_progress_bar()


_TOKENIZER_FILES = (
    "tokenizer_config.json",
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "spiece.model",
)
