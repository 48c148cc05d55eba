"""Put on PYTHONPATH by tests/helpers/two_agents.py: each process prints the Python threads still alive
when the interpreter starts to finalize. A daemon thread inside a C++ call then (a store or
gloo wait) can abort the process with ``terminate called without an active exception``
(Python 3.11 ends such threads with ``pthread_exit`` when they next take the GIL)."""

import atexit
import os
import sys
import threading


def _report() -> None:
    alive = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    sys.stderr.write(f"EXIT-THREADS pid={os.getpid()} {alive}\n")
    sys.stderr.flush()


atexit.register(_report)  # registered first: runs last, after every other exit handler
