"""The backends' shared parts: the forward prologue in ``Backend.forward``, and framework privates
reached only through each backend's ``internals.py``. Pure unit tests (no processes)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardgen.backends.base import Backend
from shardgen.generation.plan import IDLE_PLAN, Access


class _Replica:
    live = True

    def __call__(self, **inputs: Any) -> str:
        return "replica"


class _Stationary:
    def forward(self, shapes: Any, run: Any, towers: int = 0) -> str:
        return f"stationary {shapes}"


class _Recording(Backend):
    """A backend whose per-layer forward says it ran."""

    def _per_layer_forward(self, **inputs: Any) -> str:
        return f"per-layer {sorted(inputs)}"


def _backend() -> _Recording:
    model = torch.nn.Linear(2, 2)
    return _Recording(model, model, torch.device("cpu"))


def test_forward_runs_what_the_plan_says_and_nothing_of_its_own() -> None:
    """The agreed plan's access picks the forward, whatever the backend holds: a live replica
    runs only under ``REPLICA``; the plan and the model's inputs come apart; a plan the tick
    has not agreed runs nothing."""
    b = _backend()
    b.stationary, b.replica = _Stationary(), _Replica()  # both ready: the plan still decides
    st = IDLE_PLAN.agreed(Access.STATIONARY, [(3, 1)])  # the tick's agreed access and shapes
    inputs = {"input_ids": 1}
    assert b.forward(IDLE_PLAN.agreed(Access.PER_LAYER), inputs) == "per-layer ['input_ids']"
    assert b.forward(st, inputs) == "stationary [(3, 1)]"
    assert b.forward(IDLE_PLAN.agreed(Access.REPLICA), inputs) == "replica"
    assert inputs == {"input_ids": 1}  # the caller's inputs untouched
    b.replica.live = False
    assert b.forward(st, inputs) == "stationary [(3, 1)]"
    with pytest.raises(AssertionError, match="has not agreed"):
        b.forward(IDLE_PLAN, inputs)
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


#: Names of FSDP2's and DeepSpeed's parts that are not public API (attributes, private modules).
_PRIVATE = (
    # FSDP2 (torch.distributed.fsdp._fully_shard)
    "_get_fsdp_state _fsdp_param_groups _comm_ctx all_gather_state _all_gather_comm "
    "post_forward_order _post_forward_indices post_forward_mesh_info _module_info _orig_size _mp_policy "
    "_unsharded_inner_tensors _auto_reshard_after_forward _pre_forward_hook_handle _post_forward_hook_handle "
    "_fully_shard FSDPMeshInfo DefaultAllGather "
    # DeepSpeed ZeRO-3
    "_zero_init_param _convert_to_deepspeed_param _set_dtype _prefetch_bucket_sz "
    "_max_reuse_distance_in_numel "
    "_invalidate_trace _register_deepspeed_module _remove_module_hooks partition_parameters "
    "partitioned_param_coordinator ZeroParamStatus param_coordinator get_allgather_dtype "
    "ds_active_sub_modules use_all_reduce_for_fetch_params"
).split()


def _code_names(text: str) -> set[str]:
    """The identifiers of a module's code, and string literals that are one identifier (a
    ``getattr`` name); not its comments or docstrings."""
    import io
    import tokenize

    names: set[str] = set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.NAME:
            names.add(tok.string)
        elif tok.type == tokenize.STRING and tok.string.strip("'\"").isidentifier():
            names.add(tok.string.strip("'\""))
    return names


def test_framework_privates_are_touched_in_internals_py_only() -> None:
    """docs/DEEPSPEED.md: every private DeepSpeed detail lives in ``deepspeed/internals.py``; the
    same for FSDP2 in ``fsdp2/internals.py``. Nowhere else in the package names one."""
    private = set(_PRIVATE)
    found = {
        path: sorted(_code_names(text) & private)
        for path, text in _sources("").items()
        if not path.endswith("/internals.py") and _code_names(text) & private
    }
    assert found == {}
    # the names are really the ones the internals use (a rename there must be seen here too)
    used = _code_names(_sources("backends")["backends/fsdp2/internals.py"])
    used |= _code_names(_sources("backends")["backends/deepspeed/internals.py"])
    assert private - used == set()
