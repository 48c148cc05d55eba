"""A rank whose own code raises (before ``paused()``, inside a training step, before ``close()``,
or uncaught with no ``with`` block, ending its process):
every peer raises within seconds, naming it and its exception, at 3 ranks on both backends.

``stall_timeout`` is 60 s here, so no bound of a wait can be what ends a peer's wait: only the
leaving rank's own report (``faults/leaving.py``) or its process's exit can. A peer inside the
training step waits in the step's own collective until the leaving process exits; what it then
raises still names that rank (the verdict), not the broken connection.
"""

from __future__ import annotations

import pytest
from test_faults import named

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

BOUND_S = 10.0  # every peer has raised and exited within this of the victim's raise
WHERES = ["before_paused", "in_step", "before_close", "uncaught", "holding"]  # holding: with held rows


CASES = [(w, b) for w in WHERES for b in ("fsdp2", "deepspeed") if (w, b) != ("uncaught", "deepspeed")]


@pytest.mark.parametrize(("where", "backend"), CASES)  # an uncaught exception: the engine's hook, one backend
def test_a_rank_whose_code_raises_is_named_by_every_peer_within_seconds(ranks_factory, backend, where):
    victim, world = 1, 3
    env = {"WHERE": where, "BACKEND": backend, "DS_ACCELERATOR": "cpu", "STALL_TIMEOUT": "60"}
    ranks = ranks_factory("user_raises", world, victim, env=env)
    t_raise = ranks.wait_event(victim, "raising", timeout=300)["t"]
    code, _ = ranks.wait_exit(victim, 30)
    assert code != 0 and f"ValueError: user code failed {where}" in ranks.text(victim), ranks.dump()
    for r in range(world):
        if r == victim:
            continue
        code, _ = ranks.wait_exit(r, BOUND_S + 20)  # past the bound: the assertion below says by how much
        errs = ranks.events(r, "error")
        assert code != 0 and errs, f"rank {r} reported no error:\n{ranks.dump()}"
        took = errs[0]["t"] - t_raise
        assert took < BOUND_S, f"rank {r} raised {took:.1f}s after rank {victim}:\n{ranks.dump()}"
        assert errs[0]["type"] == "PeerFailedError", ranks.dump()
        assert named(errs[0]["msg"]) == {victim}, f"rank {r} blamed the wrong rank:\n{ranks.dump()}"
        assert f"raised ValueError: user code failed {where}" in errs[0]["msg"], ranks.dump()
        print(f"\nMEASURED backend={backend} where={where} rank {r} raised after {took:.2f}s")
