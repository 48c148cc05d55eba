"""The RL examples, run as a user would: ``rl_rollout.py`` as torchrun starts it (FSDP2) and under the
DeepSpeed launcher, and the TRL subclass (2 CPU ranks). In ``make test`` the ranks are forked as
torchrun would start them (tests/helpers/example_runs.py ``run_forked``: no fresh interpreters); the
launchers' own runs of these scripts are in ``make fuzz``. A file of its own beside
tests/multirank/test_examples.py, so that the suite's workers share the example runs (``make test``
runs one file per worker).
"""

from __future__ import annotations

import importlib.util
import re

import pytest
from example_runs import HAS_DEEPSPEED, RUN_TIMEOUT_S, deepspeed_launcher, run, run_forked, torchrun

pytestmark = [pytest.mark.multirank, pytest.mark.slow]


def _check_rl_rollout(rc: int, out: str, steps: int) -> None:
    assert rc == 0, f"exit code {rc}\n--- output ---\n{out}"
    rewards = re.findall(r"^step +(\d+)  reward ([\d.]+)", out, flags=re.M)
    assert [int(s) for s, _ in rewards] == list(range(steps)), f"rank 0 prints one line per step\n{out}"
    assert all(0.0 <= float(r) <= 1.0 for _, r in rewards)
    flat = re.findall(r"^step +\d+ .* flat prompts (\d+)/(\d+) ", out, flags=re.M)
    assert len(flat) == steps and all(int(f) <= int(g) for f, g in flat), out  # zero-advantage prompts
    assert re.search(r"^reward: first \d+ steps [\d.]+ -> last \d+ steps [\d.]+$", out, flags=re.M), out


RL_ARGS = ["--steps", "2", "--prompts", "5", "--samples", "2"]


def test_rl_rollout_fsdp2():
    _check_rl_rollout(*run_forked("rl_rollout.py", "--backend", "fsdp2", *RL_ARGS)[:2], steps=2)


# In `make fuzz`, not `make test`: the same run under torchrun itself (its agent, fresh interpreters).
@pytest.mark.long
def test_rl_rollout_fsdp2_torchrun():
    _check_rl_rollout(*run(torchrun("rl_rollout.py", "--backend", "fsdp2", *RL_ARGS))[:2], steps=2)


# In `make fuzz`, not `make test`: rl_rollout.py runs on FSDP2 above, and opsd.py on DeepSpeed below.
@pytest.mark.long
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="needs deepspeed")
def test_rl_rollout_deepspeed_launcher():
    # DeepSpeed's CPU start-up alone takes a minute on a busy 2-core machine
    cmd = deepspeed_launcher("rl_rollout.py", "--backend", "deepspeed", *RL_ARGS)
    _check_rl_rollout(*run(cmd, timeout=2 * RUN_TIMEOUT_S)[:2], steps=2)


@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="needs trl (pip install 'shardgen[trl]')")
def test_trl_grpo_fsdp2():
    """The TRL subclass on the toy task (DeepSpeed: tests/multirank/test_trl.py covers that backend),
    with speculative decoding (``--speculate``: its counters from TRL's logs on rank 0)."""
    args = ["--backend", "fsdp2", "--steps", "2", "--prompts-per-rank", "2", "--speculate", "4"]
    rc, out, _ = run_forked("trl_grpo.py", *args)
    assert rc == 0, f"exit code {rc}\n--- output ---\n{out}"
    assert len(re.findall(r"'reward': '[\d.]+'", out)) == 2, out  # TRL logs each step once (rank 0)
    assert re.search(r"^reward: first 1 steps [\d.]+ -> last 1 steps [\d.]+$", out, flags=re.M), out
    m = re.search(r"^speculation: drafted (\d+)  accepted (\d+) \(([\d.]+)\)  tokens per forward ([\d.]+)$",
                  out, flags=re.M)  # fmt: skip
    assert m and int(m[2]) <= int(m[1]) and float(m[4]) >= 1.0, out
    assert re.search(r"^train: 2 steps in [\d.]+ s, generation [\d.]+ s of it$", out, flags=re.M), out


def _check_opsd(rc: int, out: str, steps: int, world: int, prompts: int, samples: int) -> list[tuple]:
    """One line per step on rank 0, a finite non-negative divergence, the task score and the
    tokens of all ranks, the final summary; the last rank has no rows on odd steps and the step
    still runs (its tokens leave the total). -> per step: (loss, correct, tokens)."""
    assert rc == 0, f"exit code {rc}\n--- output ---\n{out}"
    lines = re.findall(
        r"^step +(\d+)  loss ([\d.eE+-]+|nan|inf)  correct (\d+)/(\d+)  tokens (\d+)  rows here (\d+) ",
        out,
        flags=re.M,
    )
    assert [int(s) for s, *_ in lines] == list(range(steps)), f"rank 0 prints one line per step\n{out}"
    assert all(0.0 <= float(loss) < 10.0 for _, loss, *_ in lines), out  # finite: nan/inf fail here
    assert all(0 <= int(c) <= int(r) == prompts * samples for _, _, c, r, *_ in lines), out
    assert all(int(t) > 0 for *_, t, _ in lines), out
    for step, *_, here in lines:  # rank 0's share: 2 parts of 1 + world; the last rank none on odd steps
        weights = [2] + [1] * (world - 1)
        weights[-1] = 0 if int(step) % 2 else weights[-1]
        assert int(here) == samples * round(prompts * 2 / sum(weights)), (step, here, out)
    for what in ("loss", "correct", "tokens"):
        assert re.search(
            rf"^{what}: first \d+ steps [\d.]+(/\d+)? -> last \d+ steps [\d.]+", out, flags=re.M
        ), out
    assert re.search(r"^(NOT )?both improved: ", out, flags=re.M), out
    return [(float(loss), int(c), int(t)) for _, loss, c, _, t, _ in lines]


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="needs deepspeed")
def test_opsd_full_logits_learns():
    """The example's own settings, fewer steps: the student learns where its answers end. Over
    the run the task score rises (exact answers, out of 24 samples a step) and the divergence
    from the frozen teacher falls. With the teacher on the student's own moving weights (the
    example's old recipe) the score collapses to 0-2/24 by step 12 while the loss still falls."""
    steps, k = 12, 4
    rc, out = run_forked("opsd.py", "--steps", str(steps), timeout=2 * RUN_TIMEOUT_S)[:2]
    history = _check_opsd(rc, out, steps=steps, world=2, prompts=12, samples=2)
    first, last = history[:k], history[-k:]

    def mean(col: int, part: list[tuple]) -> float:
        return sum(h[col] for h in part) / len(part)

    assert mean(1, last) >= mean(1, first) + 4, f"the task score rises by 4 of 24 or more\n{out}"
    assert mean(0, last) < 0.7 * mean(0, first), f"the loss falls by 30% or more\n{out}"
    assert mean(2, last) < mean(2, first), f"answers stop instead of running on\n{out}"
    assert re.search(r"^both improved: the loss fell, the task score rose$", out, flags=re.M), out


# The fast numerics here: the 2-rank run above takes the example's default (invariant).
OPSD_ARGS = ["--steps", "2", "--prompts", "5", "--samples", "2", "--numerics", "fast"]


# In `make fuzz`, not `make test` (a 3-rank DeepSpeed launch is a minute of CPU): opsd.py runs on
# DeepSpeed above (torchrun's environment), with its default teacher.
@pytest.mark.long
@pytest.mark.skipif(not HAS_DEEPSPEED, reason="needs deepspeed")
def test_opsd_deepspeed_launcher_3_ranks_top_k_separate_teacher():
    """Under the DeepSpeed launcher at 3 ranks, the teacher's top-k only, and ``--teacher PATH``:
    a second engine (another model, from_pretrained, sharded on the same ranks). One launch for
    both (a 3-rank DeepSpeed launch costs about a minute of CPU)."""
    from shardgen import toy

    teacher = ["--teacher", str(toy.toy_model_path())]
    cmd = deepspeed_launcher("opsd.py", *OPSD_ARGS, "--top-k", "4", *teacher, nproc=3)
    rc, out = run(cmd, timeout=2 * RUN_TIMEOUT_S)[:2]
    _check_opsd(rc, out, steps=2, world=3, prompts=5, samples=2)


PARTIAL_ARGS = ["--steps", "2", "--prompts", "4", "--samples", "2"]


def _check_partial(rc: int, out: str, steps: int) -> dict[str, list[float]]:
    """Both arms' lines, one per step, then their summaries and the ratio of rollout wall times:
    rewards in [0, 1], the plain arm's tokens all of the step's weights (staleness 0), the quota
    arm's at most max_staleness (1) behind. -> per arm, the rollout seconds of each step."""
    assert rc == 0, f"exit code {rc}\n--- output ---\n{out}"
    secs = {}
    for arm in ("plain", "quota"):
        lines = re.findall(
            rf"^{arm} step +(\d+)  reward ([\d.]+)  rollout ([\d.]+)s \((\d+)% of the step\)  "
            r"staleness ([\d.]+)  weight ([\d.]+)$",
            out,
            flags=re.M,
        )
        done = [int(s) for s, *_ in lines]
        # the quota arm goes on until it trained on as many samples as the plain arm's steps
        assert done[:steps] == list(range(steps)) and done == list(range(len(done))), f"{arm}: steps\n{out}"
        assert len(done) == steps or arm == "quota", f"one {arm} line per step on rank 0\n{out}"
        assert all(0.0 <= float(r) <= 1.0 and 0 < int(p) <= 100 for _, r, _, p, _, _ in lines), out
        most = 0.0 if arm == "plain" else 1.0
        assert all(0.0 <= float(s) <= most for *_, s, _ in lines), f"{arm}: staleness past {most}\n{out}"
        # the tokens' mean importance weight (behaviour logprobs against the trained weights'):
        # 1 on the current weights' own tokens, up to the cap (3) on older ones
        assert all(0.0 < float(w) <= 3.0 for *_, w in lines), out
        if arm == "plain":
            assert all(abs(float(w) - 1.0) < 0.01 for *_, w in lines), f"plain: weights not 1\n{out}"
        summary = rf"^{arm}: rollout [\d.]+s a step \(\d+% of the step\), \d+ useful tokens/s, "
        assert re.search(summary + r"reward \(last 3 steps\) [\d.]+, staleness [\d.]+$", out, flags=re.M), out
        secs[arm] = [float(t) for _, _, t, _, _, _ in lines]
    curve = re.findall(r"^at (\d+) samples trained: reward plain ([\d.]+)  quota ([\d.]+)$", out, flags=re.M)
    assert len(curve) == steps and all(0 <= float(p) <= 1 and 0 <= float(q) <= 1 for _, p, q in curve), out
    assert re.search(r"^rollout wall time per step, quota / plain: [\d.]+x$", out, flags=re.M), out
    return secs


# In `make fuzz`, not `make test`: two arms of GRPO steps on 2 ranks (a minute or two of CPU each).
@pytest.mark.long
@pytest.mark.parametrize("backend", ["fsdp2", pytest.param("deepspeed", marks=pytest.mark.skipif(
    not HAS_DEEPSPEED, reason="needs deepspeed"))])  # fmt: skip
def test_partial_rollouts_example_prints_both_arms(backend):
    """examples/partial_rollouts.py under torchrun, a few steps: the plain loop and the quota loop
    side by side, each step's reward, rollout time and staleness, then the summary."""
    cmd = torchrun("partial_rollouts.py", "--backend", backend, *PARTIAL_ARGS)
    _check_partial(*run(cmd, timeout=2 * RUN_TIMEOUT_S)[:2], steps=2)
