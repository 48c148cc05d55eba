"""The one free-port helper of the test suite (gloo stores, torchrun and deepspeed launchers)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago.

    Another process may take it before the caller binds it: callers that start a store retry
    on "address in use" (``world.World`` does) or use it for one short-lived launch.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
