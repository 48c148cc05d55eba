"""Command-line flags built from config dataclasses: one ``--flag`` per field, help from its docstring.

A setting is declared once, as a dataclass field with a docstring under it (``EngineConfig``,
``SamplingParams``, ``JobConfig``, ...); this module turns fields into argparse flags, parsed
flags back into instances, and instances into the argv that rebuilds them (for the launcher).

Why not ``transformers.HfArgumentParser``: it takes help texts only from ``field.metadata``
(ours are the docstrings under the fields), maps whole dataclasses (the CLI exposes a chosen
subset of ``EngineConfig``/``SamplingParams``), rejects ``int | list[int] | None``
(``SamplingParams.eos_token_id``), adds an underscore spelling of every flag, and has no
subcommands; the adapters it would need are longer than this module.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import re
import textwrap
import types
import typing
from typing import Any

#: Extra spellings of a field's flag (the first is the one messages use).
FLAG_NAMES: dict[str, tuple[str, ...]] = {"max_batch_size": ("--batch-size", "--max-batch-size")}

Fields = tuple[str, ...] | None  # the fields of a dataclass that get flags (None: all)


def field_docs(cls: type) -> dict[str, str]:
    """``{name: docstring}`` from the string literal under each field (or enum member) of ``cls``."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, nxt in zip(body, body[1:], strict=False):
        target = node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        doc = nxt.value.value if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) else None
        if isinstance(target, ast.Name) and isinstance(doc, str):
            docs[target.id] = " ".join(doc.split())
    return docs


def flags_of(name: str) -> tuple[str, ...]:
    """The option strings of field ``name``: ``--max-new-tokens`` for ``max_new_tokens``."""
    return FLAG_NAMES.get(name, ("--" + name.replace("_", "-"),))


def _selected(cls: type, names: Fields) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if names is None or f.name in names]


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def add_fields(parser: argparse.ArgumentParser, cls: type, names: Fields = None) -> None:
    """One ``--flag`` per field of ``cls`` (in ``names``): type, default and help from the field."""
    docs, hints = field_docs(cls), typing.get_type_hints(cls)
    group = parser.add_argument_group(f"{cls.__name__} settings")
    for f in _selected(cls, names):
        tp = hints[f.name]
        if typing.get_origin(tp) in (typing.Union, types.UnionType):  # X | None -> X
            (tp,) = [a for a in typing.get_args(tp) if a is not type(None)]
        default = _default(f)
        text = docs.get(f.name, "").replace("``", "").removeprefix("(agreed) ").replace("%", "%%")
        if default not in (dataclasses.MISSING, None, False, []):
            text += f" (default: {default})"
        kw: dict[str, Any] = {"dest": f.name, "help": argparse.SUPPRESS if f.metadata.get("hidden") else text}
        if tp is bool:  # --flag, and --no-flag where the default is True
            kw["action"] = argparse.BooleanOptionalAction if default else "store_true"
        elif typing.get_origin(tp) is list:
            kw.update(type=typing.get_args(tp)[0], nargs="+", metavar=f.name.upper())
        else:
            kw.update(type=tp, metavar=flags_of(f.name)[0][2:].upper().replace("-", "_"))
        if default is dataclasses.MISSING:
            kw["required"] = True
        else:
            kw["default"] = default
        group.add_argument(*flags_of(f.name), **kw)


def build(cls: type, ns: argparse.Namespace, names: Fields = None) -> Any:
    """An instance of ``cls`` from the parsed flags (the fields without a flag keep their defaults)."""
    return cls(**{f.name: getattr(ns, f.name) for f in _selected(cls, names)})


def to_argv(obj: Any, names: Fields = None, skip: tuple[str, ...] = ()) -> list[str]:
    """The flags that rebuild ``obj`` (only the fields that differ from their defaults)."""
    argv: list[str] = []
    for f in _selected(type(obj), names):
        value = getattr(obj, f.name)
        if f.name in skip or value == _default(f):
            continue
        flag = flags_of(f.name)[0]
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    return argv


def flag_names(message: str, fields: tuple[tuple[type, Fields], ...]) -> str:
    """Say ``--batch-size`` where a validation message says ``max_batch_size``."""
    for cls, names in fields:
        for f in _selected(cls, names):
            message = re.sub(rf"(?<![-\w]){f.name}\b", flags_of(f.name)[0], message)
    return message
