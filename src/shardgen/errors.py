"""shardgen's exceptions and the CLI's exit codes.

User mistakes in the Python API are ``ValueError``s; ``ShardgenError`` and its subclasses are the
distributed failures; ``JobError`` carries a batch job's user-fixable problem and its ``ExitCode``.
"""

from __future__ import annotations

import enum


class ShardgenError(RuntimeError):
    """Base class of shardgen's distributed failures."""


class CollectiveDivergenceError(ShardgenError):
    """Ranks issued different collective sequences (found by ``debug_collectives``)."""


class PeerFailedError(ShardgenError):
    """A peer rank's engine raised; the message carries its exception type and text."""


class PeerStalledError(ShardgenError):
    """A peer rank stopped sending heartbeats for longer than ``stall_timeout``."""


class RendezvousTimeoutError(ShardgenError):
    """Some ranks never reached a collective point (construction, close) within the timeout."""


class EngineClosedError(RuntimeError):
    """The engine was used after ``close()``."""


# ---------------------------------------------------------------------------------- the CLI's exits


class ExitCode(enum.IntEnum):
    """Exit codes of ``shardgen run`` / ``demo`` / ``bench`` (each command's in its ``--help``; all
    in the README)."""

    OK = 0
    FAILED = 1
    """the job failed while running (a rank crashed or raised; journals are intact: rerun with --resume)"""
    USAGE = 2
    """bad command line (unknown flag, invalid value, --out folder not writable, journals of an
    unfinished run without --resume)"""
    NO_PROMPTS = 3
    """prompts file missing, unreadable or empty"""
    BAD_PROMPTS = 4
    """prompts file invalid: malformed JSON, missing or non-string prompt, duplicate or bad id,
    unknown or invalid field, an EOS or pad id outside the model's vocabulary (the message names
    file:line of each bad line, up to 20, and every problem of it)"""
    BAD_MODEL = 5
    """model path missing or unreadable"""
    WRONG_ANSWERS = 6
    """``shardgen demo`` only: some answer is wrong or missing"""
    TIMEOUT = 7
    """``shardgen demo`` and ``shardgen bench``: the job did not finish within ``--timeout``"""
    INTERRUPTED = 130
    """interrupted by SIGINT (Ctrl-C): one line says how many prompts are journaled and the command
    that resumes the job"""
    TERMINATED = 143
    """stopped by SIGTERM (a scheduler, ``kill``): the same line; resume with --resume"""


class JobError(Exception):
    """A problem the user can fix; the CLI prints ``str(self)`` on one line and exits ``code``."""

    def __init__(self, code: ExitCode, message: str) -> None:
        super().__init__(message)
        self.code = code
