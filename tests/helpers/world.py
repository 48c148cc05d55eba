"""Multi-rank test harness: N persistent gloo ranks in spawned processes.

Every distributed test of the project runs its scenario through a :class:`World`::

    # tests/multirank/test_something.py  (scenario functions live at module level)
    import torch
    import torch.distributed as dist

    from world import rank, world_size

    def scenario_sum(x):
        t = torch.tensor([float(x + rank())])
        dist.all_reduce(t)
        return t.item()

    def test_sum(world2):
        assert world2.run(scenario_sum, 1) == [3.0, 3.0]

Inside a scenario the default process group is initialized (gloo) and ``os.environ``
holds RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT like
torchrun sets them.  Ranks are reused across scenarios, so a scenario must leave no
state behind (threads, global hooks, subgroups it still needs to use, ...).

Failures never hang the test session:

* a rank that raises -> :class:`WorldError` with that rank's full traceback;
* a rank that dies -> :class:`WorldError` with its exit code;
* ranks that do not all return within ``timeout`` -> :class:`WorldHang` with the Python
  stack of every thread of every rank (dumped with ``faulthandler`` on SIGUSR1); the rank
  processes are killed (by pid) and the World is marked broken.

This module must not import torch at module level: spawned ranks import it before they
set OMP_NUM_THREADS.
"""

from __future__ import annotations

import atexit
import faulthandler
import importlib.util
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from multiprocessing import get_context
from multiprocessing.connection import Connection, wait
from typing import Any

from ports import free_port, lost_port_race

__all__ = [
    "World",
    "WorldError",
    "WorldHang",
    "assert_no_thread",
    "rank",
    "run_ranks",
    "world_size",
]

_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
_WATCHDOG_THREAD = "world-parent-watchdog"
_STACK_WAIT = 2.0  # seconds to wait for faulthandler dumps after SIGUSR1
_START_ATTEMPTS = 4  # port races: retry init with a new port this many times

# Ranks are forked from a server process that has imported torch and transformers once (the
# multiprocessing "forkserver"): a fresh interpreter spends ~5 s of CPU importing them, which
# on 2 cores was a large share of the suite. Nothing is initialized at import (no thread pool,
# no process group, no accelerator), and each rank still sets its environment, threads and
# process group itself after the fork. Only modules that read no per-rank environment at import
# are preloaded. DeepSpeed picks its accelerator from DS_ACCELERATOR when imported: it is
# preloaded (about 2 s of CPU a rank) only where every rank takes the CPU accelerator, no CUDA
# here, with DS_ACCELERATOR=cpu set for the server too.
# The server imports tests/helpers/rank_preload.py last: shardgen itself, then gc.freeze().
# SHARDGEN_TEST_START=spawn starts every rank as a fresh interpreter instead.
_PRELOAD = ["torch", "torch.distributed", "transformers", "transformers.models.llama.modeling_llama"]


def _preload() -> list[str]:
    """The modules the fork server imports (see above)."""
    import torch

    if (
        importlib.util.find_spec("deepspeed") is None
        or os.environ.get("DS_ACCELERATOR", "cpu") != "cpu"
        or torch.cuda.is_available()
    ):
        return [*_PRELOAD, "rank_preload"]
    os.environ["DS_ACCELERATOR"] = "cpu"  # the server's (and so every rank's) DeepSpeed
    return [*_PRELOAD, "deepspeed", "rank_preload"]


def start_method() -> str:
    """``forkserver`` (the default) or ``spawn`` (``SHARDGEN_TEST_START=spawn``): how test ranks start."""
    return "spawn" if os.environ.get("SHARDGEN_TEST_START") == "spawn" else "forkserver"


def start_context() -> Any:
    """The multiprocessing context test ranks start from (see above)."""
    method = start_method()
    ctx = get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(_preload())
    return ctx


class WorldError(AssertionError):
    """One or more ranks raised or died.

    ``failures`` maps each failing rank to its remote traceback (or death notice).
    """

    def __init__(self, message: str, failures: dict[int, str] | None = None):
        super().__init__(message)
        self.failures = dict(failures or {})


class WorldHang(AssertionError):
    """Ranks did not return in time; the message holds every rank's Python stack."""

    def __init__(self, message: str, stacks: dict[int, str] | None = None):
        super().__init__(message)
        self.stacks = dict(stacks or {})


class _AddressInUse(Exception):
    pass


# --------------------------------------------------------------------------------------
# scenario helpers (call them inside a rank)
# --------------------------------------------------------------------------------------


def rank() -> int:
    """Rank of the calling process in the default group."""
    import torch.distributed as dist

    return dist.get_rank()


def world_size() -> int:
    """Size of the default group."""
    import torch.distributed as dist

    return dist.get_world_size()


def assert_no_thread(prefix: str, timeout: float = 0.0) -> None:
    """Assert that no live thread's name starts with ``prefix``.

    With ``timeout`` > 0, wait up to that long for such threads to finish first.
    """
    deadline = time.monotonic() + timeout
    while True:
        alive = [t.name for t in threading.enumerate() if t.name.startswith(prefix) and t.is_alive()]
        if not alive:
            return
        if time.monotonic() >= deadline:
            raise AssertionError(f"threads named {prefix!r}* still alive: {alive}")
        time.sleep(0.02)


# --------------------------------------------------------------------------------------
# rank process side
# --------------------------------------------------------------------------------------


def _parent_watchdog(parent_pid: int) -> None:
    # If the test process dies (even by SIGKILL) a rank may be stuck in a collective and
    # would never notice; exit instead of lingering forever. A forked rank's parent is the
    # fork server, which exits with the test process: either going away ends the rank.
    server = os.getppid()
    while True:
        time.sleep(1.0)
        if os.getppid() != server:
            os._exit(70)
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            os._exit(70)
        except PermissionError:
            pass


def _send(conn: Connection, msg: Any) -> None:
    conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


def _rank_main(
    rank_: int,
    nprocs: int,
    port: int,
    env: dict[str, str | None],
    conn: Connection,
    stack_path: str,
    parent_pid: int,
) -> None:
    # 1. environment, before torch is imported
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if os.path.isdir("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.update(
        RANK=str(rank_),
        WORLD_SIZE=str(nprocs),
        LOCAL_RANK=str(rank_),
        LOCAL_WORLD_SIZE=str(nprocs),
        GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    if _TESTS_DIR not in sys.path:
        sys.path.insert(0, _TESTS_DIR)

    # 2. stack dumps on demand (and on fatal signals) into a per-rank file
    stack_file = open(stack_path, "a", buffering=1)  # kept open for the life of the rank
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True, chain=False)
    faulthandler.enable(file=stack_file, all_threads=True)
    threading.Thread(target=_parent_watchdog, args=(parent_pid,), name=_WATCHDOG_THREAD, daemon=True).start()

    # 3. torch + default process group
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        import rounding

        rounding.apply_env()  # SHARDGEN_TEST_SMALL_ROWS: this rank's small-row kernels
        dist.init_process_group("gloo", rank=rank_, world_size=nprocs, init_method=f"tcp://127.0.0.1:{port}")
    except BaseException:
        _send(conn, ("init_error", traceback.format_exc()))
        return
    _send(conn, ("ready", os.getpid()))

    # 4. task loop
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            break
        task_id, task = pickle.loads(data)
        if task is None:
            break
        try:
            fn, args, kwargs = pickle.loads(task)
            result = fn(*args, **kwargs)
            try:
                payload = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:
                raise TypeError(f"the result of the scenario is not picklable: {exc!r}") from exc
            reply = ("ok", task_id, payload)
        except BaseException:
            reply = ("error", task_id, traceback.format_exc())
        _send(conn, reply)

    try:
        dist.destroy_process_group()
    except Exception:
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown (torch atexit hooks); nothing left to flush


def _health_check() -> int:
    """Collective sanity check run after a scenario error: detects desynchronized ranks."""
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    if int(t.item()) != dist.get_world_size():
        raise RuntimeError(f"all_reduce gave {t.item()}, expected {dist.get_world_size()}")
    return int(t.item())


# --------------------------------------------------------------------------------------
# test process side
# --------------------------------------------------------------------------------------


def _fn_name(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


_LIVE_WORLDS: weakref.WeakSet[World] = weakref.WeakSet()


@atexit.register
def _close_live_worlds() -> None:  # runs before multiprocessing joins its children
    for world in list(_LIVE_WORLDS):
        world._kill()


class World:
    """N persistent gloo ranks in spawned processes that run scenario functions.

    Importing torch costs seconds per process, so one World serves many scenarios.
    Not thread-safe: call ``run`` from one thread at a time.
    """

    def __init__(
        self,
        nprocs: int,
        *,
        env: dict[str, str | None] | None = None,
        start_timeout: float = 60.0,
        error_grace: float = 5.0,
    ):
        """Start ``nprocs`` ranks and initialize their default process group.

        ``env``: variables set in each rank before torch is imported (a ``None`` value
        unsets a variable).  ``error_grace``: after a rank fails, how long the other
        ranks get to return before the World is declared broken and killed.
        """
        if nprocs < 1:
            raise ValueError(f"nprocs must be >= 1, got {nprocs}")
        self.nprocs = nprocs
        self.env = dict(env or {})
        self.error_grace = error_grace
        self.port = 0
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self._stack_paths: list[str] = []
        self._tmpdir = tempfile.mkdtemp(prefix="shardgen-world-")
        self._broken = False
        self._closed = False
        self._task_id = 0
        _LIVE_WORLDS.add(self)
        try:
            for attempt in range(_START_ATTEMPTS):
                try:
                    self._start(start_timeout)
                    return
                except _AddressInUse:
                    self._kill()
                    if attempt == _START_ATTEMPTS - 1:
                        raise RuntimeError("could not find a free port for the gloo store") from None
                    self._broken = self._closed = False
                    self._tmpdir = tempfile.mkdtemp(prefix="shardgen-world-")
                    _LIVE_WORLDS.add(self)
        except BaseException:
            self._kill()
            raise

    # -- lifecycle ---------------------------------------------------------------------

    def _start(self, start_timeout: float) -> None:
        ctx = start_context()
        self.port = free_port()
        self._procs, self._conns, self._stack_paths = [], [], []
        for r in range(self.nprocs):
            parent_conn, child_conn = ctx.Pipe(duplex=True)
            stack_path = os.path.join(self._tmpdir, f"rank{r}.stacks")
            open(stack_path, "w").close()
            proc = ctx.Process(
                target=_rank_main,
                args=(r, self.nprocs, self.port, self.env, child_conn, stack_path, os.getpid()),
                name=f"world{self.nprocs}-rank{r}",
                daemon=False,  # ranks may start their own processes (e.g. data loaders)
            )
            proc.start()
            child_conn.close()
            self._procs.append(proc)
            self._conns.append(parent_conn)
            self._stack_paths.append(stack_path)

        deadline = time.monotonic() + start_timeout
        pending = set(range(self.nprocs))
        errors: dict[int, str] = {}
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for r, msg in self._wait_messages(pending, remaining):
                pending.discard(r)
                if msg[0] == "ready":
                    continue
                text = msg[2] if msg[0] == "dead" else msg[1]
                if lost_port_race(text):
                    raise _AddressInUse
                errors[r] = text
            if errors:
                break
        if errors:
            failures = {r: f"rank {r} failed to initialize:\n{t}" for r, t in sorted(errors.items())}
            raise WorldError(
                f"World({self.nprocs}) failed to start:\n" + "\n".join(failures.values()), failures
            )
        if pending:
            stacks = self._dump_stacks(range(self.nprocs))
            self._kill()
            raise WorldHang(
                f"World({self.nprocs}) did not start within {start_timeout:.0f}s "
                f"(ranks not ready: {sorted(pending)}):\n{self._format_stacks(stacks)}",
                stacks,
            )

    def close(self) -> None:
        """Shut the ranks down (politely if healthy), kill leftovers by pid, reap them."""
        if self._closed:
            return
        if not self._broken:
            for conn in self._conns:
                try:
                    _send(conn, (-1, None))
                except OSError:
                    pass
            deadline = time.monotonic() + 5.0
            for proc in self._procs:
                proc.join(max(0.0, deadline - time.monotonic()))
        self._kill()

    def _kill(self) -> None:
        """SIGKILL every rank process that is still alive (by pid) and reap it."""
        for proc in self._procs:
            if proc.pid is not None and proc.exitcode is None:
                try:
                    os.kill(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self._procs:
            if proc.pid is not None:
                proc.join(10.0)
        for conn in self._conns:
            conn.close()
        self._conns = []
        self._broken = True
        self._closed = True
        shutil.rmtree(self._tmpdir, ignore_errors=True)
        _LIVE_WORLDS.discard(self)

    def __enter__(self) -> World:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "broken" if self.broken else "ready"
        return f"World(nprocs={self.nprocs}, port={self.port}, pids={self.pids}, {state})"

    @property
    def broken(self) -> bool:
        """True once the World cannot run scenarios any more (killed, closed or a rank died)."""
        if not self._broken and any(proc.exitcode is not None for proc in self._procs):
            self._broken = True
        return self._broken

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self._procs]

    # -- running scenarios -------------------------------------------------------------

    def run(self, fn: Callable, *args: Any, timeout: float = 60.0, **kwargs: Any) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank at once; return the per-rank results.

        ``fn`` must be importable by qualified name (a module-level function of a tests
        module); args, kwargs and results must be picklable (tensors are fine).  Raises
        :class:`WorldError` if a rank raises or dies, :class:`WorldHang` after ``timeout``
        seconds.  ``timeout`` is taken by ``run``: a scenario cannot get a kwarg of that name.
        """
        return self._run(fn, [(args, kwargs)] * self.nprocs, timeout)

    def run_per_rank(
        self,
        fn: Callable,
        per_rank_args: Sequence[Sequence[Any]],
        per_rank_kwargs: Sequence[dict[str, Any]] | None = None,
        *,
        timeout: float = 60.0,
    ) -> list:
        """Like :meth:`run`, but rank ``r`` calls ``fn(*per_rank_args[r], **per_rank_kwargs[r])``."""
        if per_rank_kwargs is None:
            per_rank_kwargs = [{}] * self.nprocs
        if len(per_rank_args) != self.nprocs or len(per_rank_kwargs) != self.nprocs:
            raise ValueError(f"need exactly {self.nprocs} per-rank args/kwargs")
        return self._run(fn, list(zip(per_rank_args, per_rank_kwargs, strict=True)), timeout)

    def _run(self, fn: Callable, calls: list[tuple[Sequence[Any], dict[str, Any]]], timeout: float) -> list:
        if self.broken:
            raise RuntimeError(f"{self!r} is broken or closed; create a new World")
        name = _fn_name(fn)
        tasks = []
        for args, kwargs in calls:
            try:
                tasks.append(pickle.dumps((fn, tuple(args), dict(kwargs)), protocol=pickle.HIGHEST_PROTOCOL))
            except Exception as exc:
                raise TypeError(
                    f"cannot send {name} to the ranks: {exc!r}. Scenario functions must be module-level "
                    "functions of an importable module, and their arguments picklable."
                ) from exc
        self._task_id += 1
        task_id = self._task_id
        try:
            for conn, task in zip(self._conns, tasks, strict=True):
                _send(conn, (task_id, task))
            results, errors, pending = self._collect(task_id, timeout)
            if pending and not errors:
                self._raise_hang(name, timeout, pending)
            if errors:
                self._raise_error(name, errors, pending)
        except (WorldError, WorldHang):
            raise
        except BaseException:
            # interrupted (KeyboardInterrupt, pytest-timeout, ...): ranks are in an unknown state
            self._kill()
            raise
        return results

    def _raise_hang(self, name: str, timeout: float, pending: set[int]) -> None:
        stacks = self._dump_stacks(range(self.nprocs))
        self._kill()
        raise WorldHang(
            f"{name} did not return within {timeout:g}s on rank(s) {sorted(pending)} "
            f"of World({self.nprocs}); ranks killed. Stacks:\n{self._format_stacks(stacks)}",
            stacks,
        )

    def _raise_error(self, name: str, errors: dict[int, str], pending: set[int]) -> None:
        stacks = self._dump_stacks(sorted(pending)) if pending else {}
        note = ""
        if pending or self.broken:
            self._kill()
            note = " (World killed)"
        elif not self._healthy():
            self._kill()
            note = " (ranks out of sync afterwards: collective health check failed; World killed)"
        lines = [f"{name} failed on rank(s) {sorted(errors)} of World({self.nprocs}){note}:"]
        for r in range(self.nprocs):
            if r in errors:
                lines.append(f"--- rank {r} ---\n{errors[r].rstrip()}")
            elif r in pending:
                lines.append(
                    f"--- rank {r}: did not return within {self.error_grace:g}s after the failure; "
                    f"stack ---\n{stacks.get(r, '').rstrip()}"
                )
            else:
                lines.append(f"--- rank {r}: returned ---")
        raise WorldError("\n".join(lines), errors)

    def _collect(self, task_id: int, timeout: float) -> tuple[list, dict[int, str], set[int]]:
        results: list[Any] = [None] * self.nprocs
        errors: dict[int, str] = {}
        pending = set(range(self.nprocs))
        deadline = time.monotonic() + timeout
        first_error = 0.0
        while pending:
            limit = deadline
            if errors:
                limit = min(deadline, first_error + self.error_grace)
            remaining = limit - time.monotonic()
            if remaining <= 0:
                break
            for r, msg in self._wait_messages(pending, remaining):
                pending.discard(r)
                kind, got_id, payload = msg
                if kind == "dead":
                    errors[r] = payload
                elif got_id != task_id:
                    errors[r] = f"protocol error: got a reply to task {got_id}, expected {task_id}"
                    self._broken = True
                elif kind == "error":
                    errors[r] = payload
                else:
                    try:
                        results[r] = pickle.loads(payload)
                    except Exception:
                        errors[r] = "the result could not be unpickled in the test process:\n" + (
                            traceback.format_exc()
                        )
                if r in errors and len(errors) == 1:
                    first_error = time.monotonic()
        return results, errors, pending

    def _wait_messages(self, ranks: set[int], timeout: float) -> list[tuple[int, tuple]]:
        """Wait up to ``timeout`` for messages from ``ranks``; a dead rank yields a 'dead' message."""
        handles: dict[Any, int] = {}
        for r in ranks:
            handles[self._conns[r]] = r
            handles[self._procs[r].sentinel] = r
        ready = wait(list(handles), timeout)
        out: dict[int, tuple] = {}
        for r in sorted({handles[h] for h in ready}):
            conn = self._conns[r]
            try:
                if conn.poll():
                    out[r] = pickle.loads(conn.recv_bytes())
                    continue
            except (EOFError, OSError):
                pass
            proc = self._procs[r]
            proc.join(2.0)
            self._broken = True
            out[r] = ("dead", None, self._death_notice(r, proc.exitcode))
        return list(out.items())

    def _death_notice(self, r: int, exitcode: int | None) -> str:
        if exitcode is not None and exitcode < 0:
            try:
                how = f"killed by signal {signal.Signals(-exitcode).name}"
            except ValueError:
                how = f"killed by signal {-exitcode}"
        else:
            how = f"exit code {exitcode}"
        text = f"rank {r} process (pid {self._procs[r].pid}) died: {how}"
        log = self._read_stack_file(r, 0).strip()
        if log:
            text += f"\nfaulthandler output of rank {r}:\n{log}"
        return text

    def _healthy(self) -> bool:
        """After a failed scenario in which every rank returned, check the ranks still agree.

        A rank that raised midway may have skipped collectives its peers completed (gloo
        sends can complete without a receiver): the next collective would then hang or
        mix up data.  A short all_reduce detects that.
        """
        try:
            self._task_id += 1
            task = pickle.dumps((_health_check, (), {}))
            for conn in self._conns:
                _send(conn, (self._task_id, task))
            _, errors, pending = self._collect(self._task_id, max(self.error_grace, 1.0))
        except Exception:
            return False
        return not errors and not pending and not self.broken

    # -- stacks ------------------------------------------------------------------------

    def _read_stack_file(self, r: int, offset: int) -> str:
        try:
            with open(self._stack_paths[r], "rb") as f:
                f.seek(offset)
                return f.read().decode("utf-8", errors="replace")
        except (OSError, IndexError):
            return ""

    def _dump_stacks(self, ranks: Sequence[int] | range) -> dict[int, str]:
        """SIGUSR1 every live rank in ``ranks`` and collect the faulthandler dumps."""
        offsets: dict[int, int] = {}
        notes: dict[int, str] = {}
        for r in ranks:
            proc = self._procs[r]
            if proc.exitcode is not None:
                notes[r] = self._death_notice(r, proc.exitcode)
                continue
            try:
                offsets[r] = os.path.getsize(self._stack_paths[r])
                os.kill(proc.pid, signal.SIGUSR1)
            except (OSError, ProcessLookupError) as exc:
                notes[r] = f"could not signal rank {r}: {exc!r}"
                offsets.pop(r, None)
        # wait until every signalled rank wrote something and the files stopped growing
        deadline = time.monotonic() + _STACK_WAIT
        last: dict[int, int] = {}
        while offsets and time.monotonic() < deadline:
            sizes = {r: os.path.getsize(self._stack_paths[r]) for r in offsets}
            if all(sizes[r] > offsets[r] for r in offsets) and sizes == last:
                break
            last = sizes
            time.sleep(0.1)
        stacks = dict(notes)
        for r, offset in offsets.items():
            text = self._read_stack_file(r, offset)
            stacks[r] = text if text.strip() else f"(rank {r}, pid {self._procs[r].pid}: no stack dump)"
        return stacks

    def _format_stacks(self, stacks: dict[int, str]) -> str:
        return "\n".join(
            f"=== rank {r} (pid {self._procs[r].pid}) ===\n{stacks[r].rstrip()}" for r in sorted(stacks)
        )


def run_ranks(
    nprocs: int,
    fn: Callable,
    *args: Any,
    timeout: float = 60.0,
    env: dict[str, str | None] | None = None,
    **kwargs: Any,
) -> list:
    """Run ``fn`` once on a fresh World of ``nprocs`` ranks, then close it."""
    with World(nprocs, env=env) as world:
        return world.run(fn, *args, timeout=timeout, **kwargs)
