"""``make test CPU=1``: the CPU seconds each test costs, its whole process tree counted, and a
table of the costliest files and tests at the end.

The suite is CPU-bound on 2 cores (every core busy throughout), so its time comes down only by
computing less. ``--durations`` gives wall seconds, which a test spends mostly waiting for the
cores the other workers hold; this gives what each test computes: the xdist worker itself, its
reaped children (launched jobs) and every live descendant (the test ranks, which their fork
server reaps: their CPU is in its children's time) over the test's setup, call and teardown.
A World started by a test is charged to it, as its ranks' later work is to the tests that use
them. Linux (``/proc``); elsewhere it says so and records nothing.

    make test CPU=1                  # the table after the run; every test in cpu-report.jsonl
    pytest -p cpu_report ...         # the same, with SHARDGEN_CPU_REPORT=<file> to choose the file
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path

import pytest

REPORT_ENV = "SHARDGEN_CPU_REPORT"
DEFAULT_FILE = "cpu-report.jsonl"
#: Rows of each table at the end.
SHOWN = 25
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat_fields(pid: str) -> tuple[int, float] | None:
    """(parent pid, utime + stime + cutime + cstime in seconds) of process ``pid``, or None if
    it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    rest = text[text.rindex(")") + 2 :].split()  # the name may hold spaces and parentheses
    return int(rest[1]), sum(int(x) for x in rest[11:15]) / _TICK


def tree_cpu() -> float:
    """CPU seconds of this process and its reaped children, and of every live descendant and its
    reaped children."""
    kids: dict[int, list[tuple[int, float]]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (got := _stat_fields(name)) is not None:
            kids.setdefault(got[0], []).append((int(name), got[1]))
    t = os.times()  # its own to the microsecond, not the clock tick
    total, stack = t.user + t.system + t.children_user + t.children_system, [os.getpid()]
    while stack:
        for pid, cpu in kids.get(stack.pop(), ()):
            total += cpu
            stack.append(pid)
    return total


def _report_file(config: pytest.Config) -> Path:
    return Path(os.environ.get(REPORT_ENV) or Path(str(config.rootpath)) / DEFAULT_FILE)


_config: pytest.Config | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _config
    _config = config
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist) starts afresh
        _report_file(config).unlink(missing_ok=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Around the test's setup, call and teardown, where it runs (an xdist worker)."""
    if _config is None or not os.path.isdir("/proc"):
        yield
        return
    cpu, wall = tree_cpu(), time.monotonic()
    yield
    cpu, wall = tree_cpu() - cpu, time.monotonic() - wall
    line = json.dumps({"test": item.nodeid, "cpu_s": round(cpu, 2), "wall_s": round(wall, 2)})
    with open(_report_file(_config), "a") as f:  # one short line per write: whole under O_APPEND
        f.write(line + "\n")


def summary(rows: list[dict], shown: int = SHOWN) -> list[str]:
    """The report's lines: the total, then the costliest files and tests (CPU seconds, wall)."""
    files: Counter[str] = Counter()
    for r in rows:
        files[r["test"].split("::")[0]] += r["cpu_s"]
    total = sum(r["cpu_s"] for r in rows)
    lines = [f"{total:.0f} CPU-s over {len(rows)} tests (the process tree of each)", "", "by file:"]
    lines += [f"{cpu:8.1f}  {name}" for name, cpu in files.most_common(shown)]
    lines += ["", "by test (CPU-s, wall s):"]
    for r in sorted(rows, key=lambda r: -r["cpu_s"])[:shown]:
        lines.append(f"{r['cpu_s']:8.1f} {r['wall_s']:8.1f}  {r['test']}")
    return lines


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):
        return
    path = _report_file(config)
    if not os.path.isdir("/proc"):
        terminalreporter.write_line("cpu_report: no /proc here, nothing recorded")
        return
    if not path.exists():
        return
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    terminalreporter.section("CPU seconds per test (cpu_report)")
    for line in summary(rows):
        terminalreporter.write_line(line)
    terminalreporter.write_line(f"every test: {path}")
