"""The examples, run as a user would: under torchrun and the DeepSpeed launcher (2 CPU ranks).

Each run is a subprocess in its own session; on a timeout its process group (the launcher and
the ranks it started, nothing else) is killed and the output shown.
"""

from __future__ import annotations

import re

import pytest
from example_runs import HAS_DEEPSPEED, RANK_LINE, deepspeed_launcher, run, torchrun

from shardgen import toy

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

# The away rank sleeps long enough that rank 0's own batches end well before it is back, even on a
# machine under load (a clean clone's suite once ran rank 0's two batches in 5.14 s): asleep, it
# costs the suite no CPU.
AWAY_S = 8
ZI_ARGS = ["--uneven", "--away-rank", "1", "--away-s", str(AWAY_S), "--loops", "2", "--gen-len", "8"]


def _check_zero_inference(rc: int, out: str) -> None:
    assert rc == 0, f"exit code {rc}\n--- output ---\n{out}"
    for what in ("prefill", "decode", "total"):
        assert re.search(rf"{what} latency: [\d.]+ s\s+{what} throughput: [\d.]+ token/s", out), (
            f"no {what} throughput line\n--- output ---\n{out}"
        )
    # --uneven --loops 2: rank r runs 2 + r batches; the away rank still does all of its own.
    assert "per-rank batches done: rank 0: 2, rank 1: 3" in out, out
    assert f"rank 1: away for {AWAY_S} s" in out, out
    assert out.count("Summary (rank 0, last batch):") == 1, f"summary not printed by rank 0 only\n{out}"
    # Rank 0 is done before the away rank even starts: it never waited for it.
    done = dict(re.findall(r"rank (\d): \d+ batches done at \+([\d.]+) s", out))
    assert float(done["0"]) < AWAY_S, f"rank 0 waited for the away rank ({AWAY_S} s away): {done}\n{out}"


# In `make fuzz`, not `make test`: the README's quickstart (tests/multirank/test_readme.py, in make test)
# is this program (rank r asks r+1 prompts, a barrier of its own midway), in the README's words.
@pytest.mark.long
def test_basic_torchrun():
    rc, out, _ = run(torchrun("basic.py"))
    assert rc == 0, f"exit code {rc}\n--- output ---\n{out}"
    answers = re.findall(RANK_LINE + r"(\d+): '([^']*)' -> '([^']*)' \((\w+)\)", out)
    per_rank = {r: sum(1 for a in answers if a[0] == str(r)) for r in (0, 1)}
    assert per_rank == {0: 1, 1: 2}, f"rank r should answer r+1 prompts: {per_rank}\n{out}"
    for _, prompt, text, reason in answers:
        assert reason == "eos" and toy.check_answer(prompt, text), f"{prompt!r} -> {text!r} ({reason})"


# In `make fuzz`, not `make test` (a launch is half a minute of CPU there): the same script runs under the
# DeepSpeed launcher below, and the shardgen-partitioned DeepSpeed model it builds here runs through the
# engine in tests/multirank/test_deepspeed_backend.py.
@pytest.mark.long
def test_zero_inference_torchrun():
    _check_zero_inference(*run(torchrun("zero_inference.py", *ZI_ARGS))[:2])


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="needs deepspeed")
# The stationary run goes to `make fuzz` (a launch is half a minute of CPU): the same seed script
# with weight-stationary decode runs through the engine in tests/multirank/test_deepspeed_backend.py.
@pytest.mark.parametrize("gather", ["per-layer", pytest.param("stationary", marks=pytest.mark.long)])
def test_zero_inference_user_partitioned_cpu_offload(gather):
    """The seed report's setup, under the DeepSpeed launcher: deepspeed.initialize at stage 3 with
    offload_param cpu, by the user (shardgen-partitioned models: tests/multirank/test_deepspeed_backend.py),
    with per-layer gathers and weight-stationary (no weight moves): the away rank holds no one up."""
    args = ("--user-partitioned", "--cpu-offload", "--gather", gather, *ZI_ARGS)
    rc, out, _ = run(deepspeed_launcher("zero_inference.py", *args))
    _check_zero_inference(rc, out)
    assert "backend deepspeed (user-partitioned), offload_param cpu" in out, out
