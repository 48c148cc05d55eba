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
import functools
import inspect
import re
import textwrap
import types
import typing
from typing import Any

from shardgen.suggest import did_you_mean

#: Extra spellings of a field's flag (the first is the one messages use).
FLAG_NAMES: dict[str, tuple[str, ...]] = {"max_batch_size": ("--batch-size", "--max-batch-size")}

Fields = tuple[str, ...] | None  # the fields of a dataclass that get flags (None: all)


def field_docs(cls: type) -> dict[str, str]:
    """``{name: docstring}`` from the string literal under each field (or enum member) of ``cls``
    (a copy: the source is parsed once per class and process)."""
    return dict(_field_docs(cls))


@functools.cache
def _field_docs(cls: type) -> dict[str, str]:
    # Once per class: every parser (one per CLI call, thousands in the input fuzz) reads the same
    # docs, and CPython 3.11's ast.parse can fail spuriously ("AST constructor recursion depth
    # mismatch") under a recursion limit raised meanwhile, as hypothesis does.
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


def help_text(doc: str) -> str:
    """A field's docstring as CLI help: no reST markup, ``unset`` where the API says None."""
    text = doc.replace("``", "").removeprefix("(agreed) ").replace("%", "%%")
    text = re.sub(r"\bNone\b", "unset", text)
    return re.sub(r"(^|\. )unset", r"\1Unset", text)


def _shown(value: Any) -> str:
    """A default as the user would type it: lists space-separated."""
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


def add_fields(
    parser: argparse.ArgumentParser, cls: type, names: Fields = None, title: str | None = None
) -> None:
    """One ``--flag`` per field of ``cls`` (in ``names``): type, default and help from the field.

    ``title``: the help section the flags go under (None: the parser's own ``options``). A field's
    ``metadata["choices"]`` become the flag's choices (shown in ``--help``, checked by argparse);
    ``metadata["hidden"]`` hides the flag from ``--help``.
    """
    docs, hints = field_docs(cls), typing.get_type_hints(cls)
    group = parser.add_argument_group(title) if title else parser
    for f in _selected(cls, names):
        tp = hints[f.name]
        if typing.get_origin(tp) in (typing.Union, types.UnionType):  # X | None -> X
            (tp,) = [a for a in typing.get_args(tp) if a is not type(None)]
        default = _default(f)
        choices = f.metadata.get("choices")
        text = help_text(docs.get(f.name, ""))
        if choices is not None and isinstance(default, list) and default == list(choices):
            text += " (default: all)"
        elif default not in (dataclasses.MISSING, None, []) and default is not False:
            text += f" (default: {_shown(default)})"
        kw: dict[str, Any] = {"dest": f.name, "help": argparse.SUPPRESS if f.metadata.get("hidden") else text}
        metavar = flags_of(f.name)[0][2:].upper().replace("-", "_")
        if tp is bool:  # --flag, and --no-flag where the default is True
            kw["action"] = argparse.BooleanOptionalAction if default else "store_true"
        elif typing.get_origin(tp) is list:
            (item,) = typing.get_args(tp)
            kw.update(type=item, nargs="+", metavar=metavar.removesuffix("S"))
        else:
            kw.update(type=tp, metavar=metavar)
        if choices is not None:
            kw["choices"] = tuple(choices)
            if typing.get_origin(tp) is not list:
                kw.pop("metavar")  # argparse shows {a,b,c}
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


class CommandParser(argparse.ArgumentParser):
    """A subcommand's parser: it rejects the arguments it does not know itself, with its own usage
    and the nearest flag it has (argparse leaves them to the top-level parser, whose usage names
    only the subcommands, and suggests nothing)."""

    _parsing: list[str] | None = None

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        self._parsing = list(args) if args is not None else None
        ns, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(self.unknown_message(extras))
        return ns, extras

    def error(self, message: str):  # type: ignore[override]
        # argparse checks required flags before it returns the unknown ones, so a mistyped flag
        # (``--temprature``, ``--prompt``) would be hidden behind "required": name it first.
        if message.startswith("the following arguments are required") and self._parsing:
            known = {s for a in self._actions for s in a.option_strings}
            unknown = [x for x in self._parsing if x.startswith("--") and x.split("=", 1)[0] not in known]
            if unknown:
                message = f"{self.unknown_message(unknown)}; {message}"
        super().error(message)

    def unknown_message(self, extras: list[str]) -> str:
        known = [
            s
            for a in self._actions
            if a.help is not argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)
            for s in a.option_strings
            if s.startswith("--")
        ]
        flags = [x.split("=", 1)[0] for x in extras if x.startswith("-")]
        hints = {flag: hint for flag in flags if (hint := did_you_mean(flag, known))}
        said = f"unrecognized arguments: {' '.join(extras)}"
        if len(hints) == 1 and len(flags) == 1:
            return said + next(iter(hints.values()))
        return said + "".join(f"; {flag}{hint}" for flag, hint in hints.items())
