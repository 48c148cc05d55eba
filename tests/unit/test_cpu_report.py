"""The suite's CPU report (``make test CPU=1``, tests/helpers/cpu_report.py): a test's process tree
counted, live descendants and reaped children alike."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from cpu_report import summary, tree_cpu

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")

# A child that burns CPU, then a grandchild that does too; both wait to be told to exit.
GRANDCHILD = """
import time
end = time.process_time() + 0.4
while time.process_time() < end:
    pass
print("done", flush=True)
input()
"""
CHILD = f"""
import subprocess, sys, time
end = time.process_time() + 0.4
while time.process_time() < end:
    pass
kid = subprocess.Popen([sys.executable, "-c", {GRANDCHILD!r}], stdin=subprocess.PIPE,
                       stdout=subprocess.PIPE, text=True)
kid.stdout.readline()
print("burnt", flush=True)
sys.stdin.readline()
kid.communicate("")
"""


def test_a_tests_process_tree_is_counted_while_it_lives_and_once_reaped() -> None:
    before = tree_cpu()
    pipes = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    child = subprocess.Popen([sys.executable, "-c", CHILD], **pipes)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "burnt"
        alive = tree_cpu() - before  # the child and its child, both live descendants
        assert alive >= 0.7, alive
        child.communicate("\n", timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    time.sleep(0.05)
    reaped = tree_cpu() - before  # now in this process's children's time
    assert reaped >= alive - 0.05, (alive, reaped)


def test_the_report_ranks_files_and_tests_by_cpu() -> None:
    rows = [
        {"test": "tests/a.py::one", "cpu_s": 3.0, "wall_s": 9.0},
        {"test": "tests/b.py::two", "cpu_s": 5.0, "wall_s": 6.0},
        {"test": "tests/a.py::three", "cpu_s": 4.0, "wall_s": 1.0},
    ]
    lines = summary(rows)
    assert lines[0].startswith("12 CPU-s over 3 tests")
    files = lines[lines.index("by file:") + 1 : lines.index("by file:") + 3]
    assert [f.split()[-1] for f in files] == ["tests/a.py", "tests/b.py"]
    assert float(files[0].split()[0]) == 7.0
    tests = lines[lines.index("by test (CPU-s, wall s):") + 1 :]
    assert [t.split()[-1] for t in tests] == ["tests/b.py::two", "tests/a.py::three", "tests/a.py::one"]
