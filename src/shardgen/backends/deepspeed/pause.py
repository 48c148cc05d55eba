"""DeepSpeed ZeRO-3: swap between the user's setup (training) and shardgen's (generation).

To generate in lockstep, shardgen changes a user-partitioned model (``adopt.py``):
parameters gather on its private group, the coordinator is replaced by one without prefetch or
reuse, and nothing persists. Inside ``Engine.paused()`` a training step must run exactly as
without shardgen (same groups, prefetch, persistence: same speed, same numerics), so the
driver swaps the whole setup around the pause: ``switch(offload, module, setup)`` releases
every gathered parameter with the coordinator in place, records the current setup and applies
``setup``. Local only: no collective (the releases free memory; nothing is in flight at a pause).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from shardgen.backends.deepspeed import internals as ds


@dataclass
class ZeroSetup:
    """What a ZeRO-3 model's gathers depend on, at one moment."""

    groups: list[tuple[Any, Any]]  # (parameter, its ds_process_group)
    init_groups: list[tuple[Any, Any]]  # (zero.Init object, its ds_process_group)
    persist: list[tuple[Any, bool]]  # (parameter, ds_persist)
    coordinator: Any  # the PartitionedParameterCoordinator the hooks use
    offload_attrs: dict[str, Any]  # the DeepSpeedZeRoOffload attributes shardgen changes (internals)


def capture(offload: Any, params: list[torch.nn.Parameter], inits: list[Any]) -> ZeroSetup:
    """The current setup of ``offload`` (a DeepSpeedZeRoOffload) and its parameters."""
    coordinator, attrs = ds.offload_settings(offload)
    return ZeroSetup(
        groups=[(p, p.ds_process_group) for p in params],
        init_groups=[(i, i.ds_process_group) for i in inits],
        persist=[(p, bool(getattr(p, "ds_persist", False))) for p in params],
        coordinator=coordinator,
        offload_attrs=attrs,
    )


def apply(offload: Any, setup: ZeroSetup) -> None:
    for p, group in setup.groups:
        p.ds_process_group = group
    for init, group in setup.init_groups:
        init.ds_process_group = group
    for p, persist in setup.persist:
        p.ds_persist = persist
    ds.set_offload_settings(offload, setup.coordinator, setup.offload_attrs)


def switch(offload: Any, module: torch.nn.Module, setup: ZeroSetup) -> ZeroSetup:
    """Release everything gathered (persistent parameters included), apply ``setup``; returns the
    setup that was in place. Not collective."""
    offload.get_param_coordinator().release_and_reset_all(module)
    params = [p for p, _ in setup.groups]
    current = capture(offload, params, [i for i, _ in setup.init_groups])
    apply(offload, setup)
    return current


def capture_user(engine: Any, module: torch.nn.Module) -> ZeroSetup | None:
    """The setup of a user-partitioned model before ``adopt`` changes it; None without hooks
    of its own (a ``zero.Init`` model with no engine: shardgen installs the only hooks)."""
    offload = ds.engine_offload(engine) if engine is not None else None
    if offload is None:
        offload = ds.find_offload(module)
    if offload is None:
        return None
    params = list(module.parameters())
    inits = list({id(i): i for i in map(ds.find_init, params) if i is not None}.values())
    return capture(offload, params, inits)
