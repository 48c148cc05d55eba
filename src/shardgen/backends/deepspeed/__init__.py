"""DeepSpeed ZeRO-3 backend: partitioned parameters, gathered on shardgen's private group.

Two ways in: a plain model, which shardgen partitions (``partition.py``), or a model the
user partitioned, whose traffic shardgen moves to its group (``adopt.py``). Every
version-pinned DeepSpeed detail lives in ``internals.py``; docs/DEEPSPEED.md says what
shardgen changes in a ZeRO-3 model and why (checked against DeepSpeed 0.19.8).

Collective contract (all ranks of ``param_group``, in the same order):

* ``create``: a plain model: ``zero.Init`` broadcasts every weight from the group's first
  rank; a user-partitioned one: no collective.
* ``forward`` / ``shadow_forward``: for each module call, in execution order, one all-gather
  of that module's own parameters (the whole subtree for a ZeRO-3 leaf), on ``param_group``.
  A function of the module call order only (prefetch, reuse and persistence are off), so a
  1x1 dummy forward issues exactly the gathers of any real forward.
* ``gather_all``: one coalesced all-gather of every parameter; forwards then issue nothing
  until ``release_all`` (local, plus one all-reduce when ZeRO sanity checks are on).
* ``close``: no collective.

DeepSpeed is imported lazily, with an install hint, when a backend is created.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ...log import get_logger
from ..base import Backend
from . import internals as ds
from . import pause

log = get_logger()


class DeepSpeedBackend(Backend):
    name = "deepspeed"

    def __init__(self, hf_model, module, device, *, offload, param_group, offload_device: str, created: bool):
        super().__init__(hf_model, module, device)
        self.offload = offload  # DeepSpeedZeRoOffload: the hooks and their coordinator
        self.param_group = param_group
        self.offload_device = offload_device
        self.created = created  # True when shardgen partitioned the model itself
        self.lockstep = True
        self._gathered_ctx = None  # the open GatheredParameters of gather policy ``once``

    @classmethod
    def create(
        cls,
        model: Any,
        *,
        param_group: Any,
        device: torch.device,
        ds_config: dict | None = None,
        **_: Any,
    ) -> DeepSpeedBackend:
        """Partition ``model`` on ``param_group`` (or move a partitioned one there).

        Collective on ``param_group`` for a plain model (every rank, same order); local for a
        model DeepSpeed partitioned already."""
        device = torch.device(device)
        deepspeed = ds.import_deepspeed(device)
        ds.ensure_ds_comm(deepspeed)
        ds.ensure_local_rank(device)
        ds.install_trace_check_switch()
        from deepspeed.runtime.engine import DeepSpeedEngine

        engine = model if isinstance(model, DeepSpeedEngine) else None
        module = engine.module if engine is not None else model
        params = list(module.parameters())
        if not params:
            raise ValueError("the model has no parameters")
        n_zero = sum(hasattr(p, "ds_id") for p in params)
        if engine is not None and engine.zero_optimization_stage() != 3:
            raise ValueError(
                f"the DeepSpeed engine runs ZeRO stage {engine.zero_optimization_stage()}, which does not "
                "partition parameters; use stage 3, or pass the plain model (backend 'deepspeed' shards it)"
            )
        if n_zero == 0:
            from .partition import partition

            offload, odev = partition(module, param_group, device, ds_config)
            created = True
        else:
            if n_zero != len(params):
                n_plain = len(params) - n_zero
                raise ValueError(f"{n_plain} of {len(params)} parameters are not ZeRO-3 parameters")
            if ds_config:
                log.warning("shardgen: ds_config is ignored for a model that DeepSpeed partitioned already")
            from .adopt import adopt

            user_setup = pause.capture_user(engine, module)  # handed back in training pauses
            offload, odev = adopt(engine, module, param_group, device)
            created = False
        backend = cls(
            module,
            module,
            device,
            offload=offload,
            param_group=param_group,
            offload_device=odev,
            created=created,
        )
        if not created:
            backend._user_setup = user_setup
        return backend

    # ------------------------------------------------------------------ forwards
    def forward(self, **inputs: Any) -> Any:
        with ds.lockstep_forward():
            return self.module(**inputs)

    def shadow_forward(self) -> None:
        ids = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        with ds.lockstep_forward():
            self.module(input_ids=ids, use_cache=False)

    # ------------------------------------------------------------------ gather policy once
    def gather_all(self) -> None:
        """Gather every parameter and pin it until ``release_all``. Collective on the param
        group (one coalesced all-gather), every rank in the same tick."""
        import deepspeed

        if self._gathered_ctx is not None:
            return
        params = list(self.module.parameters())
        ctx = deepspeed.zero.GatheredParameters(params, modifier_rank=None)
        with ds.lockstep_forward():
            ctx.__enter__()
        ds.pin(params)
        self._gathered_ctx = ctx
        self.lockstep = False

    def release_all(self) -> None:
        """Back to partitioned weights. Every rank in the same tick (an all-reduce when ZeRO
        sanity checks are on, else local)."""
        if self._gathered_ctx is None:
            return
        ctx, self._gathered_ctx = self._gathered_ctx, None
        ds.unpin(self.module.parameters())
        with ds.lockstep_forward():
            ctx.__exit__(None, None, None)
        self.lockstep = True

    # ------------------------------------------------------------------ introspection
    def units(self) -> list[torch.nn.Module]:
        """Modules whose forward pre-hook gathers: owners of parameters and ZeRO-3 leaves (not
        their children), in module order. Each call of one is one all-gather on the param group."""
        from deepspeed.utils import z3_leaf_module

        out: list[torch.nn.Module] = []
        skip: set[int] = set()
        for m in self.module.modules():
            if id(m) in skip:
                continue
            if z3_leaf_module(m):
                skip.update(id(c) for c in m.modules())
                out.append(m)
            elif any(True for _ in m.parameters(recurse=False)):
                out.append(m)
        return out

    # ------------------------------------------------------------------ training pauses
    _user_setup: pause.ZeroSetup | None = None  # a user-partitioned model's own setup
    _gen_setup: pause.ZeroSetup | None = None  # shardgen's, while a pause holds the user's

    def enter_pause(self) -> None:
        """A model from ``deepspeed.initialize`` gets its own groups, coordinator (prefetch,
        reuse) and persistence back for training (``pause.py``). Not collective."""
        if self._user_setup is not None and self._gen_setup is None:
            self._gen_setup = pause.switch(self.offload, self.module, self._user_setup)

    def exit_pause(self) -> None:
        """Back to the lockstep setup; the user's, as training left it, is kept for the next pause."""
        if self._gen_setup is not None:
            self._user_setup = pause.switch(self.offload, self.module, self._gen_setup)
            self._gen_setup = None

    def full_param_bytes(self) -> int:
        return sum(ds.full_numel(p) * p.element_size() for p in self.module.parameters())

    def describe(self) -> dict[str, str]:
        d = super().describe()
        d["zero_stage"] = "3"
        d["offload_param"] = self.offload_device
        d["param_group_size"] = str(dist.get_world_size(group=self.param_group))
        return d

    def close(self) -> None:
        """Drop the pins and the full copies of ``gather_all``. Local (no sanity all-reduce)."""
        if self._gathered_ctx is not None:
            ctx, self._gathered_ctx = self._gathered_ctx, None
            params = list(self.module.parameters())
            ds.unpin(params)
            ds.drop_gathered_locally(ctx, params)
            self.lockstep = True
