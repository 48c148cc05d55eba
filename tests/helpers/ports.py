"""The one free-port helper of the test suite (gloo stores, torchrun and deepspeed launchers)."""

from __future__ import annotations

import os
import random
import socket

# Linux hands out ephemeral ports (bind(0), every outgoing gloo/TCPStore connection) from
# 32768-60999. A port taken from that range can be grabbed by any connection between our check
# and the store's bind, which under two xdist workers happened in CI (EADDRINUSE). Ports below
# it are only ever taken by an explicit bind, so we hand them out ourselves: each xdist worker
# owns its own slice, walked from a random start so parallel runs rarely meet.
_BASE, _SLICE, _SLICES = 12000, 2500, 8
_next: int | None = None


def _worker_slice() -> tuple[int, int]:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    digits = "".join(c for c in worker if c.isdigit()) or "0"
    lo = _BASE + (int(digits) % _SLICES) * _SLICE
    return lo, lo + _SLICE


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port() -> int:
    """A TCP port on 127.0.0.1, outside the ephemeral range, that was free a moment ago.

    Only another explicit bind can take it before the caller binds it; callers that start a
    store still retry on "address in use" (``lost_port_race``: ``world.World`` does).
    """
    global _next
    lo, hi = _worker_slice()
    if _next is None or not lo <= _next < hi:
        _next = random.Random(os.getpid()).randrange(lo, hi)
    for _ in range(hi - lo):
        port, _next = _next, lo + (_next + 1 - lo) % (hi - lo)
        if _bindable(port):
            return port
    raise RuntimeError(f"no free port in {lo}-{hi}")


def lost_port_race(output: str) -> bool:
    """Whether a process's output says its store could not bind its port (another took it)."""
    return "EADDRINUSE" in output or "address already in use" in output.lower()
