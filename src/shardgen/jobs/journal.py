"""Durable results: per-rank append-only journals (fsync per line), atomic file replace, reading back.

No collectives; each rank writes only its own journal, rank 0 merges.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
from collections.abc import Iterator, Sequence
from typing import Any

from shardgen.core.process import uninterrupted


def id_key(value: str | int) -> str:
    """Ids compare as strings: ``1`` and ``"1"`` are the same prompt (reported as duplicates)."""
    return str(value)


def journal_path(out: str, rank: int) -> str:
    return f"{out}.rank{rank}.journal.jsonl"


def journal_paths(out: str) -> list[str]:
    """Every rank's journal of ``out`` (also of ranks a resumed run no longer has)."""
    return sorted(glob.glob(f"{glob.escape(out)}.rank*.journal.jsonl"))


def _fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class Journal:
    """One rank's append-only result log: each line is flushed and fsync'ed before ``append`` returns.

    Opening repairs a torn last line (a crash in the middle of a write) by cutting it off, so
    the next append starts on a fresh line; a torn result is simply answered again.
    """

    def __init__(self, path: str, header: dict[str, Any] | None = None) -> None:
        self.path = path
        existed = os.path.exists(path)
        if existed:
            with open(path, "rb+") as f:
                data = f.read()
                keep = data.rfind(b"\n") + 1
                if keep != len(data):
                    f.truncate(keep)
        self._f = open(path, "a", encoding="utf-8")  # closed in close()
        if not existed:
            _fsync_dir(path)
        if header is not None and self._f.tell() == 0:
            self._write({"_job": header})

    def append(self, result: dict[str, Any]) -> None:
        self._write(result)

    def _write(self, obj: dict[str, Any]) -> None:
        with uninterrupted():  # a SIGINT / SIGTERM exit waits for the line to be on disk
            self._f.write(json.dumps(obj, ensure_ascii=False) + "\n")
            self._f.flush()
            os.fsync(self._f.fileno())
        # Removed under us, the file would take results nobody can read back: fail now, while
        # the other journals hold everything but this rank's lost lines (--resume redoes them).
        if os.fstat(self._f.fileno()).st_nlink == 0:
            raise OSError(f"journal {self.path} was removed while the job ran")

    def close(self) -> None:
        self._f.close()


def read_jsonl(path: str) -> Iterator[dict[str, Any]]:
    """The JSON objects of a journal or results file; unreadable (torn) lines are skipped."""
    try:
        f = open(path, encoding="utf-8")
    except FileNotFoundError:
        return
    with f:
        for line in f:
            with contextlib.suppress(ValueError):
                obj = json.loads(line)
                if isinstance(obj, dict):
                    yield obj


def journal_header(out: str) -> dict[str, Any] | None:
    """The job header of rank 0's journal, if a run of this ``out`` is unfinished."""
    for obj in read_jsonl(journal_path(out, 0)):
        return obj.get("_job") if isinstance(obj.get("_job"), dict) else None
    return None


def load_results(out: str, *, include_out: bool) -> dict[str, dict[str, Any]]:
    """Every result already written for ``out``, by id key; the first one wins (results are
    deterministic, so a result journaled twice after a crash-restart is the same)."""
    found: dict[str, dict[str, Any]] = {}
    sources = ([out] if include_out else []) + journal_paths(out)
    for path in sources:
        for obj in read_jsonl(path):
            if "id" in obj:
                found.setdefault(id_key(obj["id"]), obj)
    return found


def include_out_file(out: str, resume: bool) -> bool:
    """Do the results in an existing ``out`` count as done? Only when the run that wrote the
    journals (or this one, if there are none) was a resume: a fresh run replaces ``out``."""
    header = journal_header(out)
    return bool(header.get("include_out", resume)) if header is not None else resume


def atomic_write_text(path: str, lines: Iterator[str] | Sequence[str]) -> None:
    """Write ``path`` via ``path.tmp``, fsync and ``os.replace``: readers see the old file or the new one."""
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for line in lines:
                f.write(line)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # e.g. ENOSPC: leave the old file (or none) and no half-written temp
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    _fsync_dir(path)
