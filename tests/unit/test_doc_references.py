"""Docs that cannot drift from the code: every path, module, symbol, constant value and link that
README.md and docs/ name exists (tests/helpers/doc_references.py says what is checked, and how), and
ARCHITECTURE.md's layout table lists every module of src/shardgen. docs/history/ records how
things came to be: only its links are checked. Static (no shardgen import): a second or two."""

from __future__ import annotations

from pathlib import Path

import pytest
from doc_references import (
    CONSTANTS,
    HISTORY,
    ROOT,
    check_links,
    check_text,
    docs_named_in_code,
    layout_missing,
)

DOCS = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if HISTORY not in p.parents)]
ARCH = ROOT / "docs" / "ARCHITECTURE.md"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_reference_of_a_doc_exists(doc: Path) -> None:
    text = doc.read_text(encoding="utf-8")
    problems = check_text(text) + check_links(text, doc)
    assert not problems, f"{doc.relative_to(ROOT)} names what the code lacks:\n" + "\n".join(problems)


def test_history_links_resolve() -> None:
    problems = []
    for doc in sorted(HISTORY.rglob("*.md")):
        problems += [
            f"{doc.relative_to(ROOT)}: {q}" for q in check_links(doc.read_text(encoding="utf-8"), doc)
        ]
    assert not problems, "\n".join(problems)


def test_every_doc_the_code_names_exists() -> None:
    """Comments, docstrings and scripts that point at ``docs/...md``: a moved doc moves them too."""
    assert docs_named_in_code() == {}


def test_the_layout_table_lists_every_module() -> None:
    missing = layout_missing(ARCH.read_text(encoding="utf-8"))
    assert not missing, f"modules of src/shardgen missing from ARCHITECTURE.md's layout table: {missing}"


def test_planted_stale_references_are_reported() -> None:
    """Each kind of stale reference, planted into a copy of a clean doc, is reported, and
    nothing else is."""
    ((_, ncols),) = CONSTANTS["NCOLS"]
    planted = {
        "`core/nowhere.py`": "no file core/nowhere.py",
        "`fsdp2/nowhere.py`": "no file fsdp2/nowhere.py",
        "`tests/unit/test_nowhere.py`": "no file tests/unit/test_nowhere.py",
        "`benchmarks/nowhere.py --rounds 2`": "no file benchmarks/nowhere.py",
        "`nowhere_at_all.py`": "no file nowhere_at_all.py",
        "`tests/unit/test_doc_references.py::test_nothing_here`": "no test test_nothing_here",
        "`tests/helpers/example_runs.NO_SUCH_NAME`": "no NO_SUCH_NAME in example_runs.py",
        "`shardgen.core.nowhere`": "no symbol shardgen.core.nowhere",
        "`shardgen.Engine.no_such_method(x)`": "no symbol shardgen.Engine.no_such_method",
        "`Engine.no_such_method`": "no symbol Engine.no_such_method",
        "`engine.no_such_method()`": "no symbol engine.no_such_method",
        "`protocol.no_such_function`": "no symbol protocol.no_such_function",
        "`EngineConfig.no_such_field`": "no symbol EngineConfig.no_such_field",
        "`core/driver.py: Driver._no_such`": "no Driver._no_such in core/driver.py",
        "`_no_such` of `backends/fsdp2/shard.py`": "no _no_such in backends/fsdp2/shard.py",
        "`_per_layer_forward` of `core/driver.py`": "no _per_layer_forward in core/driver.py",
        f"`NCOLS` = {ncols - 2} columns": f"NCOLS is {ncols} in shardgen.core.protocol, not {ncols - 2}",
        f"`NCOLS` is {ncols + 1}.": f"not {ncols + 1}",
        f"`NCOLS = {ncols + 2}`": f"not {ncols + 2}",
    }
    clean = ARCH.read_text(encoding="utf-8")
    assert check_text(clean) == []
    problems = check_text(clean + "\n" + "\n".join(f"Planted: {ref}." for ref in planted))
    for ref, expected in planted.items():
        assert sum(expected in p for p in problems) == 1, (ref, expected, problems)
    assert len(problems) == len(planted), problems

    links = "[a](nowhere.md) [b](USAGE.md#no-such-heading) [c](USAGE.md#the-python-api) [d](https://x.org/y)"
    stale = ["link to missing nowhere.md", "link to missing anchor USAGE.md#no-such-heading"]
    assert check_links(links, ARCH) == stale


def test_a_module_left_out_of_the_layout_table_is_reported() -> None:
    arch = ARCH.read_text(encoding="utf-8")
    numerics_row = next(line for line in arch.splitlines() if line.startswith("| 6 | `numerics/` |"))
    assert layout_missing(arch.replace("`leaving.py`", "`leaving`")) == ["faults/leaving.py"]
    assert layout_missing(arch.replace(numerics_row + "\n", "")) == [
        "numerics/__init__.py", "numerics/mode.py", "numerics/ops.py"
    ]  # fmt: skip
    assert layout_missing(arch.replace("`shm.py`", "`shm`")) == ["backends/deepspeed/shm.py"]
