"""Process-wide state of the open engines: the GIL switch interval and the exit guard.

``opened(driver, gil_switch_interval)`` when an engine starts, ``closed(driver)`` when it is
torn down (user thread, not collective).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import weakref
from typing import Any

from shardgen.log import get_logger

log = get_logger()
_DRIVERS: weakref.WeakSet[Any] = weakref.WeakSet()  # the drivers of open engines
_SAVED_SWITCH: list[float] = []


def opened(driver: Any, gil_switch_interval: float | None) -> None:
    """An engine started: guard its driver at exit; lower the switch interval.

    A user thread spinning in pure Python holds the GIL for a whole switch interval each
    time the driver wants it (after every op): benchmarks/spin.py measures it.
    """
    _DRIVERS.add(driver)
    if gil_switch_interval is None:
        return
    current = sys.getswitchinterval()
    if not _SAVED_SWITCH:
        _SAVED_SWITCH.append(current)
    if gil_switch_interval < current:
        sys.setswitchinterval(gil_switch_interval)


def closed(driver: Any) -> None:
    """An engine was torn down; the last one restores the switch interval."""
    _DRIVERS.discard(driver)
    if not _DRIVERS and _SAVED_SWITCH:
        sys.setswitchinterval(_SAVED_SWITCH.pop())


@atexit.register
def _exit_guard() -> None:
    """At interpreter exit, a failed engine may leave gloo work that never completes (a driver
    stuck in a gather, or a tick's all-reduce abandoned when the verdict came): the groups'
    destructors would join gloo's worker threads until the group timeout. Leave at once,
    non-zero, instead (after rank 0's ``liveness.linger``, registered later, so run first)."""
    for drv in list(_DRIVERS):
        failed = drv.shared.failed
        if failed is not None:
            log.error("rank %d: exiting after: %s", drv.rank, failed)
            for h in [*log.handlers, sys.stdout, sys.stderr]:
                with contextlib.suppress(Exception):
                    h.flush()
            os._exit(1)
