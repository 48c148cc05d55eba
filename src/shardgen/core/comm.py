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
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from shardgen.errors import RendezvousTimeoutError
from shardgen.log import get_logger
from shardgen.timeouts import Timeouts

log = get_logger()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init(backend: str | None = None, timeout_s: float = 1800.0) -> tuple[int, int]:
    """Initialize the default process group from the torchrun environment; return (rank, world).

    Collective (every rank, once). Uses nccl when CUDA is available, else gloo; with no
    launcher environment it starts a single-rank world. ``LOCAL_RANK`` picks the GPU. On ranks
    other than 0 it turns transformers' progress bars off (``from_pretrained``'s "Loading
    weights" bar would print once per rank; ``transformers.utils.logging.enable_progress_bar()``
    turns them back on).
    """
    if dist.is_initialized():
        _progress_bars_on_rank0(dist.get_rank())
        return dist.get_rank(), dist.get_world_size()
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    _progress_bars_on_rank0(dist.get_rank())
    return dist.get_rank(), dist.get_world_size()


def _progress_bars_on_rank0(rank: int) -> None:
    if rank != 0:
        with contextlib.suppress(ImportError):
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()


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


_ENGINE_SEQ: dict[tuple[int, ...], int] = {}


def engine_prefix(ranks: list[int]) -> str:
    """The store prefix of the next engine over ``ranks`` (global ranks, group order).

    Numbered per rank set: the members of a group construct the same engines over it in
    the same order, while ranks outside construct any number of others, so the prefix
    is unique across the world and the same on every member.
    """
    key = tuple(ranks)
    _ENGINE_SEQ[key] = _ENGINE_SEQ.get(key, 0) + 1
    if len(ranks) == (dist.get_world_size() if dist.is_initialized() else 1) and ranks == sorted(ranks):
        return f"shardgen/engine{_ENGINE_SEQ[key]}"  # the whole world: the historical name
    return f"shardgen/g{'-'.join(map(str, ranks))}/engine{_ENGINE_SEQ[key]}"


def arrive(store: Any, prefix: str, rank: int, ranks: list[int], timeout_s: float) -> None:
    """Wait until every rank of ``ranks`` wrote ``prefix/arrived/<r>``; name the absent ones after
    ``timeout_s``.

    Store-based, so absent ranks cost a clear error instead of a blocked collective. ``rank``
    and ``ranks`` are global ranks. Every rank of ``ranks`` calls it once per engine; no other
    rank waits.
    """
    store.set(f"{prefix}/npg/{rank}", str(_pg_count()))  # read by check_group_names
    store.set(f"{prefix}/arrived/{rank}", str(os.getpid()))
    deadline = time.monotonic() + timeout_s
    pending = [r for r in ranks if r != rank]
    sleep = 0.005
    while pending:
        try:
            pending = [r for r in pending if not store.check([f"{prefix}/arrived/{r}"])]
        except Exception as e:  # noqa: BLE001 - rank 0 gave up first and took the store with it
            raise RendezvousTimeoutError(
                f"rank {rank}: rank(s) {pending} of {ranks} had not constructed the engine when the "
                f"c10d store (rank 0's) went away: {e}"
            ) from None
        if not pending:
            break
        if time.monotonic() > deadline:
            raise RendezvousTimeoutError(
                f"rank {rank}: rank(s) {pending} of {ranks} never constructed the engine "
                f"within init_timeout={timeout_s:g}s"
            )
        time.sleep(sleep)
        sleep = min(sleep * 2, 0.1)


def private_groups(
    control_timeout_s: float, param_timeout_s: float, ranks: list[int] | None = None
) -> tuple[Any, Any]:
    """(control, param): shardgen's own groups over ``ranks`` (global ranks; ``None``: the world).

    The whole world (``ranks`` None): ``new_group`` on the default group, every rank, same
    order. A subgroup: ``new_group(ranks, use_local_synchronization=True)``, called by the
    members of ``ranks`` only, in the same order (torch names the group from the ranks and
    the number of groups this process holds, so members must agree on both; ``arrive`` has
    already checked that every member is here). The control group is gloo (CPU tensors);
    the param group uses the default group's backend, so parameters stay on the model's
    device (nccl on GPUs).
    """
    ctl_t = datetime.timedelta(seconds=control_timeout_s)
    par_t = datetime.timedelta(seconds=param_timeout_s)
    if ranks is None:
        control = dist.new_group(backend="gloo", timeout=ctl_t)
        return control, dist.new_group(backend=dist.get_backend(), timeout=par_t)
    pool = _POOL.get(tuple(ranks))
    if pool:  # every member took the same pair: they closed the same engines over these ranks
        return pool.pop()
    local = dict(ranks=ranks, use_local_synchronization=True)
    control = dist.new_group(backend="gloo", timeout=ctl_t, **local)
    param = dist.new_group(backend=dist.get_backend(), timeout=par_t, **local)
    return control, param


# Subgroup pairs of closed engines, for the next engine over the same ranks. Destroying them
# would lower the count torch hashes into the next subgroup's name, so a later group would
# reuse a dead group's name and find its stale rendezvous keys in the store.
_POOL: dict[tuple[int, ...], list[tuple[Any, Any]]] = {}


def _pg_count() -> int:
    from torch.distributed import distributed_c10d as c10d

    return len(getattr(c10d._world, "pg_names", {}))


def check_group_names(store: Any, prefix: str, rank: int, ranks: list[int]) -> None:
    """Raise ``ValueError`` naming the ranks if members would give the next subgroup different
    names (they created different numbers of process groups before): ``new_group`` would wait
    on a store key no peer writes. Store only, no wait (``arrive`` wrote the counts first);
    the members of ``ranks`` call it after ``arrive``."""
    seen = {r: store.get(f"{prefix}/npg/{r}").decode() for r in ranks}
    if len(set(seen.values())) > 1:
        raise ValueError(
            f"rank {rank}: the ranks of the engine's group {ranks} hold different numbers of process "
            f"groups ({seen}); torch names a subgroup by that number: create process groups in the "
            "same order on every member before constructing the engine"
        )


def check_same_settings(
    settings: dict[str, str], group: Any, rank: int, world: int, ranks: list[int] | None = None
) -> None:
    """Raise ``ValueError`` on every rank if ranks differ in any setting. Collective on ``group``.

    ``ranks`` maps group ranks to the global ranks the message names (default: the same)."""
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, settings, group=group)
    names = ranks if ranks is not None else list(range(world))
    problems = []
    for key in sorted({k for s in everyone for k in s}):
        values: dict[str, list[int]] = {}
        for r, s in enumerate(everyone):
            values.setdefault(str(s.get(key, "<missing>")), []).append(names[r])
        if len(values) > 1:
            problems.append(f"{key}: " + ", ".join(f"rank(s) {rs}={v!r}" for v, rs in values.items()))
    if problems:
        raise ValueError("engine settings differ across ranks: " + "; ".join(problems))


def engine_groups(
    settings: dict[str, str], rank: int, ranks: list[int], timeouts: Timeouts
) -> tuple[str, Any, Any, Any]:
    """(store prefix, store, control group, param group) for a new engine over ``ranks``.

    Collective on ``ranks`` (global ranks; all of them: the world): every rank of ``ranks``
    calls it from the engine constructor, in the same order; no other rank does. Waits for
    them on the store (``arrive``), creates the private groups (``private_groups``: on the
    default group for the world, member-only for a subgroup), then checks ``settings``
    (plus the group size) on the control group.
    """
    whole = len(ranks) == dist.get_world_size()
    prefix = engine_prefix(ranks)
    store = default_store()
    arrive(store, prefix, rank, ranks, timeouts.arrival)
    if not whole:
        check_group_names(store, prefix, rank, ranks)
    # Liveness bounds every wait; the groups' own timeouts are only a backstop.
    control, param = private_groups(timeouts.control_group, timeouts.param_group, None if whole else ranks)
    check_same_settings({**settings, "world_size": str(len(ranks))}, control, rank, len(ranks), ranks)
    return prefix, store, control, param


def group_names(*groups: Any) -> list[str]:
    """torch's names of the live ``groups`` (None skipped); the prefix of their keys in the store."""
    from torch.distributed import distributed_c10d as c10d

    names = getattr(c10d._world, "pg_names", {})
    return [str(names[g]) for g in groups if g is not None and g in names]


def bounded(fn: Callable[..., Any], args: tuple, timeout_s: float, what: str) -> bool:
    """``fn(*args)`` on a daemon thread of its own, waited for at most ``timeout_s``; True when it
    ended. For store calls that are not needed for correctness: a stopped store host blocks them
    whatever the store's timeout (its client waits for an answer that never comes), and a rank
    whose work is done must not wait for it. Not collective."""
    t = threading.Thread(target=fn, args=args, name=f"shardgen-{fn.__name__}", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        log.warning("%s: the store did not answer within %.1fs; left as it is", what, timeout_s)
        return False
    return True


def forget_engine(
    store: Any, prefix: str, ranks: list[int], pauses: int, groups: list[str] | tuple[str, ...] = ()
) -> None:
    """At close, every rank of the engine, once its driver and liveness threads have ended: the
    last rank to get here deletes the engine's store keys, so that engines opened and closed for
    as long as the process lives leave the store as they found it (soak: tests/multirank/test_soak.py).

    The keys: ``arrived``/``npg`` (``arrive``), ``hb``/``ack`` per rank and ``verdict``
    (liveness, verdict.py), ``resume<n>`` and ``resume<n>/who`` of the last pause ``n`` = ``pauses``
    (the driver deletes each earlier one at the next pause), the ``closed`` count itself;
    and, for the world groups ``groups`` (torch's names; destroyed already), the keys their
    rendezvous left under ``<name>/`` (torch never deletes them), where the store can list keys.
    Only the last rank deletes: every other one has stopped reading. Not collective (one
    ``store.add`` per rank); a store that fails here is left as it is."""
    try:
        if int(store.add(f"{prefix}/closed", 1)) != len(ranks):
            return
        keys = [f"{prefix}/{kind}/{r}" for r in ranks for kind in ("arrived", "npg", "hb", "ack")]
        keys += [f"{prefix}/verdict", f"{prefix}/closed"]
        if pauses:  # the last pause's count and who had left it
            keys += [f"{prefix}/resume{pauses}", f"{prefix}/resume{pauses}/who"]
        if groups:
            with contextlib.suppress(Exception):  # a store that cannot list its keys keeps torch's
                starts = tuple(f"{name}/" for name in groups)
                keys += [k for k in store.list_keys() if k.startswith(starts)]
        for key in keys:
            store.delete_key(key)
    except Exception as e:  # noqa: BLE001 - the store's host may already be gone: nothing to clean
        log.debug("engine %s: store keys not deleted: %s", prefix, e)


def destroy_groups(param: Any, control: Any, ranks: list[int] | None = None) -> None:
    """At close, every rank of the engine: destroy its world groups (each once; None skipped);
    a subgroup's pair goes back to the pool (``_POOL``) for the next engine over ``ranks``.
    Not collective."""
    if ranks is not None and dist.is_initialized() and len(ranks) < dist.get_world_size():
        _POOL.setdefault(tuple(ranks), []).append((control, param))
        return
    groups = (param, control)
    for g in {id(g): g for g in groups if g is not None}.values():
        with contextlib.suppress(Exception):
            dist.destroy_process_group(g)
