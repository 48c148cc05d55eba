"""Long runs leak nothing (issue 19): the soaks of tests/helpers/soak.py, short here, full size ``long``.

- a ``shardgen run`` job on 2 ranks: every rank's resident memory is flat after warm-up (a line
  fitted over RSS against prompts done, bounded in MB per 1,000 prompts);
- one engine kept open across many ``generate()`` calls, and many engines opened and closed in
  one process, on 2 ranks: threads, native threads, file descriptors, process groups, the c10d
  store's keys and ``atexit`` callbacks come back to their baseline.

``make test`` runs the short engines soak (10 engines); ``make fuzz`` every other one, short and
full size (20,000 prompts, 5,000 calls, 200 engines). The figures (``MEASURED`` lines,
``pytest -s``) are docs/RELIABILITY.md's.
"""

from __future__ import annotations

import pytest
import soak
import soak_scenarios as S

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

SHORT_PROMPTS, LONG_PROMPTS = 1000, 20000
SHORT_CALLS, LONG_CALLS = 80, 5000
SHORT_ENGINES, LONG_ENGINES = 10, 200
# Hard bounds: the job's process group, or the World's ranks, are killed past them (a hang is a
# failure with every rank's stack, not a stuck suite); under each test's pytest timeout. The
# 80 calls took 136 s at load average 20 on 2 cores, 75 s at 8-16.
SHORT_TIMEOUT, LONG_TIMEOUT = 360, 7000


def _job(n: int, tmp_path) -> None:
    short = n < soak.LONG_JOB
    # The short job on the default gather (a replica of the toy model) takes seconds: sample
    # often enough to see a trend after the warm-up.
    res = soak.job_soak(
        n, workdir=tmp_path, timeout=SHORT_TIMEOUT if short else LONG_TIMEOUT, interval=0.05 if short else 0.5
    )
    bound = soak.job_bound(n)
    print("\n".join(soak.job_lines(res, bound)))
    assert res["summary"]["completed"] == n and res["summary"]["errors"] == 0, res["summary"]
    for r in res["ranks"]:
        # Two halves of at least 3 samples each (soak.analyse fits a line to each).
        assert r["samples"] >= 6, (r, "too few samples after warm-up: the job ran too fast to measure")
        assert r["slope_mb_per_1000"] <= bound, (
            f"rank {r['rank']}'s memory grows {r['slope_mb_per_1000']:+.2f} MB per 1,000 prompts after "
            f"warm-up (bound {bound:g}): {r}"
        )


def _flat_while_open(per_rank: list[dict]) -> None:
    """While the engine is open, every count stays where its first census put it, and Python's
    allocated blocks stop growing after warm-up."""
    print("\n".join(soak.calls_lines(per_rank)))
    for r in per_rank:
        first = r["open"][0]
        for c in r["open"][1:]:
            moved = {k: (first[k], c[k]) for k in soak.COUNTED if c[k] != first[k] and k != "store_keys"}
            assert not moved, (
                f"rank {r['rank']} after {c['calls']} calls: {moved}; "
                f"fds {first['fd_kinds']} -> {c['fd_kinds']}"
            )
        # The latest pause's two keys (its count, who has left it), and the next one's while the
        # ranks pass it (a census on one rank does not wait for the others): at most 4 more,
        # however many pauses.
        keys = [c["store_keys"] for c in r["open"]]
        assert max(keys) - min(keys) <= 4, f"rank {r['rank']}: store keys while open {keys}"
        g = soak.calls_growth(r)
        assert g["samples"] >= 3, g
        bound = soak.blocks_bound(r["calls"])
        assert g["blocks_per_call"] <= bound, (
            f"rank {r['rank']} keeps {g['blocks_per_call']:.1f} Python blocks per generate() call after "
            f"warm-up (bound {bound:g}): {g}"
        )


def _nothing_left(per_rank: list[dict], what: str) -> None:
    print(f"MEASURED engine soak, {what}:\n{soak.table(per_rank)}")
    bad = soak.leftovers(per_rank)
    assert not bad, "\n".join(bad)


# ------------------------------------------------------------------ short: make test


# In `make fuzz`, not `make test`: a 1,000-prompt job is about 50 s of CPU; its long form (20,000
# prompts) runs there too, and the job's paths run in tests/multirank/test_cli*.py.
@pytest.mark.long
@pytest.mark.timeout(420)
def test_job_memory_is_flat_short(tmp_path):
    _job(SHORT_PROMPTS, tmp_path)


# In `make fuzz`, not `make test`: its long form runs there too.
@pytest.mark.long
@pytest.mark.timeout(420)
def test_engine_open_across_calls_leaves_nothing(world2):
    out = world2.run(S.engine_calls, SHORT_CALLS, timeout=SHORT_TIMEOUT)
    _flat_while_open(out)
    _nothing_left(out, f"one engine across {SHORT_CALLS} generate() calls, 2 ranks")


@pytest.mark.timeout(420)
def test_engines_opened_and_closed_leave_nothing(world2):
    out = world2.run(S.engine_cycles, SHORT_ENGINES, timeout=SHORT_TIMEOUT)
    _nothing_left(out, f"{SHORT_ENGINES} engines opened and closed, 2 ranks")


# ------------------------------------------------------------------ full size: make fuzz


@pytest.mark.long
@pytest.mark.timeout(7200)
def test_job_memory_is_flat_20000_prompts(tmp_path):
    _job(LONG_PROMPTS, tmp_path)


@pytest.mark.long
@pytest.mark.timeout(7200)
def test_engine_open_across_5000_calls_leaves_nothing(world2):
    out = world2.run(S.engine_calls, LONG_CALLS, timeout=LONG_TIMEOUT)
    _flat_while_open(out)
    _nothing_left(out, f"one engine across {LONG_CALLS} generate() calls, 2 ranks")


@pytest.mark.long
@pytest.mark.timeout(7200)
def test_200_engines_opened_and_closed_leave_nothing(world2):
    out = world2.run(S.engine_cycles, LONG_ENGINES, timeout=LONG_TIMEOUT)
    _nothing_left(out, f"{LONG_ENGINES} engines opened and closed, 2 ranks")
