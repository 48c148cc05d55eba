"""The ```python blocks of README.md and docs/*.md, for tests/multirank/test_doc_snippets.py and the rank-side
harnesses of tests/helpers/doc_scenarios.py (plain Python: ranks import it too)."""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^( *)```python\n(.*?)^\1```", re.S | re.M)


def blocks() -> dict[tuple[str, str], str]:
    """``{(file, its first line's first 50 characters): code}`` of every python block, dedented."""
    out = {}
    for path in DOCS:
        for m in BLOCK.finditer(path.read_text(encoding="utf-8")):
            code = textwrap.dedent(m.group(2))
            out[(path.name, code.splitlines()[0].strip()[:50])] = code
    return out


def readme_function(program: str, name: str) -> str:
    """The source of function ``name`` as the README's ``program`` block (e.g. ``rl.py``) defines it:
    a block that says "README's helper" runs with the README's own text of it."""
    (code,) = [c for (f, first), c in blocks().items() if f == "README.md" and first.endswith(" " + program)]
    for node in ast.parse(code).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            segment = ast.get_source_segment(code, node)
            assert segment is not None
            return segment
    raise AssertionError(f"README's {program} defines no function {name}")
