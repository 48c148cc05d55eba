"""The nearest known name to a mistyped one, for error messages: the CLI's flags (``flags.py``)
and a job's prompt fields (``jobs/prompts.py``) both say ``(did you mean X?)``."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def did_you_mean(word: str, known: Iterable[str]) -> str:
    """`` (did you mean X?)`` for the name in ``known`` nearest to ``word``, or ``""``."""
    match = difflib.get_close_matches(word, sorted(set(known)), n=1, cutoff=0.6)
    return f" (did you mean {match[0]}?)" if match else ""
