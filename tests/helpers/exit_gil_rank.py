"""One rank of tests/multirank/test_clean_exit.py's exit check: its last collectives just before exit.

``python exit_gil_rank.py RANK WORLD PORT``: imports shardgen (its exit guard), makes the
main thread keep the GIL for up to a second when another thread asks for it
(``sys.setswitchinterval``), runs a last pair of all-reduces on each of eight gloo groups and
exits. Each gloo worker then drops its finished work, which takes the GIL, while the main
thread heads into finalization: without the exit guard's hand-off most such exits end in
SIGABRT ("terminate called without an active exception"; measured without the guard: 7 of 10
runs with eight groups, 4 of 10 with four).
"""

from __future__ import annotations

import datetime
import faulthandler
import signal
import sys

import torch
import torch.distributed as dist

import shardgen  # noqa: F401  (registers the exit guard, as any program using shardgen does)

rank, world, port = (int(a) for a in sys.argv[1:4])
# The test sends SIGUSR1 before it kills a rank past its bound: every thread's stack (a signal
# handler: no thread of its own beside the ones under test).
faulthandler.register(signal.SIGUSR1, all_threads=True)
sys.setswitchinterval(1.0)
store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
groups = [dist.new_group(backend="gloo") for _ in range(8)]
works = [dist.all_reduce(torch.ones(4), group=g, async_op=True) for g in groups for _ in range(2)]
for w in works:
    w.wait()
del works
print(f"rank {rank} done", flush=True)
