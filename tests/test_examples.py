"""The examples, run as a user would: under torchrun and the DeepSpeed launcher (2 CPU ranks).

Each run is a subprocess in its own session; on a timeout its process group (the launcher and
the ranks it started, nothing else) is killed and the output shown.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ports import free_port

from shardgen import toy

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
BIN = Path(sys.executable).parent
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
RUN_TIMEOUT_S = 300.0  # hard bound; a 2-core machine under load needs ~150 s for some
ZI_ARGS = ["--uneven", "--away-rank", "1", "--away-s", "3", "--loops", "2", "--gen-len", "8"]


def _launcher(console_script: str, module: str) -> list[str]:
    """The launcher's console script from this interpreter's venv, else ``python -m module``."""
    script = BIN / console_script
    return [str(script)] if script.exists() else [sys.executable, "-m", module]


def torchrun(script: str, *args: str) -> list[str]:
    return [
        *_launcher("torchrun", "torch.distributed.run"),
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        str(EXAMPLES / script),
        *args,
    ]


def deepspeed_launcher(script: str, *args: str) -> list[str]:
    # On CPU (DS_ACCELERATOR=cpu) --num_gpus N starts N CPU ranks.
    return [
        *_launcher("deepspeed", "deepspeed.launcher.runner"),
        "--num_gpus",
        "2",
        "--master_port",
        str(free_port()),
        str(EXAMPLES / script),
        *args,
    ]


# The ranks print to one pipe, unbuffered: a line's text and its newline are two writes, so two
# ranks' lines may interleave ("rank 0: 'a'rank 1: 'b'\n\n"). Match a rank's line anywhere.
RANK_LINE = r"rank "


def run(cmd: list[str], timeout: float = RUN_TIMEOUT_S) -> tuple[int, str, float]:
    """Run ``cmd``; on a lost port race (another process bound the master port between our
    check and the store's bind) run it again on a new port, up to three times."""
    for _ in range(3):
        rc, out, elapsed = _run_once(cmd, timeout)
        if rc == 0 or "EADDRINUSE" not in out:
            break
        cmd = _new_port(cmd)
    return rc, out, elapsed


def _new_port(cmd: list[str]) -> list[str]:
    cmd = list(cmd)
    for i, arg in enumerate(cmd[:-1]):
        if arg in ("--master-port", "--master_port"):
            cmd[i + 1] = str(free_port())
    return cmd


def _run_once(cmd: list[str], timeout: float) -> tuple[int, str, float]:
    """Run ``cmd`` in a new session; kill its process group on timeout. (rc, output, seconds)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if not _cuda():
        env.setdefault("DS_ACCELERATOR", "cpu")
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    pgid = proc.pid  # a new session: the launcher leads its own process group
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(pgid)
        out, _ = proc.communicate()
        pytest.fail(f"timed out after {timeout:g}s: {' '.join(cmd)}\n--- output ---\n{out}")
    finally:
        if proc.returncode is None:
            _kill_group(pgid)
            proc.wait()
    if proc.returncode != 0:
        _kill_group(pgid)  # ranks the launcher may have left behind
    elapsed = time.monotonic() - t0
    print(f"$ {' '.join(cmd)}  ({elapsed:.1f}s, rc={proc.returncode})\n{out}")
    return proc.returncode, out, elapsed


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _check_zero_inference(rc: int, out: str) -> None:
    assert rc == 0, f"exit code {rc}\n--- output ---\n{out}"
    for what in ("prefill", "decode", "total"):
        assert re.search(rf"{what} latency: [\d.]+ s\s+{what} throughput: [\d.]+ token/s", out), (
            f"no {what} throughput line\n--- output ---\n{out}"
        )
    # --uneven --loops 2: rank r runs 2 + r batches; the away rank still does all of its own.
    assert "per-rank batches done: rank 0: 2, rank 1: 3" in out, out
    assert "rank 1: away for 3 s" in out, out
    assert out.count("Summary (rank 0, last batch):") == 1, f"summary not printed by rank 0 only\n{out}"


def test_basic_torchrun():
    rc, out, _ = run(torchrun("basic.py"))
    assert rc == 0, f"exit code {rc}\n--- output ---\n{out}"
    answers = re.findall(RANK_LINE + r"(\d+): '([^']*)' -> '([^']*)' \((\w+)\)", out)
    per_rank = {r: sum(1 for a in answers if a[0] == str(r)) for r in (0, 1)}
    assert per_rank == {0: 1, 1: 2}, f"rank r should answer r+1 prompts: {per_rank}\n{out}"
    for _, prompt, text, reason in answers:
        assert reason == "eos" and toy.check_answer(prompt, text), f"{prompt!r} -> {text!r} ({reason})"


def test_zero_inference_torchrun():
    _check_zero_inference(*run(torchrun("zero_inference.py", *ZI_ARGS))[:2])


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="needs deepspeed")
def test_zero_inference_user_partitioned_cpu_offload():
    """The seed report's setup, under the DeepSpeed launcher: deepspeed.initialize at stage 3 with
    offload_param cpu, by the user (shardgen-partitioned models: tests/test_deepspeed_backend.py)."""
    rc, out, _ = run(deepspeed_launcher("zero_inference.py", "--user-partitioned", "--cpu-offload", *ZI_ARGS))
    _check_zero_inference(rc, out)
    assert "backend deepspeed (user-partitioned), offload_param cpu" in out, out


def _check_rl_rollout(rc: int, out: str, steps: int) -> None:
    assert rc == 0, f"exit code {rc}\n--- output ---\n{out}"
    rewards = re.findall(r"^step +(\d+)  reward ([\d.]+)", out, flags=re.M)
    assert [int(s) for s, _ in rewards] == list(range(steps)), f"rank 0 prints one line per step\n{out}"
    assert all(0.0 <= float(r) <= 1.0 for _, r in rewards)
    flat = re.findall(r"^step +\d+ .* flat prompts (\d+)/(\d+) ", out, flags=re.M)
    assert len(flat) == steps and all(int(f) <= int(g) for f, g in flat), out  # zero-advantage prompts
    assert re.search(r"^reward: first \d+ steps [\d.]+ -> last \d+ steps [\d.]+$", out, flags=re.M), out


RL_ARGS = ["--steps", "2", "--prompts", "5", "--samples", "2"]


def test_rl_rollout_fsdp2_torchrun():
    _check_rl_rollout(*run(torchrun("rl_rollout.py", "--backend", "fsdp2", *RL_ARGS))[:2], steps=2)


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="needs deepspeed")
def test_rl_rollout_deepspeed_launcher():
    # DeepSpeed's CPU start-up alone takes a minute on a busy 2-core machine
    cmd = deepspeed_launcher("rl_rollout.py", "--backend", "deepspeed", *RL_ARGS)
    _check_rl_rollout(*run(cmd, timeout=2 * RUN_TIMEOUT_S)[:2], steps=2)


@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="needs trl (pip install 'shardgen[trl]')")
def test_trl_grpo_fsdp2_torchrun():
    """The TRL subclass on the toy task (DeepSpeed: tests/test_trl.py covers that backend)."""
    rc, out, _ = run(torchrun("trl_grpo.py", "--backend", "fsdp2", "--steps", "2", "--prompts-per-rank", "2"))
    assert rc == 0, f"exit code {rc}\n--- output ---\n{out}"
    assert len(re.findall(r"'reward': '[\d.]+'", out)) == 2, out  # TRL logs each step once (rank 0)
    assert re.search(r"^reward: first 1 steps [\d.]+ -> last 1 steps [\d.]+$", out, flags=re.M), out
