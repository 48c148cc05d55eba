"""A two-agent torchrun job (as on two nodes) exits 0 by itself, with no C++ ``terminate``.

Each run is ~10-50 s on a 2-core machine, so one run here; ``make fuzz`` runs ten in a
row (tests/helpers/two_agents.py). Every process also reports the Python threads still alive at
interpreter exit: none may be (a daemon thread inside a store or gloo call at
finalization is how a clean job ends in ``terminate called without an active exception``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ports import free_port
from two_agents import run_once

from shardgen import toy

pytestmark = [pytest.mark.slow, pytest.mark.multirank]


# In `make fuzz`, not `make test`: make fuzz runs the same job ten times (tests/helpers/two_agents.py).
@pytest.mark.long
def test_two_agent_job_exits_zero_with_no_thread_left(tmp_path: Path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in toy.make_prompts(12, seed=2)))
    res = run_once(tmp_path, prompts)  # one run; make fuzz runs ten (tests/helpers/two_agents.py)
    out = "\n".join(t[-3000:] for t in res["outputs"])
    assert res["codes"] == [0, 0], out
    assert not res["terminate"], out
    assert res["rows"] == 12, out
    assert sum(t.count("EXIT-THREADS") for t in res["outputs"]) >= 4, out  # 2 agents + 2 ranks reported
    assert not res["threads_at_exit"], out


def _two_ranks(script: str, argv) -> list[subprocess.Popen]:
    """Start ``tests/helpers/<script>`` as ranks 0 and 1 (``argv(rank)``: its arguments), with this
    checkout's sources first on the path; their output piped."""
    here = Path(__file__).resolve().parents[1] / "helpers"
    path = os.pathsep.join([str(here.parents[1] / "src"), str(here)])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    return [
        subprocess.Popen(
            [sys.executable, str(here / script), *argv(r)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for r in range(2)
    ]


def test_import_shardgen_registers_the_exit_guard_without_torch():
    """``import shardgen`` alone registers the exit guard (core/process.py), importing no torch:
    the public names are lazy (PEP 562), and a script that only imports shardgen, as
    tests/helpers/exit_gil_rank.py does, had lost the guard with them (its ranks aborted in CI)."""
    code = (
        "import atexit, sys; n = atexit._ncallbacks(); import shardgen; "
        "print('shardgen.core.process' in sys.modules, 'torch' in sys.modules, atexit._ncallbacks() > n)"
    )
    src = str(Path(__file__).resolve().parents[2] / "src")
    out = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": src}, capture_output=True, text=True,
        timeout=60, check=True,
    ).stdout.split()  # fmt: skip
    assert out == ["True", "False", "True"], out


def test_last_collectives_right_before_exit_do_not_abort():
    """The exit guard gives the GIL to gloo's workers before the interpreter finalizes
    (core/process.py): a rank whose last collectives finish just before it exits exits 0."""
    for attempt in range(2):  # without the guard 7 of 10 such runs aborted: both pass by chance ~9%
        port = free_port()
        procs = _two_ranks("exit_gil_rank.py", lambda r, port=port: [str(r), "2", str(port)])
        try:
            outs = [p.communicate(timeout=120)[0] for p in procs]
        except subprocess.TimeoutExpired:
            for p in procs:  # ours, by pid: their stacks (tests/helpers/exit_gil_rank.py), then kill
                p.send_signal(signal.SIGUSR1)
            time.sleep(1.0)
            for p in procs:
                p.kill()
            outs = [p.communicate()[0] for p in procs]
            pytest.fail(f"attempt {attempt}: the ranks did not exit within 120 s\n" + "\n".join(outs)[-6000:])
        codes = [p.returncode for p in procs]
        text = "\n".join(outs)
        assert codes == [0, 0] and "terminate called" not in text, (attempt, codes, text[-3000:])
        assert text.count(" done") == 2, text


def test_gloo_worker_releasing_a_tick_after_its_caller_needs_no_gil_at_exit():
    """The control plane's buffers keep a second C++ reference (``ControlPlane._pins``), so the
    gloo worker that releases a tick's work after the caller let go of it does not take the GIL
    (core/protocol.py). Without it, rank 0 of tests/helpers/exit_tick_rank.py aborts at exit every time
    (its worker waits for the GIL into finalization)."""
    port = free_port()
    procs = _two_ranks("exit_tick_rank.py", lambda r: [str(r), str(port)])
    try:
        outs = [p.communicate(timeout=90)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:  # ours, by pid
            p.kill()
        outs = [p.communicate()[0] for p in procs]
        pytest.fail("the ranks did not exit within 90 s\n" + "\n".join(outs)[-6000:])
    codes, text = [p.returncode for p in procs], "\n".join(outs)
    assert codes == [0, 0] and "terminate called" not in text, (codes, text[-3000:])
    assert text.count(" ready") == 2, text
