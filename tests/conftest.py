"""Shared pytest setup: import paths, multi-rank World fixtures, gpu skipping."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

TESTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers")  # the helpers, importable
SRC_DIR = os.path.join(os.path.dirname(os.path.dirname(TESTS_DIR)), "src")


def _setup_paths() -> None:
    """Make ``shardgen`` (from src/, if not installed) and the tests modules importable,
    here and in every child process (spawned ranks, subprocess-based tests)."""
    extra = []
    if importlib.util.find_spec("shardgen") is None and os.path.isdir(SRC_DIR):
        extra.append(SRC_DIR)
    extra.append(TESTS_DIR)
    for path in reversed(extra):
        if path not in sys.path:
            sys.path.insert(0, path)
    current = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(extra + [p for p in current if p not in extra])


_setup_paths()

import rounding  # noqa: E402
from world import World  # noqa: E402  (needs the paths above)

if rounding.apply_env():  # the small-row kernels here, and in every process the tests start
    os.environ["PYTHONPATH"] = os.pathsep.join([rounding.SITE_DIR, os.environ["PYTHONPATH"]])


class WorldHandle:
    """Session-wide handle on a World of ``nprocs`` ranks.

    The World starts on first use and is recreated transparently when a previous test left
    it broken (a hang, a dead rank, a rank stuck after an error).
    """

    def __init__(
        self,
        nprocs: int,
        env: dict[str, str | None] | None = None,
        start: Callable[[], Any] | None = None,
        start_timeout: float = 120.0,
    ):
        self.nprocs = nprocs
        self.env = env
        self.start = start  # run on every rank of each World it starts
        self.start_timeout = start_timeout
        self._world: World | None = None

    @property
    def world(self) -> World:
        """The live World, (re)started if needed."""
        if self._world is None or self._world.broken:
            if self._world is not None:
                self._world.close()
            self._world = None
            world = World(self.nprocs, env=self.env, start_timeout=self.start_timeout)
            if self.start is not None:
                try:
                    world.run(self.start, timeout=300)
                except BaseException:
                    world.close()
                    raise
            self._world = world
        return self._world

    def run(self, fn: Callable, *args: Any, timeout: float = 60.0, **kwargs: Any) -> list:
        return self.world.run(fn, *args, timeout=timeout, **kwargs)

    def run_per_rank(
        self,
        fn: Callable,
        per_rank_args: Sequence[Sequence[Any]],
        per_rank_kwargs: Sequence[dict[str, Any]] | None = None,
        *,
        timeout: float = 60.0,
    ) -> list:
        return self.world.run_per_rank(fn, per_rank_args, per_rank_kwargs, timeout=timeout)

    @property
    def pids(self) -> list[int]:
        return self.world.pids

    @property
    def broken(self) -> bool:
        return self._world is not None and self._world.broken

    def close(self) -> None:
        if self._world is not None:
            self._world.close()
            self._world = None

    def __repr__(self) -> str:
        return f"WorldHandle({self.nprocs}, {self._world!r})"


#: The session's Worlds: ready for DeepSpeed too (its CPU accelerator set and its comm layer
#: started on every new World: the first start ever JIT-builds an op, so no test's bound includes
#: it), and shared by every test module of an xdist worker, FSDP2's and DeepSpeed's alike. A
#: World costs each rank its imports (torch, transformers, DeepSpeed: seconds of CPU), which
#: ``make test`` would otherwise pay again for every module. Tests that break a World on purpose
#: (a hang, a killed rank) start their own.
SHARED_ENV: dict[str, str | None] = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


def _world_fixture(nprocs: int) -> Iterator[WorldHandle]:
    # DeepSpeed's comm layer binds torch.distributed's functions when it is imported: the
    # collective recorder (ds_scenarios) goes in first, so that tests counting DeepSpeed's
    # collectives see them in any World.
    from ds_scenarios import warm_up

    handle = WorldHandle(nprocs, env=SHARED_ENV, start=warm_up)
    try:
        yield handle
    finally:
        handle.close()


@pytest.fixture(scope="session")
def world2() -> Iterator[WorldHandle]:
    """2 gloo ranks shared by the whole session (started lazily, restarted if broken)."""
    yield from _world_fixture(2)


@pytest.fixture(scope="session")
def world3() -> Iterator[WorldHandle]:
    """3 gloo ranks shared by the whole session (started lazily, restarted if broken)."""
    yield from _world_fixture(3)


@pytest.fixture(scope="session")
def world4() -> Iterator[WorldHandle]:
    """4 gloo ranks shared by the whole session (started lazily, restarted if broken)."""
    yield from _world_fixture(4)


@pytest.fixture(scope="session")
def ds_world2(world2: WorldHandle) -> WorldHandle:
    """The session's 2 ranks, for a DeepSpeed test (every session World is ready for it)."""
    return world2


@pytest.fixture(scope="session")
def ds_world3(world3: WorldHandle) -> WorldHandle:
    """The session's 3 ranks, for a DeepSpeed test."""
    return world3


@pytest.fixture(scope="session")
def worlds(world2: WorldHandle, world3: WorldHandle, world4: WorldHandle) -> dict[int, WorldHandle]:
    """The session's Worlds by size (each starts on its first use)."""
    return {2: world2, 3: world3, 4: world4}


_CUDA_AVAILABLE: bool | None = None


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip ``gpu``-marked tests on machines without CUDA."""
    global _CUDA_AVAILABLE
    if item.get_closest_marker("gpu") is None:
        return
    if _CUDA_AVAILABLE is None:
        import torch

        _CUDA_AVAILABLE = bool(torch.cuda.is_available())
    if not _CUDA_AVAILABLE:
        pytest.skip("needs a CUDA device (torch.cuda.is_available() is False)")


@pytest.fixture
def ranks_factory():
    """Fault-injection worlds (tests/helpers/fault_ranks.py), each rank process killed at teardown."""
    from fault_ranks import Ranks

    made: list[Ranks] = []

    def make(scenario: str, world: int = 2, victim: int | None = None, env: dict | None = None) -> Ranks:
        r = Ranks(scenario, world, victim, extra_env=env)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


@pytest.fixture()
def engine():
    """A local engine on a tiny Llama (seed 11), its model, and a copy of the model's weights as
    they were (tests/unit/test_partial*.py train the model between calls; a module's own
    ``engine`` fixture overrides this one)."""
    import copy

    import torch
    from models import tiny_model

    import shardgen

    torch.set_num_threads(1)
    model = tiny_model("llama", seed=11)
    ref = copy.deepcopy(model)
    with shardgen.Engine(model, backend="local", max_batch_size=8) as eng:
        yield eng, model, ref


@pytest.hookimpl(trylast=True)  # after pytest's own, which makes the temp folders
def pytest_configure(config: pytest.Config) -> None:
    """The run's HF oracle cache (``models.hf_generate``): one folder for every worker of the run
    (xdist's workers keep their temp folders side by side in the run's folder) and the ranks they
    start, who inherit the environment. Set ``SHARDGEN_TEST_ORACLE_DIR`` empty to compute every
    answer afresh."""
    from models import ORACLE_DIR

    if ORACLE_DIR in os.environ:
        return
    base = config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined]
    run = base.parent if base.name.startswith("popen-gw") else base
    folder = run / "hf-oracle"
    folder.mkdir(exist_ok=True)
    os.environ[ORACLE_DIR] = str(folder)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what collection imported (torch, transformers, shardgen: ~400,000 objects), so the
    collector's full passes during the tests walk only what the tests allocate (each pass over
    them costs about 0.2 s of CPU). The ranks' fork server does the same (tests/helpers/rank_preload.py)."""
    import gc

    gc.freeze()
