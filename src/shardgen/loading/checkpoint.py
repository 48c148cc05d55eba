"""Read parts of tensors from safetensors checkpoints: rows, or flat element ranges.

A checkpoint is one ``model.safetensors`` or several files listed by
``model.safetensors.index.json``. The safetensors layout is an 8-byte header
length, a JSON header (``name -> dtype, shape, data_offsets``), then the raw
row-major bytes; so rows ``[a, b)`` of a tensor (and any flat element range) are
one contiguous byte range. :class:`Checkpoint` reads exactly that range with
``readinto`` into the destination, or into one temporary buffer of that size when
the dtype or the device differs.

Why not ``safetensors.safe_open(...).get_slice``: it reads the same bytes, but
through a memory map of the whole file, and every page a rank touches through a
mapping counts in its resident set (``VmHWM``) until the file is closed, next to
the copy the rank keeps: up to twice the shard. Plain reads keep only the copy
(the page cache is shared and not charged to the process).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2")):
    if hasattr(torch, _attr):
        _DTYPES[_name] = getattr(torch, _attr)

CHUNK_BYTES = 16 << 20  # largest temporary when converting dtype or device
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class Entry:
    """Where one tensor lives: file, dtype, shape and absolute byte offset of its data."""

    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


def read_header(path: str) -> dict[str, Entry]:
    """The tensors of one safetensors file (reads only its header)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has dtype {info['dtype']}, which shardgen cannot read")
        out[name] = Entry(path, _DTYPES[info["dtype"]], tuple(info["shape"]), 8 + n + info["data_offsets"][0])
    return out


def is_safetensors_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, SINGLE)) or os.path.isfile(os.path.join(path, INDEX))


class Checkpoint:
    """The tensors of a safetensors checkpoint folder (single file or index-sharded), and
    ``computed``: tensors the model makes itself that transformers never saves (Marian's
    sinusoidal positions, ``_keys_to_ignore_on_save``), read as if they were in the files."""

    def __init__(self, path: str, computed: dict[str, torch.Tensor] | None = None) -> None:
        self.path = path
        self.computed = dict(computed or {})
        index = os.path.join(path, INDEX)
        if os.path.isfile(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        elif os.path.isfile(os.path.join(path, SINGLE)):
            files = [SINGLE]
        else:
            raise ValueError(
                f"{path}: no {SINGLE} or {INDEX}; shardgen loads sharded from safetensors checkpoints only "
                "(re-save with save_pretrained(safe_serialization=True))"
            )
        self.entries: dict[str, Entry] = {}
        for name in files:
            self.entries.update(read_header(os.path.join(path, name)))
        for name, t in self.computed.items():
            self.entries.setdefault(name, Entry("", t.dtype, tuple(t.shape), 0))
        self._files: dict[str, Any] = {}
        self._scratch: torch.Tensor | None = None  # the conversion temporary, kept until close

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def check_shape(self, key: str, shape: Any) -> None:
        """Raise ``ValueError`` unless entry ``key`` has ``shape`` (the model's)."""
        if tuple(self.entries[key].shape) != tuple(shape):
            raise ValueError(
                f"{self.path}: {key} has shape {self.entries[key].shape}, the model wants {tuple(shape)}"
            )

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
        self._scratch = None

    def _temporary(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """``numel`` elements of ``dtype`` in one buffer reused by every conversion until
        :meth:`close` (``CHUNK_BYTES``, or more for a larger single copy): converting a whole
        checkpoint allocates it once instead of once per tensor, whose differently sized
        frees would fragment the heap."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if self._scratch is None or self._scratch.numel() < nbytes:
            self._scratch = None
            self._scratch = torch.empty(max(nbytes, CHUNK_BYTES), dtype=torch.uint8)
        return self._scratch[:nbytes].view(dtype)

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _read(self, entry: Entry, byte_start: int, out: torch.Tensor) -> None:
        """Fill the contiguous CPU tensor ``out`` with bytes from ``entry``'s data at ``byte_start``."""
        f = self._files.get(entry.file)
        if f is None:
            f = self._files[entry.file] = open(entry.file, "rb", buffering=0)
        view = memoryview(out.view(torch.uint8).reshape(-1).numpy())
        f.seek(entry.offset + byte_start)
        done = 0
        while done < len(view):
            n = f.readinto(view[done:])
            if not n:
                raise ValueError(
                    f"{entry.file}: truncated (wanted {len(view)} bytes at {entry.offset + byte_start})"
                )
            done += n

    def read_flat(self, name: str, start: int, dst: torch.Tensor) -> None:
        """Copy elements ``[start, start + dst.numel())`` of the flattened tensor ``name`` into ``dst``.

        Reads only those elements. Same dtype, contiguous CPU ``dst``: straight into it.
        Otherwise (dtype conversion, another device) through a temporary of at most
        ``CHUNK_BYTES``, so converting never holds more than that beside the destination.
        Not collective.
        """
        entry = self.entries[name]
        count = dst.numel()
        if start < 0 or start + count > entry.numel:
            raise ValueError(f"{name}: elements [{start}, {start + count}) outside its {entry.numel}")
        if count == 0:
            return
        if not entry.file:  # computed, in memory (small: a positional table)
            with torch.no_grad():
                dst.copy_(self.computed[name].reshape(-1)[start : start + count].view(dst.shape))
            return
        if dst.is_contiguous() and dst.device.type == "cpu" and dst.dtype == entry.dtype:
            self._read(entry, start * entry.itemsize, dst)
            return
        flat = dst.view(-1) if dst.is_contiguous() else None
        step = max(1, CHUNK_BYTES // entry.itemsize)
        if flat is None:
            step = count  # a non-contiguous destination is copied in one piece
        tmp = self._temporary(min(step, count), entry.dtype)
        with torch.no_grad():
            for lo in range(0, count, step):
                n = min(step, count - lo)
                self._read(entry, (start + lo) * entry.itemsize, tmp[:n])
                if flat is None:
                    dst.copy_(tmp.view(dst.shape))
                else:
                    flat[lo : lo + n].copy_(tmp[:n])

    def read_rows(self, name: str, start: int, dst: torch.Tensor) -> None:
        """Copy rows ``[start, start + len(dst))`` (dim 0) of tensor ``name`` into ``dst``. Not collective."""
        entry = self.entries[name]
        if tuple(dst.shape[1:]) != entry.shape[1:]:
            raise ValueError(
                f"{name}: checkpoint shape {entry.shape}, model row shape {tuple(dst.shape[1:])}"
            )
        row = 1
        for s in entry.shape[1:]:
            row *= s
        self.read_flat(name, start * row, dst)


def _renamed(model: nn.Module, keys: list[str], model_names: list[str]) -> dict[str, str]:
    """``model name -> checkpoint key`` by the key renamings transformers applies when it loads the
    model (a VLM saved in its older layout: Qwen2-VL's ``model.layers`` are its
    ``model.language_model.layers``, LLaVA's ``language_model.model.layers`` its
    ``model.language_model.layers``): transformers' own rules (each sub-model's, scoped to it, then
    the legacy ones) and its own renaming function, with the base-model prefix added or dropped
    as it does (``model_names``: the model's parameter and persistent buffer names). Converters
    (weights fused or split on load) are not renamings: not applied. Not collective."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key
    except ImportError:  # an older transformers
        return _renamed_by_type(model, keys)
    # transformers looks the root's rules up by class name, which a sharding wrapper's subclass
    # (FSDP2's ``FSDPQwen2VLForConditionalGeneration``) does not have: its class's rules as well.
    out = _renamed_by_type(model, keys)
    renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    names = dict.fromkeys(model_names, True)  # transformers asks .get(name) of a state dict
    prefix = getattr(model, "base_model_prefix", None) or None
    for k in keys:
        name, _ = rename_source_key(k, renamings, [], prefix, names)
        if name != k or name in names:
            out[name] = k
    return out


def _renamed_by_type(model: nn.Module, keys: list[str]) -> dict[str, str]:
    """:func:`_renamed` for a transformers without ``get_model_conversion_mapping``: the model
    kind's own renamings, each rule in turn."""
    import re

    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping as mapping
    except ImportError:
        return {}
    # By class name (a sharding wrapper's subclass: its model class's), then model type.
    names = [c.__name__ for c in type(model).__mro__] + [getattr(model.config, "model_type", "")]
    found = next((m for m in map(mapping, names) if m), None)
    rules = [
        (re.compile(src), dst)
        for w in found or []
        if type(w).__name__ == "WeightRenaming"
        for src, dst in zip(w.source_patterns, w.target_patterns, strict=False)
    ]
    out = {}
    for k in keys:
        name = k
        for pat, dst in rules:
            name = pat.sub(dst, name)
        out[name] = k
    return out


def checkpoint_names(model: nn.Module, ckpt: Checkpoint) -> dict[int, tuple[str, Any]]:
    """``id(tensor) -> (checkpoint key, tensor)`` for every parameter and persistent buffer.

    A tensor with several names (tied weights) is listed once, under the first of its
    names the checkpoint has. Raises ``ValueError`` naming parameters the checkpoint lacks.
    """
    prefix = getattr(model, "base_model_prefix", "") or ""
    names: dict[int, list[str]] = {}
    tensors: dict[int, Any] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
        tensors[id(p)] = p
    persistent: dict[int, list[str]] = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for b_name, buf in mod._buffers.items():
            if buf is not None and b_name not in mod._non_persistent_buffers_set:
                persistent.setdefault(id(buf), []).append(f"{mod_name}.{b_name}" if mod_name else b_name)
                tensors[id(buf)] = buf
    out: dict[int, tuple[str, Any]] = {}
    missing = []
    renamed: dict[str, str] | None = None  # the model's own names of the checkpoint's keys, when asked
    for key, candidates in list(names.items()) + list(persistent.items()):
        found = None
        for name in candidates:
            for alt in (name, name.removeprefix(prefix + "."), f"{prefix}.{name}" if prefix else name):
                if alt in ckpt:
                    found = alt
                    break
            if found:
                break
        if found is None:
            if renamed is None:
                every = [n for c in list(names.values()) + list(persistent.values()) for n in c]
                renamed = _renamed(model, list(ckpt.entries), every)
            found = next((renamed[n] for n in candidates if n in renamed), None)
        if found is not None:
            out[key] = (found, tensors[key])
        elif key in names:
            missing.append(candidates[0])
    if missing:
        raise ValueError(
            f"{ckpt.path}: {len(missing)} parameter(s) not in the checkpoint, e.g. {missing[:5]} "
            f"(checkpoint keys look like {sorted(ckpt.entries)[:3]})"
        )
    return out
