"""Validation rules for single settings: what one field's value must be, whatever door it came in by.

``config.py`` gives every field of ``SamplingParams`` and ``EngineConfig`` one ``Rule``; the
Python API, the CLI, the prompts file and ``ShardgenRollout`` all check through those tables, so
the same value gets the same answer everywhere. A rule's message names the field and the value:
``top_k must be an integer >= 0, got -1``. Plain Python, no torch.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Rule:
    """What a value must be (``what``, as messages say it) and the test of it; ``unset``: None
    is also fine (the field is optional)."""

    what: str
    test: Callable[[Any], bool]
    unset: bool = False

    def problem(self, name: str, value: Any) -> str | None:
        """None if ``value`` is fine for field ``name``, else the message naming both."""
        if value is None and self.unset:
            return None
        if self.test(value):
            return None
        return f"{name} must be {self.what}, got {value!r}"

    def optional(self) -> Rule:
        return Rule(self.what, self.test, unset=True)


def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_finite(v: Any) -> bool:  # NaN passes no comparison: "x > 0" alone would let it by
    if not isinstance(v, numbers.Real) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:  # an int past any float: as the CLI reads it (inf), not finite
        return False


def integer(low: int | None = None, high: int | None = None) -> Rule:
    """An integer (bools excluded), at least ``low`` and at most ``high`` when given."""
    if low is None:
        return Rule("an integer", _is_int)
    if high is not None:
        return Rule(f"an integer in {low}..{high}", lambda v: _is_int(v) and low <= v <= high)
    return Rule(f"an integer >= {low}", lambda v: _is_int(v) and v >= low)


def number(low: float, *, above: bool = False, high: float | None = None) -> Rule:
    """A finite real number >= ``low`` (> with ``above``), and <= ``high`` when given."""
    if high is not None:  # an interval: "top_p must be in (0, 1]"
        what = f"in {'(' if above else '['}{low:g}, {high:g}]"
    else:
        what = f"a finite number {'>' if above else '>='} {low:g}"

    def test(v: Any) -> bool:
        if not _is_finite(v):
            return False
        return (v > low if above else v >= low) and (high is None or v <= high)

    return Rule(what, test)


def boolean() -> Rule:
    return Rule("true or false", lambda v: isinstance(v, bool))


def one_of(choices: Iterable[str]) -> Rule:
    names = tuple(choices)
    return Rule(f"one of {', '.join(names)}", lambda v: isinstance(v, str) and v in names)


def token_ids() -> Rule:
    """A token id (an integer >= 0) or a list of them (several EOS ids; [] is none at all)."""

    def test(v: Any) -> bool:
        if isinstance(v, list | tuple):
            return all(_is_int(t) and t >= 0 for t in v)
        return _is_int(v) and v >= 0

    return Rule("a token id (an integer >= 0) or a list of them", test)


def strings() -> Rule:
    """A list of non-empty strings."""
    return Rule(
        "a list of non-empty strings",
        lambda v: isinstance(v, list | tuple) and all(isinstance(x, str) and x for x in v),
    )


def mapping() -> Rule:
    return Rule("a dict", lambda v: isinstance(v, dict))


def problems(rules: dict[str, Rule], values: dict[str, Any]) -> list[str]:
    """The message of every value in ``values`` its field's rule refuses, in ``rules``' order
    (fields without a rule are not judged here)."""
    out = []
    for name, rule in rules.items():
        if name in values:
            said = rule.problem(name, values[name])
            if said is not None:
                out.append(said)
    return out
