"""One rank of tests/multirank/test_clean_exit.py's tick-release check: gloo's worker releases a tick's
work after the Python side let go of it, while the main thread keeps the GIL until exit.

``python exit_tick_rank.py RANK PORT``, two ranks. Rank 0 starts the control plane's
all-gather (``ControlPlane._mine`` into ``_rows``, the tick's buffers) and drops the work's
handle at once; rank 1 joins the all-gather 0.3 s later, so rank 0's gloo worker finishes the
work and holds its last reference. Rank 0's main thread meanwhile spins with a 1000 s switch
interval (it never yields the GIL) and then exits, with the exit guard's GIL hand-off taken out (this checks
the plane's own release, not that mitigation). If the worker's release of the buffer needs the
GIL, it waits for it into finalization, and Python ends it there with ``pthread_exit`` inside
gloo's ``noexcept`` destructor: SIGABRT, "terminate called without an active exception".
Rank 0 prints nothing after the all-gather starts (writing to stdout would hand the GIL over).
"""

from __future__ import annotations

import atexit
import datetime
import sys
import time

import torch.distributed as dist

import shardgen.core.process as process
from shardgen.core.protocol import ControlPlane

rank, port = int(sys.argv[1]), int(sys.argv[2])
atexit.unregister(process._exit_guard)
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
group = dist.new_group(backend="gloo")  # the engine's control group is a gloo group of its own
plane = ControlPlane(group, rank, 2)
dist.barrier()
print(f"rank {rank} ready", flush=True)
if rank == 1:
    time.sleep(0.3)
    dist.all_gather(plane._rows, plane._mine, group=group)
    sys.exit(0)
sys.setswitchinterval(1000.0)
work = dist.all_gather(plane._rows, plane._mine, group=group, async_op=True)
del work  # the caller lets go first: gloo's worker releases the work when rank 1 joins
t0 = time.perf_counter()
while time.perf_counter() - t0 < 1.0:  # keeps the GIL: the worker's release happens meanwhile
    pass
