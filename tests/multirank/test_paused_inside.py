"""A rank that leaves ``paused()`` while peers are still inside theirs (a collective of the user's
own that not every rank runs as often) is told which ranks, with their stacks, after
``stall_timeout``: 3 ranks, so that the ranks named are the ones inside, not a messenger."""

from __future__ import annotations

import pause_scenarios as sc
import pytest
from world import World, WorldHang

pytestmark = pytest.mark.multirank


def test_a_rank_out_of_paused_names_the_ranks_still_inside(tmp_path):
    path = tmp_path / "rank0.log"
    with World(3, env={"OMP_NUM_THREADS": "1"}, start_timeout=120.0) as world:
        with pytest.raises(WorldHang) as info:
            world.run(sc.uneven_collectives_inside_paused, str(path), timeout=12)  # rank 0 writes at ~7 s
    text = path.read_text(encoding="utf-8")
    assert "rank 0: left paused()" in text and "rank(s) 1, 2 are still inside" in text, text
    assert "engine.score()" in text, text  # the way out for teacher and reference forwards
    for r in (1, 2):
        assert f"rank {r} (host" in text, text
    assert text.count("all_reduce") >= 2, text  # their stacks: inside the user's collective
    stacks = info.value.stacks
    assert all("all_reduce" in stacks[r] for r in (1, 2)), stacks
