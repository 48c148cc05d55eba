"""The README usage: torchrun --nproc-per-node 2 examples/basic.py

Rank r asks r+1 prompts (generate() is not collective). Every rank enters one default-group
barrier: rank 0 midway through its prompts, the others after their last one; meanwhile the
engine's driver thread keeps serving the peers that still generate.
"""

import torch.distributed as dist

import shardgen
from shardgen.toy import make_prompts, toy_model_path

rank, world = shardgen.init()
prompts = [p["prompt"] for p in make_prompts(rank + 1, seed=rank)]
barrier_after = (len(prompts) + 1) // 2 if rank == 0 else len(prompts)
with shardgen.Engine.from_pretrained(toy_model_path(), backend="fsdp2") as engine:  # collective
    for i, prompt in enumerate(prompts):
        out = engine.generate([prompt], max_new_tokens=32)[0]
        print(f"rank {rank}: {prompt!r} -> {out.text!r} ({out.finish_reason})", flush=True)
        if i + 1 == barrier_after:
            dist.barrier()  # your own collectives are safe meanwhile
    print(f"rank {rank}: done, stats {engine.stats()}", flush=True)
# leaving the block is engine.close(), the collective join: it returns when every rank is done
dist.destroy_process_group()
