"""DeepSpeed ZeRO-3 partitioned over data-parallel subgroups: one engine per partition group (4 ranks).

Not tested, because they cannot work with deepspeed 0.19.8 (docs/DEEPSPEED.md says why): MiCS
(``mics_shard_size`` was removed from DeepSpeed) and hpZ (``zero_hpz_partition_size``).
"""

from __future__ import annotations

import pytest

pytest.importorskip("deepspeed")

import group_scenarios as sc  # noqa: E402

pytestmark = pytest.mark.multirank
SLEEP = 6.0


@pytest.fixture(scope="module")
def dsworld4(world4):
    return world4


@pytest.mark.parametrize("kind", ["mpu", "zero_init"])
def test_one_engine_per_data_parallel_subgroup(dsworld4, kind):
    closed = dsworld4.run(sc.deepspeed_subgroup, kind, SLEEP, timeout=400)
    assert max(closed[:2]) < SLEEP, f"group [0, 1] waited for rank 3: {closed}"
    assert min(closed[2:]) >= SLEEP
