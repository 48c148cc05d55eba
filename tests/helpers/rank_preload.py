"""The last module the test ranks' fork server imports (tests/helpers/world.py): the rest of what
nearly every rank imports, then ``gc.freeze()``.

- shardgen's own modules read no per-rank environment at import (nothing at module level does),
  so the server imports them once instead of each rank (about 0.15 s of CPU a rank).
- Where the server preloaded DeepSpeed: its ZeRO optimizer check imports the Muon optimizer
  lazily, about 0.8 s of CPU in every rank that builds a DeepSpeed engine with an optimizer.
- ``gc.freeze()`` moves everything imported so far out of the collector's reach: a full
  collection in a rank then walks its own objects, not the ~400,000 of torch, transformers and
  DeepSpeed (0.2 s of CPU each time; DeepSpeed's ZeRO-3 optimizer calls ``gc.collect()`` at
  construction, and the soak and memory scenarios call it themselves). CPython's docs suggest it
  before ``fork()`` for this reason.
"""

from __future__ import annotations

import gc
import sys

import shardgen.backends.fsdp2
import shardgen.core.engine  # noqa: F401

if "deepspeed" in sys.modules:
    import shardgen.backends.deepspeed  # noqa: F401

    try:
        import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
    except ImportError:  # an optional part of DeepSpeed
        pass

gc.freeze()
