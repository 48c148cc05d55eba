"""The backends' shared parts: the forward prologue in ``Backend.forward``, and framework privates
reached only through each backend's ``internals.py``. Pure unit tests (no processes)."""

from __future__ import annotations

from typing import Any

import torch

from shardgen.backends.base import Backend


class _Replica:
    live = True

    def __call__(self, **inputs: Any) -> str:
        return "replica"


class _Stationary:
    def forward(self, shapes: Any, run: Any) -> str:
        return f"stationary {shapes}"


class _Recording(Backend):
    """A backend whose per-layer forward says it ran."""

    def _per_layer_forward(self, **inputs: Any) -> str:
        return f"per-layer {sorted(inputs)}"


def _backend() -> _Recording:
    model = torch.nn.Linear(2, 2)
    return _Recording(model, model, torch.device("cpu"))


def test_forward_runs_the_replica_then_the_stationary_mode_then_the_backends_own() -> None:
    b = _backend()
    assert b.forward(input_ids=1) == "per-layer ['input_ids']"
    b.stationary = _Stationary()
    st = {"mode": "stationary", "shapes": [(3, 1)]}  # the tick's agreed mode and shapes, per call
    assert b.forward(**st, input_ids=1) == "stationary [(3, 1)]"
    b.replica = _Replica()
    assert b.forward(**st, input_ids=1) == "replica"  # a live replica wins over the mode
    b.replica.live = False
    assert b.forward(**st, input_ids=1) == "stationary [(3, 1)]"
    assert b.forward(mode="per-layer", shapes=None, input_ids=1) == "per-layer ['input_ids']"
    assert not hasattr(b, "set_forward") and not hasattr(b, "forward_mode"), "no forward state"


def test_no_backend_repeats_the_prologue() -> None:
    from shardgen.backends.deepspeed import DeepSpeedBackend
    from shardgen.backends.fsdp2 import FSDP2Backend
    from shardgen.backends.local import LocalBackend

    for cls in (FSDP2Backend, DeepSpeedBackend, LocalBackend):
        assert cls.forward is Backend.forward, cls.__name__


def _sources(*under: str) -> dict[str, str]:
    import pathlib

    import shardgen

    root = pathlib.Path(shardgen.__file__).parent  # the sources under test
    return {str(p.relative_to(root)): p.read_text() for d in under for p in sorted((root / d).rglob("*.py"))}


def test_a_models_parts_are_found_in_parts_py_only() -> None:
    """Decoder layers, embeddings and head, MoE blocks: one finder (``backends/parts.py``) for both
    backends, the stationary mode and the loaders."""
    import re

    finders = re.compile(r"get_input_embeddings|get_output_embeddings|_no_split_modules|ModuleList|_MOE_NAME")
    names = "decoder_layers|io_embeddings|vocab_modules|is_moe_block|plain_type|plain_class"
    defs = re.compile(rf"def ({names})\b")
    found = {
        path: sorted(set(finders.findall(text)) | set(defs.findall(text)))
        for path, text in _sources("backends", "loading").items()
        if path != "backends/parts.py" and (finders.search(text) or defs.search(text))
    }
    assert found == {}
