"""What a model name given as a local path says when it does not exist. Imports nothing heavy: the
``shardgen`` command checks its ``--model`` with it before any rank (or torch) starts."""

from __future__ import annotations

import os


def looks_like_path(name: str) -> bool:
    """``name`` can only be a local path, never a hub id (``repo`` or ``namespace/repo``): it
    starts with ``.``, ``/`` or ``~``, has more than one ``/``, or a ``\\`` (Windows)."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or "\\" in name


def missing_model_path(name: str) -> str | None:
    """What to say of a model ``name`` that can only be a local path and does not exist
    (``model path ... does not exist``: ``shardgen run --model`` and ``Engine.from_pretrained``
    both say it, instead of the hub's "Repo id must be in the form ..."); None otherwise. ``~`` is
    the user's home, as in a shell."""
    if looks_like_path(name) and not os.path.exists(os.path.expanduser(name)):
        return f"model path {name} does not exist"
    return None
