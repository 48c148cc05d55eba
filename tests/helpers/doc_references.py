"""Which of a doc's references to the code do not exist: the checker of tests/unit/test_doc_references.py.

A reference is checked where it can be resolved reliably, and skipped where it names something
outside the project (torch, DeepSpeed, a user's variable):

- file paths in backticks: repository paths (``tests/helpers/world.py``, ``benchmarks/x.py --flag``,
  ``tests/unit/test_x.py::test_name``: the file, and the test in it), paths under ``src/shardgen``
  (``core/driver.py``, ``fsdp2/__init__.py``, ``shardgen/config.py``), bare module files
  (``shard.py``: some file of the project), ``tests/helpers/module.NAME``;
- dotted names in backticks: ``shardgen.x.y``, ``Class.attr`` for a class of shardgen,
  ``module.attr`` for a module of shardgen named by its last part, and ``var.attr`` for the
  variables the docs use for shardgen's objects (``VARIABLES``);
- ``path: Symbol.attr`` in one span, and "`symbol` of `path`": the symbol is defined in that file;
- constants stated as ``NAME = value`` in a span, or `` `NAME` = value`` / `` `NAME` is value``,
  for a module-level constant of shardgen with a literal value;
- markdown links to files (and their ``#anchors``), relative to the doc.

Names are resolved from the sources' syntax trees, as Python would bind them (imports followed,
classes' bodies, bases and ``self.x`` assignments), never by importing shardgen: its modules
import torch, transformers, DeepSpeed and TRL, most of a minute of CPU under load.
"""

from __future__ import annotations

import ast
import fnmatch
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "shardgen"
HISTORY = ROOT / "docs" / "history"  # how things came to be: links checked, not references
REPO_DIRS = ("src", "tests", "benchmarks", "examples", "scripts", "docs")
FILE_EXT = (".py", ".md", ".sh", ".sbatch", ".toml", ".json", ".txt")
EXT_WORDS = {e.lstrip(".") for e in FILE_EXT}  # ``batch.py`` is a file, not ``batch``'s ``py``

# The docs' names for shardgen's objects (``engine.stats()``): ``var.attr`` is checked on these.
VARIABLES: dict[str, tuple[str, ...]] = {
    "engine": ("shardgen.core.engine.Engine",),
    "teacher": ("shardgen.core.engine.Engine",),
    "batch": ("shardgen.generation.rollout.RolloutBatch", "shardgen.generation.score.ScoreBatch"),
    "sb": ("shardgen.generation.score.ScoreBatch",),
    "completion": ("shardgen.generation.requests.Completion",),
    "params": ("shardgen.config.SamplingParams",),
    "rollout": ("shardgen.integrations.deepspeed.ShardgenRollout",),
}
# Heads of ``a.b`` that are a shardgen module's last part but name another project's object in
# the docs: a model's HF config (``config.vision_config``), DeepSpeed (``deepspeed.initialize``,
# ``groups.mpu``).
NOT_OURS = {"config", "deepspeed", "groups"}
# Bare file names that are not the project's files: the README's programs, placeholders.
FOREIGN_FILES = {"quickstart.py", "zero3.py", "rl.py", "NAME.py"}


def _modules() -> dict[str, Path]:
    """``{dotted module name: file}`` for every module of src/shardgen."""
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()
# Bases whose own attributes the docs never name through a shardgen class: a class on them is
# checked on its own body alone. Any other foreign base (nn.Module, TRL's trainer) makes a
# name the class lacks unknown rather than missing.
PLAIN_BASES = {"object", "str", "int", "Enum", "IntEnum", "NamedTuple", "Generic"}
PLAIN_BASES |= {"Exception", "RuntimeError", "ValueError"}

# What a name is: ("module", dotted), ("class", module, name), ("import", module, name) (bound by
# ``from module import name``), or ("value",) for anything whose attributes are not known here.
Ref = tuple[str, ...]


@cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def _top(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """A module's statements, into ``if``/``try`` blocks (TYPE_CHECKING imports), not into defs."""
    for node in body:
        yield node
        if isinstance(node, ast.If | ast.Try):
            for block in (node.body, node.orelse, *[h.body for h in getattr(node, "handlers", [])]):
                yield from _top(block)


def _targets(node: ast.stmt) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        return [e for t in node.targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
    return [node.target] if isinstance(node, ast.AnnAssign) else []


@cache
def _namespace(mod: str, path: Path) -> dict[str, Ref]:
    """The module-level names of module ``mod`` (file ``path``) and what each is."""
    names: dict[str, Ref] = {}
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    for node in _top(_tree(path).body):
        if isinstance(node, ast.ClassDef):
            names[node.name] = ("class", mod, node.name)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names[node.name] = ("value",)
        elif isinstance(node, ast.ImportFrom):
            up = package.split(".")[: len(package.split(".")) + 1 - node.level]  # from .x / from ..x
            src = ".".join([*up, node.module or ""]).strip(".") if node.level else node.module or ""
            for alias in node.names:
                sub = f"{src}.{alias.name}"
                ours = ("import", src, alias.name) if src in MODULES else ("value",)
                names[alias.asname or alias.name] = ("module", sub) if sub in MODULES else ours
        elif isinstance(node, ast.Import):
            for alias in node.names:
                names[alias.asname or alias.name.split(".")[0]] = ("value",)
        for t in _targets(node):
            if isinstance(t, ast.Name):
                names[t.id] = ("value",)
    return names


@cache
def _class_members(mod: str, name: str) -> tuple[dict[str, Ref], list[ast.expr]]:
    """A class's own attributes (body, ``self.x`` in its methods) and its bases."""
    node = next(n for n in _top(_tree(MODULES[mod]).body) if isinstance(n, ast.ClassDef) and n.name == name)
    members: dict[str, Ref] = {}
    for item in node.body:
        if isinstance(item, ast.ClassDef):
            members[item.name] = ("value",)
        elif isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
            members[item.name] = ("value",)
        for t in _targets(item):
            if isinstance(t, ast.Name):
                members[t.id] = ("value",)
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store):
            if isinstance(sub.value, ast.Name) and sub.value.id == "self":
                members.setdefault(sub.attr, ("value",))
    return members, node.bases


def _follow(ref: Ref) -> Ref:
    while ref[0] == "import":
        ref = _namespace(ref[1], MODULES[ref[1]]).get(ref[2], ("value",))
    return ref


def _attr(ref: Ref, name: str) -> Ref | None | bool:
    """What ``name`` of ``ref`` is; None if it has none; True if that cannot be known here."""
    ref = _follow(ref)
    if ref[0] == "module":
        found = _namespace(ref[1], MODULES[ref[1]]).get(name)
        if found is None and f"{ref[1]}.{name}" in MODULES:
            return ("module", f"{ref[1]}.{name}")
        return found
    if ref[0] == "class":
        members, bases = _class_members(ref[1], ref[2])
        if name in members:
            return members[name]
        unknown = False
        for base in bases:
            base = base.value if isinstance(base, ast.Subscript) else base
            words = ast.unparse(base).split(".")
            if words[-1] in PLAIN_BASES:
                continue
            found = _resolve_words(ref[1], words)
            if isinstance(found, tuple) and found[0] == "class":
                inherited = _attr(found, name)
                if inherited is not None:
                    return inherited
            else:
                unknown = True
        return True if unknown else None
    return True


def _resolve_words(mod: str, words: list[str]) -> Ref | None | bool:
    ref: Ref | None | bool = _namespace(mod, MODULES[mod]).get(words[0])
    for word in words[1:]:
        if not isinstance(ref, tuple):
            return ref
        ref = _attr(ref, word)
    return ref


def _walk(ref: Ref, attrs: list[str]) -> bool:
    """Every one of ``attrs`` exists, from ``ref`` on, as far as it can be known."""
    for name in attrs:
        found = _attr(ref, name)
        if found is None:
            return False
        if found is True:
            return True
        ref = found
    return True


def _index() -> tuple[dict[str, list[str]], dict[str, list[str]], dict[str, list[tuple[str, Any]]]]:
    """Classes and short module names to their modules; module-level literal constants."""
    classes: dict[str, list[str]] = {}
    short: dict[str, list[str]] = {}
    constants: dict[str, list[tuple[str, Any]]] = {}
    for mod, path in MODULES.items():
        short.setdefault(mod.rsplit(".", 1)[-1], []).append(mod)
        for node in _tree(path).body:
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, []).append(mod)
            value = getattr(node, "value", None)
            for t in _targets(node):
                if value is not None and isinstance(t, ast.Name) and re.fullmatch(r"[A-Z][A-Z0-9_]+", t.id):
                    try:
                        constants.setdefault(t.id, []).append((mod, ast.literal_eval(value)))
                    except (ValueError, TypeError):
                        pass  # not a literal: not stated as a number in a doc either
    return classes, short, constants


CLASSES, SHORT, CONSTANTS = _index()


def resolve_symbol(name: str) -> bool | None:
    """True if ``name`` (``a.b.c``) exists, False if it is shardgen's and does not, None if it
    is not shardgen's (unchecked)."""
    head, *attrs = name.split(".")
    if head == "shardgen":
        return _walk(("module", "shardgen"), attrs)
    if head in VARIABLES:
        return any(_walk(("class", *c.rsplit(".", 1)), attrs) for c in VARIABLES[head])
    if head in CLASSES:
        return any(_walk(("class", m, head), attrs) for m in CLASSES[head])
    if head in SHORT and head not in NOT_OURS:
        return any(_walk(("module", m), attrs) for m in SHORT[head])
    return None


@cache
def _project_files() -> list[Path]:
    """Every file of the repository's own folders (a bare ``shard.py`` names one of them)."""
    return [p for d in REPO_DIRS[1:] for p in (ROOT / d).rglob("*") if ".venv" not in p.parts] + list(
        SRC.rglob("*")
    )


@cache
def _src_entries() -> list[str]:
    """Every file and folder under src/shardgen, relative, folders with a trailing ``/``."""
    return [str(p.relative_to(SRC)) + ("/" if p.is_dir() else "") for p in SRC.rglob("*")]


def resolve_path(token: str) -> Path | bool | None:
    """The file a path names (True: a folder or a glob that matches), False if it is the project's
    and does not exist, None if it is not the project's."""
    if token.split("/")[0] in REPO_DIRS:
        hits = list(ROOT.glob(token.rstrip("/")))
        return (hits[0] if len(hits) == 1 and hits[0].is_file() else True) if hits else False
    rel = token.removeprefix("shardgen/")
    if "/" not in rel:
        if token in FOREIGN_FILES or not rel.endswith(".py"):
            return None
        return True if any(fnmatch.fnmatch(p.name, rel) for p in _project_files()) else False
    if rel.split("/")[0] not in {e.rstrip("/").rpartition("/")[2] for e in _src_entries() if e.endswith("/")}:
        return None  # its first folder is none of shardgen's: another project's path
    hits = [e for e in _src_entries() if e == rel or e.endswith("/" + rel)]
    return (True if rel.endswith("/") else SRC / hits[0]) if hits else False


def _defines(path: Path, symbol: str) -> bool:
    """``symbol`` (``f``, ``Class.attr``, or a method of a class there) is defined in file ``path``."""
    mod = ".".join(path.relative_to(ROOT).with_suffix("").parts[1:]).removesuffix(".__init__")
    if path.is_relative_to(SRC):
        if _walk(("module", mod), symbol.split(".")):
            return True
        classes = [n.name for n in _tree(path).body if isinstance(n, ast.ClassDef)]
        return "." not in symbol and any(symbol in _class_members(mod, c)[0] for c in classes)  # a method
    return symbol.split(".")[0] in _namespace(mod, path)


SPAN = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^ *```.*?^ *```", re.S | re.M)
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
CONST_IN_SPAN = re.compile(r"([A-Z][A-Z0-9_]+) = (\S+)")
CONST_IN_PROSE = re.compile(r"`([A-Z][A-Z0-9_]+)`\s*(?:=|is)\s*`?([\w.'\"-]+)")
OF_PATH = re.compile(r"`(\w+)` of `([\w/]+\.py)`")


def _path_tokens(span: str) -> Iterator[str]:
    for raw in span.split():
        token = raw.strip("(),;'\"")
        if "/" in token or token.endswith(FILE_EXT):
            if not token.startswith(("~", "http", "-", "/", "$", ".")) and re.fullmatch(r"[\w./*:-]+", token):
                yield token


def _check_path(token: str) -> str | None:
    token, _, test = token.partition("::")
    token = token.rstrip(":")
    m = re.fullmatch(r"(tests|scripts|benchmarks|examples)/((?:\w+/)*\w+)\.([A-Za-z_]\w*)", token)
    if m and m.group(3) not in EXT_WORDS:
        path = ROOT / m.group(1) / f"{m.group(2)}.py"
        if not path.is_file():
            return f"no file {m.group(1)}/{m.group(2)}.py"
        return None if _defines(path, m.group(3)) else f"{token}: no {m.group(3)} in {path.name}"
    if not (token.endswith(FILE_EXT) or token.endswith("/") or "*" in token or test):
        return None
    found = resolve_path(token)
    if found is False:
        return f"no file {token}"
    if test and isinstance(found, Path):
        if f"def {test.split('[')[0]}(" not in found.read_text(encoding="utf-8"):
            return f"no test {test} in {token}"
    return None


def check_text(text: str) -> list[str]:
    """Every reference of a doc's text (outside fenced blocks) that names nothing in the code."""
    text = FENCE.sub("", text)
    problems: list[str] = []
    for span in SPAN.findall(text):
        for token in _path_tokens(span):
            if (p := _check_path(token)) is not None:
                problems.append(p)
        m = re.fullmatch(r"([\w/.]+\.py):\s*([\w.]+)", span)
        if m:
            path = resolve_path(m.group(1))
            if isinstance(path, Path) and path.is_relative_to(SRC) and not _defines(path, m.group(2)):
                problems.append(f"no {m.group(2)} in {m.group(1)}")
            continue
        m = DOTTED.match(span)
        if m and "/" not in span and not span.startswith(m.group(0) + "/"):
            name = m.group(0)
            if name.rsplit(".", 1)[-1] not in EXT_WORDS and resolve_symbol(name) is False:
                problems.append(f"no symbol {name}")
        m = CONST_IN_SPAN.fullmatch(span)
        if m:
            problems += _check_constant(m.group(1), m.group(2))
    for name, value in CONST_IN_PROSE.findall(text):
        problems += _check_constant(name, value.rstrip(".:"))
    for symbol, path in OF_PATH.findall(text):
        found = resolve_path(path)
        if isinstance(found, Path) and not _defines(found, symbol):
            problems.append(f"no {symbol} in {path}")
    return problems


def _check_constant(name: str, stated: str) -> list[str]:
    try:
        value = ast.literal_eval(stated)
    except (ValueError, SyntaxError):
        return []  # prose, not a value
    values = {repr(v) for _, v in CONSTANTS.get(name, [])}
    if len(values) == 1 and repr(value) not in values:
        return [f"{name} is {values.pop()} in {CONSTANTS[name][0][0]}, not {stated}"]
    return []


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def check_links(text: str, doc: Path) -> list[str]:
    """Every relative markdown link of ``text`` (the doc at ``doc``) to a missing file or anchor."""
    problems = []
    for target in LINK.findall(FENCE.sub("", text)):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            problems.append(f"link to missing {target}")
        elif anchor and dest.suffix == ".md":
            heads = re.findall(r"^#+ (.*)$", FENCE.sub("", dest.read_text(encoding="utf-8")), re.M)
            if anchor not in {slug(h) for h in heads}:
                problems.append(f"link to missing anchor {target}")
    return problems


HEADER = re.compile(r"`(\w+)/`(?::| \()")


def layout_missing(arch: str) -> list[str]:
    """The modules of src/shardgen that ARCHITECTURE.md's "Layout" table (text ``arch``) leaves
    out. A row is a folder (``core/``: its files by name in the row, a sub-folder's files after
    its "`sub/`:" or "`sub/` (") or one module (``integrations/trl.py``); "top level" holds the
    package's own files; ``__init__.py`` and ``__main__.py`` stand for their folder, the
    package's own in the text under the table."""
    section = arch.split("\n## Layout", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and not set(cells[0]) <= set("-") and cells[0] != "layer":
            rows[cells[1].strip("`")] = cells[2]
    missing = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        top, name, dunder = rel.parts[0], rel.name, rel.name.startswith("__")
        if len(rel.parts) == 1:  # the package's own: its dunders may be named as shardgen/__init__.py
            if not re.search(rf"[`/]{re.escape(name)}`", section if dunder else rows.get("top level", "")):
                missing.append(str(rel))
            continue
        row = rows.get(top + "/")
        if str(rel) in rows or (row is None and dunder and any(k.startswith(top + "/") for k in rows)):
            continue
        text = row or ""
        if len(rel.parts) > 2:  # a sub-folder's file: in that sub-folder's part of the row
            heads = list(HEADER.finditer(text))
            ends = [h.start() for h in heads[1:]] + [len(text)]
            text = "".join(
                text[h.end() : e] for h, e in zip(heads, ends, strict=True) if h.group(1) == rel.parts[-2]
            )
        if not text if dunder else f"`{name}`" not in text:
            missing.append(str(rel))
    return missing


def docs_named_in_code() -> dict[str, list[str]]:
    """``{file of the code: [docs/... paths it names that do not exist]}``, for the code's
    comments, docstrings and messages that point at a doc."""
    out = {}
    files = [ROOT / "Makefile", ROOT / "pyproject.toml"]
    files += [p for d in REPO_DIRS[:-1] for p in sorted((ROOT / d).rglob("*")) if p.suffix in (".py", ".sh")]
    for path in files:
        named = set(re.findall(r"\bdocs/[\w/.-]*\w\.md\b", path.read_text(encoding="utf-8")))
        missing = sorted(n for n in named if not (ROOT / n).is_file())
        if missing:
            out[str(path.relative_to(ROOT))] = missing
    return out
