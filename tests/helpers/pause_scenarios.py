"""Scenarios for tests/multirank/test_paused_inside.py (inside gloo ranks of a World)."""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist
from models import tiny_model


def uneven_collectives_inside_paused(path: str) -> str:
    """Inside ``paused()`` rank r runs r + 1 all-reduces of its own (as a teacher forward
    micro-batched per rank would): rank 0 leaves after one, the others wait in their second.
    Rank 0 then waits past ``stall_timeout`` and writes what shardgen logged to ``path``."""
    import shardgen

    rank = dist.get_rank()
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    logging.getLogger("shardgen").addHandler(Keep())
    eng = shardgen.Engine(tiny_model("llama", seed=1), backend="fsdp2", stall_timeout=2.0)
    eng.generate([[5, 6, 7]], max_new_tokens=2)
    with eng.paused():
        for _ in range(rank + 1):
            dist.all_reduce(torch.ones(1))  # the user's own collective, uneven counts: ranks 1, 2 hang
    time.sleep(6.0)  # rank 0 only: its driver waits for the others to leave, and says so
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n\n".join(seen))
    return "left"
