"""Every module a benchmark imports, anywhere in it (its ranks import inside functions, after the
launch), resolves on the path the benchmark builds itself: a test helper that moved (tests/ into
tests/helpers/) left two benchmarks failing at their ranks' first line, which ``--help`` and
every test importing them through conftest's path could not see."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = sorted((ROOT / "benchmarks").glob("*.py"))

# One fresh interpreter for all of them (no conftest, no PYTHONPATH): per benchmark, its own
# ``sys.path`` statements (the module-level ones that name it), then a spec lookup for each module
# it imports; the path is restored before the next.
PROBE = """
import importlib.util, json, pathlib, sys
base, missing = list(sys.path), {}
for path, stmts, names in json.loads(sys.stdin.read()):
    sys.path[:] = [str(pathlib.Path(path).parent), *base]
    g = {"__file__": path, "__name__": "probe"}
    for s in stmts:
        exec(s, g)
    missing[path] = [n for n in names if importlib.util.find_spec(n) is None]
print(json.dumps(missing))
"""


def imports_of(tree: ast.Module) -> list[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return sorted(names - {"__future__"})


def path_statements(source: str, tree: ast.Module) -> list[str]:
    """The module-level statements that change ``sys.path``, and the imports they need."""
    out = []
    for node in tree.body:
        seg = ast.get_source_segment(source, node) or ""
        if isinstance(node, ast.Import) or ("sys.path" in seg and not isinstance(node, ast.ImportFrom)):
            out.append(seg)
    return out


def test_every_benchmarks_imports_resolve_on_its_own_path() -> None:
    jobs = []
    for script in BENCHMARKS:
        source = script.read_text(encoding="utf-8")
        tree = ast.parse(source)
        jobs.append([str(script), path_statements(source, tree), imports_of(tree)])
    out = subprocess.run(
        [sys.executable, "-I", "-c", PROBE], input=json.dumps(jobs), capture_output=True, text=True,
        timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    missing = {Path(k).name: v for k, v in json.loads(out.stdout).items() if v}
    assert len(jobs) > 20
    assert missing == {}, f"benchmarks importing modules their own path does not hold: {missing}"
