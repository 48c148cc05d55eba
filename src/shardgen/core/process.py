"""Process-wide state of the open engines: the GIL switch interval, the exit guard, the report
of an uncaught exception to the engines' peers; and a job's quiet exit on SIGINT / SIGTERM
(``exit_on_signals``, ``uninterrupted``).

``opened(driver, gil_switch_interval)`` when an engine starts, ``closed(driver)`` when it is
torn down (user thread, not collective).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from shardgen.log import get_logger

log = get_logger()
_DRIVERS: weakref.WeakSet[Any] = weakref.WeakSet()  # the drivers of open engines
_LOWERED: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()  # driver -> its interval
_PAUSED: weakref.WeakSet[Any] = weakref.WeakSet()  # drivers inside a pause (no forward to pace)
_SAVED_SWITCH: list[float] = []


def opened(driver: Any, gil_switch_interval: float | None) -> None:
    """An engine started: guard its driver at exit; lower the switch interval.

    A user thread spinning in pure Python holds the GIL for a whole switch interval each
    time the driver wants it (after every op): benchmarks/spin.py measures it.
    """
    _DRIVERS.add(driver)
    _hook_uncaught()
    if gil_switch_interval is None:
        return
    if not _SAVED_SWITCH:
        _SAVED_SWITCH.append(sys.getswitchinterval())
    _LOWERED[driver] = gil_switch_interval
    _apply()


def paused(driver: Any, inside: bool) -> None:
    """``driver`` enters (``inside``) or leaves a pause. While every open engine is paused no
    driver has a forward to pace, so the interpreter's own switch interval is back: the user's
    training step is not made to hand the GIL to every waking thread within 0.2 ms."""
    if inside:
        _PAUSED.add(driver)
    else:
        _PAUSED.discard(driver)
    _apply()


def _apply() -> None:
    if not _SAVED_SWITCH:
        return
    saved = _SAVED_SWITCH[0]
    running = [v for d, v in list(_LOWERED.items()) if d not in _PAUSED]  # closed() drops a driver
    want = min([saved, *running])
    if sys.getswitchinterval() != want:
        sys.setswitchinterval(want)


def closed(driver: Any) -> None:
    """An engine was torn down; the last one restores the switch interval."""
    _DRIVERS.discard(driver)
    _PAUSED.discard(driver)
    _LOWERED.pop(driver, None)
    if not _DRIVERS and _SAVED_SWITCH:
        sys.setswitchinterval(_SAVED_SWITCH.pop())
    else:
        _apply()


#: How long the exit guard gives the GIL away before the interpreter finalizes (see below).
EXIT_GIL_HANDOFF_S = 0.05


@atexit.register
def _exit_guard() -> None:
    """At interpreter exit, a failed engine may leave gloo work that never completes (a driver
    stuck in a gather, or a tick's all-gather abandoned when the verdict came): the groups'
    destructors would join gloo's worker threads until the group timeout. Leave at once,
    non-zero, instead (after rank 0's ``liveness.linger``, registered later, so run first).

    Otherwise, give the GIL away for a moment before the interpreter finalizes. A gloo worker
    thread drops a finished collective's work object after the caller's ``wait()`` returned;
    dropping the work's tensors takes the GIL. When the last collective came just before exit
    (a tick's all-gather, a script's final barrier), the worker can ask for the GIL while the
    main thread finalizes: Python then ends the worker with ``pthread_exit``, whose unwinding
    through gloo's ``noexcept`` destructor calls ``std::terminate``, and a rank whose work was
    done exits with SIGABRT ("terminate called without an active exception"; seen in a core
    dump here: ``ProcessGroupGloo::runLoop`` -> ``~AsyncAllreduceWork`` ->
    ``TensorImpl::decref_pyobject`` -> ``take_gil`` -> ``PyThread_exit_thread``). A worker
    waiting for the GIL takes it as soon as the main thread sleeps.

    shardgen's own end of a process does not rely on this: the tick's buffer never needs the GIL
    when a worker releases it (``ControlPlane._pin``) and ``shardgen run`` ends with no gloo
    collective (its reports go through the store). The hand-off is for the collectives shardgen
    does not own: the program's own (a final barrier) and the backends' weight gathers."""
    for drv in list(_DRIVERS):
        failed = drv.shared.failed
        if failed is not None:
            log.error("rank %d: exiting after: %s", drv.rank, failed)
            for h in [*log.handlers, sys.stdout, sys.stderr]:
                with contextlib.suppress(Exception):
                    h.flush()
            os._exit(1)
    if "torch.distributed" in sys.modules:
        time.sleep(EXIT_GIL_HANDOFF_S)


_HOOKED: list[Any] = []  # the excepthook found before ours, once hooked


def _hook_uncaught() -> None:
    """Chain ``sys.excepthook`` once: an uncaught exception ends this process, so every open
    engine's peers are told at once which rank leaves and why (``faults/leaving.py``), rather
    than finding its heartbeats gone (``stall_timeout`` on another host)."""
    if _HOOKED:
        return
    _HOOKED.append(sys.excepthook)

    def hook(tp: Any, exc: BaseException, tb: Any) -> None:
        from shardgen.faults import leaving

        for drv in list(_DRIVERS):
            with contextlib.suppress(Exception):
                leaving.leave(drv, exc, "uncaught: the process exits", wait=False)
        _HOOKED[0](tp, exc, tb)

    sys.excepthook = hook


# ---------------------------------------------------------------------------------- SIGINT / SIGTERM

#: The signals ``exit_on_signals`` turns into a quiet exit (Ctrl-C; a scheduler's or launcher's stop).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
#: How long such an exit waits for an ``uninterrupted`` stretch (a journal line's fsync) to end.
UNINTERRUPTED_WAIT_S = 30.0
_UNINTERRUPTED = threading.RLock()


@contextlib.contextmanager
def uninterrupted() -> Iterator[None]:
    """A stretch that a signal's exit (``exit_on_signals``) lets finish first: a journal line
    written and fsync'ed, the merge of the journals. Local; any thread."""
    with _UNINTERRUPTED:
        yield


@contextlib.contextmanager
def exit_on_signals(say: Callable[[int], None] | None = None) -> Iterator[None]:
    """Inside, SIGINT and SIGTERM end this process with exit code 128 + the signal's number, with
    no traceback and no interpreter teardown: once no ``uninterrupted`` stretch runs (at most
    ``UNINTERRUPTED_WAIT_S``), ``say(signum)`` (this process's one line, if it has one), then
    ``os._exit``. On the way out the default handlers are back and the watching thread has ended
    (a thread alive at exit is how a clean exit aborts). Local; enter it on the main thread.

    The exit is taken by a thread of its own, woken through ``signal.set_wakeup_fd``, not by the
    Python handler: that runs only on the main thread, between bytecodes, and the main thread may
    sit in a collective (the engine's construction) for as long as its peers take. ``os._exit``
    skips the teardown that the exit guard above makes safe for an ordinary exit: with gloo work
    abandoned mid-flight, a finalizing interpreter aborts ("terminate called without an active
    exception") or joins gloo's threads until the group timeout.
    """
    wake, wakeup = socket.socketpair()
    wakeup.setblocking(False)
    old = {sig: signal.signal(sig, _ignore) for sig in STOP_SIGNALS}  # so the wakeup fd hears them
    old_fd = signal.set_wakeup_fd(wakeup.fileno(), warn_on_full_buffer=False)
    watcher = threading.Thread(
        target=_exit_when_signalled, args=(wake, say), daemon=True, name="shardgen-signals"
    )
    watcher.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(old_fd)
        for sig, handler in old.items():
            signal.signal(sig, handler)
        wakeup.send(b"\0")  # not a signal: the watcher returns
        watcher.join(timeout=UNINTERRUPTED_WAIT_S)
        wake.close()
        wakeup.close()


def _ignore(signum: int, frame: object) -> None:
    """The main thread's part of a stop signal: none (``_exit_when_signalled`` ends the process)."""


def _exit_when_signalled(wake: socket.socket, say: Callable[[int], None] | None) -> None:
    while True:
        data = wake.recv(64)  # one byte per signal that reached a Python handler; 0: leave
        stops = [b for b in data if b in STOP_SIGNALS]
        if stops:
            break
        if 0 in data or not data:
            return
    signum = stops[0]
    # Held until os._exit: no journal line is begun after this one, none is cut in the middle.
    _UNINTERRUPTED.acquire(timeout=UNINTERRUPTED_WAIT_S)
    if say is not None:
        with contextlib.suppress(Exception):
            say(signum)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(128 + signum)
