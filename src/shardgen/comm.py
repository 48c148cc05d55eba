"""Process groups: ``shardgen.init()``, shardgen's private groups, arrival and settings checks.

Every function here that issues a collective says so; all of them are called from
the user thread during the (collective) engine constructor, on every rank, in
the same order (``destroy_groups``: at close). The timeouts they wait with come
from ``timeouts.derive``.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import time
from typing import Any

import torch
import torch.distributed as dist

from .errors import RendezvousTimeoutError
from .log import get_logger
from .timeouts import Timeouts

log = get_logger()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init(backend: str | None = None, timeout_s: float = 1800.0) -> tuple[int, int]:
    """Initialize the default process group from the torchrun environment; return (rank, world).

    Collective (every rank, once). Uses nccl when CUDA is available, else gloo; with no
    launcher environment it starts a single-rank world. ``LOCAL_RANK`` picks the GPU.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def rank_and_world(backend: str) -> tuple[int, int]:
    """(rank, world) of the default group; (0, 1) for the local backend without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if backend == "local":
        return 0, 1
    raise ValueError(
        f"backend {backend!r} needs torch.distributed: call shardgen.init() first (or use backend='local')"
    )


def default_device() -> torch.device:
    """cuda:LOCAL_RANK when CUDA is available, else cpu."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def model_device(model: Any) -> torch.device:
    """The model's device if it has real parameters there, else cuda:LOCAL_RANK / cpu."""
    for p in model.parameters():
        if p.device.type not in ("meta", "cpu"):
            return p.device
        break
    return default_device()


def default_store() -> Any:
    """The c10d store of the default group (heartbeats, arrival, errors)."""
    from torch.distributed import distributed_c10d as c10d

    return c10d._get_default_store()


_ENGINE_SEQ = [0]


def next_engine_id() -> int:
    """Engines are numbered per process; collective constructors keep the numbers aligned."""
    _ENGINE_SEQ[0] += 1
    return _ENGINE_SEQ[0]


def arrive(store: Any, prefix: str, rank: int, world: int, timeout_s: float) -> None:
    """Wait until every rank wrote ``prefix/arrived/<r>``; name the absent ranks after ``timeout_s``.

    Store-based, so absent ranks cost a clear error instead of a blocked collective.
    Every rank calls it once per engine.
    """
    store.set(f"{prefix}/arrived/{rank}", str(os.getpid()))
    deadline = time.monotonic() + timeout_s
    pending = [r for r in range(world) if r != rank]
    sleep = 0.005
    while pending:
        try:
            pending = [r for r in pending if not store.check([f"{prefix}/arrived/{r}"])]
        except Exception as e:  # noqa: BLE001 - rank 0 gave up first and took the store with it
            raise RendezvousTimeoutError(
                f"rank {rank}: rank(s) {pending} of {world} had not constructed the engine when the "
                f"c10d store (rank 0's) went away: {e}"
            ) from None
        if not pending:
            break
        if time.monotonic() > deadline:
            raise RendezvousTimeoutError(
                f"rank {rank}: rank(s) {pending} of {world} never constructed the engine "
                f"within init_timeout={timeout_s:g}s"
            )
        time.sleep(sleep)
        sleep = min(sleep * 2, 0.1)


def private_groups(control_timeout_s: float, param_timeout_s: float) -> tuple[Any, Any]:
    """(control, param): shardgen's own groups over all ranks, in rank order.

    Collective on the default group (``new_group``): every rank, same order. The control
    group is gloo (CPU tensors); the param group uses the default group's backend, so
    parameters stay on the model's device (nccl on GPUs).
    """
    control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=control_timeout_s))
    param = dist.new_group(backend=dist.get_backend(), timeout=datetime.timedelta(seconds=param_timeout_s))
    return control, param


def check_same_settings(settings: dict[str, str], group: Any, rank: int, world: int) -> None:
    """Raise ``ValueError`` on every rank if ranks differ in any setting. Collective on ``group``."""
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, settings, group=group)
    problems = []
    for key in sorted({k for s in everyone for k in s}):
        values: dict[str, list[int]] = {}
        for r, s in enumerate(everyone):
            values.setdefault(str(s.get(key, "<missing>")), []).append(r)
        if len(values) > 1:
            problems.append(f"{key}: " + ", ".join(f"rank(s) {rs}={v!r}" for v, rs in values.items()))
    if problems:
        raise ValueError("engine settings differ across ranks: " + "; ".join(problems))


def engine_groups(
    settings: dict[str, str], rank: int, world: int, timeouts: Timeouts
) -> tuple[int, Any, Any, Any]:
    """(engine id, store, control group, param group) for a new engine. Collective.

    Every rank calls it from the engine constructor, in the same order: waits for every
    rank on the store (``arrive``), creates the private groups on the default group, then
    checks ``settings`` (plus the world size) on the control group.
    """
    engine_id = next_engine_id()
    store = default_store()
    arrive(store, f"shardgen/engine{engine_id}", rank, world, timeouts.arrival)
    # Liveness bounds every wait; the groups' own timeouts are only a backstop.
    control, param = private_groups(timeouts.control_group, timeouts.param_group)
    check_same_settings({**settings, "world_size": str(world)}, control, rank, world)
    return engine_id, store, control, param


def destroy_groups(*groups: Any) -> None:
    """Destroy the engine's groups (each once; None skipped). Every rank, at close."""
    for g in {id(g): g for g in groups if g is not None}.values():
        with contextlib.suppress(Exception):
            dist.destroy_process_group(g)
