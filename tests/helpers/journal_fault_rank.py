"""One rank of ``shardgen run`` with a disk fault injected (launched by torchrun in
tests/multirank/test_journal_faults.py): ``SHARDGEN_FAULT`` names the fault, ``SHARDGEN_FAULT_RANK`` the
rank that meets it, ``SHARDGEN_FAULT_AFTER`` how many results it journals first.

- ``enospc-write``: the next journal line is half written, then ENOSPC (a torn line on disk);
- ``enospc-fsync``: the line is written, its fsync fails with ENOSPC;
- ``remove``: the rank's journal file is deleted before its next line;
- ``kill-merge-tmp``: rank 0 is SIGKILLed half-way through writing ``--out``'s temp file;
- ``kill-merge-replaced``: rank 0 is SIGKILLed after ``--out`` is in place, before the journals go.
"""

from __future__ import annotations

import errno
import os
import signal
import sys

from shardgen.jobs import journal
from shardgen.jobs import run as jobs

FAULT = os.environ.get("SHARDGEN_FAULT", "")
ME = int(os.environ.get("RANK", "0")) == int(os.environ.get("SHARDGEN_FAULT_RANK", "1"))
AFTER = int(os.environ.get("SHARDGEN_FAULT_AFTER", "3"))


def _die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _inject() -> None:
    real_write, real_atomic, real_remove = journal.Journal._write, jobs.atomic_write_text, os.remove
    written = [0]

    def write(self: journal.Journal, obj: dict) -> None:
        if "id" in obj:
            written[0] += 1
            if written[0] > AFTER:
                line = journal.json.dumps(obj) + "\n"
                if FAULT == "enospc-write":
                    self._f.write(line[: len(line) // 2])
                    self._f.flush()
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.path)
                if FAULT == "enospc-fsync":
                    self._f.write(line)
                    self._f.flush()
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.path)
                if FAULT == "remove" and written[0] == AFTER + 1:
                    real_remove(self.path)
        real_write(self, obj)

    def atomic(path: str, lines) -> None:
        lines = list(lines)
        if FAULT == "kill-merge-tmp":
            with open(f"{path}.tmp", "w", encoding="utf-8") as f:
                f.writelines(lines[: len(lines) // 2])
            _die()
        real_atomic(path, lines)

    def remove(path: str) -> None:
        if FAULT == "kill-merge-replaced" and path.endswith(".journal.jsonl"):
            _die()
        real_remove(path)

    journal.Journal._write = write  # type: ignore[method-assign]
    jobs.atomic_write_text = atomic  # merge_results' own name for it
    os.remove = remove  # type: ignore[assignment]


if __name__ == "__main__":
    if ME and FAULT:
        _inject()
    from shardgen.cli.command import main

    sys.exit(main(sys.argv[1:]))
