"""``shardgen.launch.lost_ranks_line``: the launcher's one line for ranks that died by a signal,
from the agent's failures (exit codes: negative for a signal, 128 + N for a rank's quiet exit on
SIGINT / SIGTERM)."""

from __future__ import annotations

import signal
from types import SimpleNamespace

from shardgen.launch import lost_ranks_line


def _f(code: int, pid: int = 100) -> SimpleNamespace:
    return SimpleNamespace(exitcode=code, pid=pid)


def test_a_killed_rank_is_said_with_the_resume_command():
    line = lost_ranks_line(
        {1: _f(-signal.SIGKILL, 31), 0: _f(-signal.SIGTERM), 2: _f(-signal.SIGTERM)}, "shardgen run --resume"
    )
    assert line == (
        "shardgen: error: rank 1 (pid 31) was killed by signal 9 (SIGKILL); the other ranks were stopped. "
        "Results so far are in the journals, which are intact: resume with: shardgen run --resume"
    )


def test_a_killed_rank_is_said_when_its_peers_exited_with_their_own_error_first():
    """The peers saw rank 1 gone and failed (exit code 1) before the agent stopped them: rank 1's
    signal is still the cause, and only this line says it."""
    line = lost_ranks_line({0: _f(1), 1: _f(-signal.SIGKILL, 31), 2: _f(1)}, None)
    assert (
        line
        == "shardgen: error: rank 1 (pid 31) was killed by signal 9 (SIGKILL); the other ranks were stopped."
    )


def test_no_line_when_every_failed_rank_exited_by_itself():
    assert lost_ranks_line({0: _f(1), 1: _f(-signal.SIGTERM)}, None) is None
    assert lost_ranks_line({0: _f(1), 2: _f(3)}, "x") is None


def test_sigterm_alone_is_the_cause_when_nothing_else_failed():
    """A scheduler's SIGTERM to every rank (nothing else failed), read from a quiet exit (143) too."""
    line = lost_ranks_line({0: _f(128 + signal.SIGTERM, 7), 1: _f(-signal.SIGTERM, 8)}, None)
    assert line is not None and "rank 0 (pid 7) was killed by signal 15 (SIGTERM)" in line
    assert "rank 1 (pid 8) was killed by signal 15 (SIGTERM)" in line
