"""One rank of the GPU tests: ``torchrun --nproc-per-node N tests/helpers/gpu_rank.py`` (NCCL via
shardgen.init).

``BACKEND`` (default fsdp2) and ``GATHER`` (default: the engine's) choose the engine's setup."""

from __future__ import annotations

import os
import sys

sys.path[:0] = [os.path.dirname(__file__), os.path.join(os.path.dirname(__file__), "..", "..", "src")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from models import batch, hf_generate, tiny_model  # noqa: E402

import shardgen  # noqa: E402

rank, world = shardgen.init()
assert dist.get_backend() == "nccl", dist.get_backend()
ref = tiny_model("llama", seed=43).cuda()
gather = {"gather": os.environ["GATHER"]} if os.environ.get("GATHER") else {}
backend = os.environ.get("BACKEND", "fsdp2")
eng = shardgen.Engine(tiny_model("llama", seed=43), backend=backend, **gather)  # moves to cuda:LOCAL_RANK
if gather.get("gather") == "stationary":
    assert eng.gather_policy == "stationary" and eng.backend.stationary is not None
assert eng.device == torch.device("cuda", int(os.environ["LOCAL_RANK"]))
for c in range(1 + rank):  # uneven calls
    ids, mask = batch([4, 6], seed=44 + 10 * rank + c)
    got = eng.generate_ids(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=10)
    assert torch.equal(got, hf_generate(ref, ids.cuda(), mask.cuda(), max_new_tokens=10))
if gather.get("gather") == "stationary":
    assert eng.backend.stationary.forwards > 0  # the forwards really ran weight-stationary, on cuda
dist.barrier()
eng.close()
print(f"rank {rank}: ok", flush=True)
dist.destroy_process_group()
