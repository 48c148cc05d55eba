"""The engine soaks, run on every rank of a World by tests/helpers/soak.py and tests/multirank/test_soak.py.

``census()`` counts what a rank holds that an engine could leave behind: Python threads,
native threads (``/proc/self/task``: gloo's workers), file descriptors, live process groups,
the c10d store's keys (one store for the world: every rank counts the same keys), ``atexit``
callbacks, and memory: resident (RSS), glibc's bytes in use, and Python's allocated blocks
(``sys.getallocatedblocks``, after a collection: what Python objects kept). A scenario takes a
census before its engines and after them; the soak passes when the counts return to the
baseline, and, while one engine stays open, when Python's blocks stop growing after warm-up
(bounded by the caller, tests/helpers/soak.py).
"""

from __future__ import annotations

import atexit
import gc
import os
import random
import sys
import threading
import time
from typing import Any

import torch.distributed as dist
from soak import COUNTED, rss_mb
from torch.distributed import distributed_c10d as c10d

import shardgen
from shardgen import toy


def _store() -> Any:
    return c10d._get_default_store()


def store_keys() -> list[str]:
    """Every key of the world's store (``list_keys``: TCPStore), sorted; [] where unsupported."""
    try:
        return sorted(_store().list_keys())
    except Exception:  # noqa: BLE001 - a store without list_keys: counts only
        return []


def _fds() -> list[str]:
    """This process's open file descriptors, as two listings in a row agree on them: another
    thread (a driver's, gloo's) may hold one for a moment while the census lists them."""
    last = sorted(os.listdir("/proc/self/fd"))
    for _ in range(20):
        time.sleep(0.01)
        now = sorted(os.listdir("/proc/self/fd"))
        if now == last:
            break
        last = now
    return last


def _fd_kinds(fds: list[str]) -> dict[str, int]:
    """File descriptors by kind (socket, pipe, anon_inode:..., or a file's folder)."""
    kinds: dict[str, int] = {}
    for fd in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        kind = target.split(":[")[0] if ":[" in target else os.path.dirname(target)
        kinds[kind] = kinds.get(kind, 0) + 1
    return dict(sorted(kinds.items()))


def malloc_in_use_mb() -> float | None:
    """glibc's bytes in use (``mallinfo2().uordblks``) in MB: native memory still allocated, which
    RSS mixes with freed pages the allocator keeps (fragmentation); None off glibc."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        names = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
        _fields_ = [(name, ctypes.c_size_t) for name in names.split()]

    try:
        fn = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = MallInfo2
    m = fn()
    return round((m.uordblks + m.hblkhd) / 2**20, 2)


def census() -> dict[str, Any]:
    """This rank's counts, after a full garbage collection (an engine's groups sit in reference
    cycles: their sockets and gloo threads go when the collector frees them, not at ``close()``)."""
    gc.collect()
    fds = _fds()
    return {
        "threads": len(threading.enumerate()),
        "native_threads": len(os.listdir("/proc/self/task")),
        "fds": len(fds),
        "groups": len(c10d._world.pg_map),
        "store_keys": int(_store().num_keys()),
        "atexit": atexit._ncallbacks(),
        "rss_mb": round(rss_mb(), 1),
        "malloc_mb": malloc_in_use_mb(),
        "py_blocks": sys.getallocatedblocks(),  # Python's memory blocks in use: objects kept
        "thread_names": sorted(t.name for t in threading.enumerate()),
        "fd_kinds": _fd_kinds(fds),
    }


def _settle() -> None:
    """Every rank here, with its closed engines collected: the keys of every engine deleted (the
    last rank to close deletes them)."""
    gc.collect()
    if dist.get_world_size() > 1:
        dist.barrier()


def back_to(base: dict[str, Any], timeout: float = 5.0) -> dict[str, Any]:
    """The census once every count is back to ``base``'s, or the last one after ``timeout`` s.

    Rank 0 hosts the store: the server's end of a peer's closed connection (a liveness thread's
    own store client, freed with its engine) goes a moment after the peer's collection."""
    deadline = time.monotonic() + timeout
    while True:
        now = census()
        if all(now[k] == base[k] for k in COUNTED) or time.monotonic() > deadline:
            return now
        time.sleep(0.1)


def _prompts(rng: random.Random, n: int) -> list[str]:
    """Mostly short answers (1-4 numbers: a few ticks), one in ten up to 12 numbers."""
    return [toy.format_prompt(*toy.sample_task(rng, rng.randint(1, 4 if rng.random() < 0.9 else 12)))
            for _ in range(n)]  # fmt: skip


def _call(eng: Any, rng: random.Random, most: int = 8) -> int:
    """One ``generate()`` of a random size (1-``most`` prompts, greedy or sampled); greedy answers
    are checked."""
    prompts = _prompts(rng, rng.randint(1, most))
    if rng.random() < 0.3:
        outs = eng.generate(prompts, max_new_tokens=rng.randint(1, 8), do_sample=True, temperature=0.8,
                            seed=rng.randrange(1 << 30))  # fmt: skip
        return len(outs)
    outs = eng.generate(prompts, max_new_tokens=16)
    for p, c in zip(prompts, outs, strict=True):
        assert toy.check_answer(p, c.text), (p, c.text)
    return len(outs)


def _open(**kw: Any) -> Any:
    return shardgen.Engine.from_pretrained(toy.toy_model_path(), stall_timeout=30, **kw)


def warm_up() -> None:
    """One engine opened, used and closed: the process-wide state that stays by design (the stack
    dump file, torch's lazy initialisations) exists before any baseline is taken."""
    eng = _open()
    _call(eng, random.Random(0))
    with eng.paused():
        pass
    eng.close()
    del eng
    _settle()


def engine_calls(
    calls: int, seed: int = 0, every: int | None = None, pause_every: int | None = None
) -> dict[str, Any]:
    """One engine kept open across ``calls`` ``generate()`` calls of random sizes (a ``paused()``
    block every ``pause_every`` calls, default every 1,000 or fifth of them, at the same call on every
    rank: it is collective).

    Returns the census before the engine, every ``every`` calls while it is open (RSS over calls)
    and after ``close()``, and the store keys left (names) if the count moved."""
    pause_every = pause_every or min(1000, max(1, calls // 5))
    every = every or max(1, calls // 20)
    warm_up()
    base, base_keys = census(), store_keys()
    _settle()  # every rank counted before any opens the next engine
    rng = random.Random(seed * 1000 + dist.get_rank())
    eng = _open()
    series: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    requests = 0
    for i in range(1, calls + 1):
        requests += _call(eng, rng)
        if i % every == 0 or i == calls:  # before a pause: right after one, ~300 fewer blocks for a few calls
            series.append({"calls": i, **census()})
        if i % pause_every == 0:
            with eng.paused():
                pass
    took = time.perf_counter() - t0
    eng.close()
    del eng
    _settle()
    after = back_to(base)
    return {
        "rank": dist.get_rank(),
        "calls": calls,
        "requests": requests,
        "seconds": round(took, 1),
        "before": base,
        "open": series,
        "after": after,
        "keys_left": sorted(set(store_keys()) - set(base_keys)),
    }


def engine_cycles(engines: int, seed: int = 0, every: int = 10) -> dict[str, Any]:
    """``engines`` engines opened, used for one random ``generate()`` and closed, one after the
    other, in this process. Returns the census before them, after every ``every`` engines and
    after the last, and the store keys left (names) if the count moved."""
    warm_up()
    base, base_keys = census(), store_keys()
    _settle()  # every rank counted before any opens the next engine
    rng = random.Random(seed * 1000 + dist.get_rank())
    series: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for i in range(1, engines + 1):
        with _open() as eng:  # every other engine closed twice: close(), then the block's exit
            _call(eng, rng, most=4)
            if i % 2:
                eng.close()
        del eng
        if i % every == 0 or i == engines:
            _settle()
            series.append({"engines": i, **(back_to(base, 1.0) if i < engines else back_to(base))})
            _settle()  # every rank counted before any opens the next engine (its keys, a census's +2)
    return {
        "rank": dist.get_rank(),
        "engines": engines,
        "seconds": round(time.perf_counter() - t0, 1),
        "before": base,
        "series": series,
        "after": series[-1],
        "keys_left": sorted(set(store_keys()) - set(base_keys)),
    }
