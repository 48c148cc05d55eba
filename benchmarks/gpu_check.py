"""The prepared GPU check (``make gpu``): one GPU, world size 1, in a few minutes.

    python -m torch.distributed.run --nproc-per-node=1 benchmarks/gpu_check.py --json gpu.json
    python -m torch.distributed.run --nproc-per-node=1 benchmarks/gpu_check.py --smoke   # CPU: the script

Prints the device, torch and CUDA versions, then, as JSON:

- ``modes``: for each backend (fsdp2, deepspeed) and gather mode (per-layer, stationary, once,
  auto), a tiny bf16 Llama: the device the engine chose, the control plane's backend (gloo)
  beside the parameter group's (NCCL on CUDA), and whether greedy ``generate_ids`` equals HF
  ``generate()`` on the same device (the same shapes: bit for bit expected);
- ``prefix_cache``: a two-turn conversation with the cache on and off: tokens equal, prompt
  tokens taken from the cache;
- ``decode``: a Llama of about 1.1B parameters built from a config (bf16), 32 rows x 128 new
  tokens greedy, HF ``generate()`` against the engine (fsdp2, ``gather="auto"``), tokens/s and
  the ratio, rounds interleaved.

``--smoke``: the same steps on the CPU with a tiny model in place of the 1B one (fp32): checks
the script, not the GPU (tests/multirank/test_bench.py runs it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import write_json  # noqa: E402


def llama(hidden: int, layers: int, vocab: int, inter: int, heads: int, kv: int, dtype, device):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=2048,
    )  # fmt: skip
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg).to(dtype=dtype).eval()
    m.generation_config.pad_token_id = 0
    m.generation_config.eos_token_id = None
    return m.to(device) if device is not None else m


def hf(model, ids, mask, new: int):
    import torch

    with torch.no_grad():
        return model.generate(
            ids, attention_mask=mask, max_new_tokens=new, do_sample=False, synced_gpus=False
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny models: check the script")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json")
    args = p.parse_args()

    import torch
    import torch.distributed as dist

    import shardgen

    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        print(
            json.dumps({"device": "none", "note": "no CUDA device: nothing to check (use --smoke on a CPU)"})
        )
        return
    if args.smoke:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    rank, world = shardgen.init()
    assert world == 1, f"the GPU check runs at world size 1, got {world}"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    out: dict = {
        "device": torch.cuda.get_device_name(device) if cuda else "cpu (smoke)",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "dist_backend": dist.get_backend(),
    }
    print(f"device {out['device']}, torch {out['torch']}, CUDA {out['cuda']}", flush=True)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 90, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding in one row
    ids[0, :4] = 0

    modes = []
    for backend in ("fsdp2", "deepspeed"):
        for gather in ("per-layer", "stationary", "once", "auto"):
            ref = llama(64, 2, 96, 128, 4, 2, dtype, device)
            want = hf(ref, ids.to(device), mask.to(device), 12)
            row: dict = {"backend": backend, "gather": gather}
            try:
                with shardgen.Engine(
                    llama(64, 2, 96, 128, 4, 2, dtype, None), backend=backend, gather=gather
                ) as e:
                    row["device"] = str(e.device)
                    row["policy"] = e.gather_policy
                    got = e.generate_ids(ids.to(device), attention_mask=mask.to(device), max_new_tokens=12)
                    row["equal_hf"] = bool(torch.equal(got.cpu(), want.cpu()))
                    row["control_plane"] = dist.get_backend(e._control) if e._control is not None else None
            except Exception as err:  # noqa: BLE001 - the check reports every mode, failing or not
                row["error"] = f"{type(err).__name__}: {err}"[:300]
            modes.append(row)
            print(json.dumps(row), flush=True)
    out["modes"] = modes

    # the prefix cache on the device: turn 2 extends turn 1
    start = torch.randint(3, 90, (40,), generator=g).tolist()
    turns = {}
    for cap in (None, 0):
        with shardgen.Engine(
            llama(64, 2, 96, 128, 4, 2, dtype, None), backend="fsdp2", prefix_cache_tokens=cap
        ) as e:
            c1 = e.generate([start], max_new_tokens=6)[0]
            c2 = e.generate([start + c1.token_ids + [5] * 20], max_new_tokens=6)[0]
            turns[cap] = (c1.token_ids + c2.token_ids, e.stats()["cached_prompt_tokens"])
    out["prefix_cache"] = {"equal": turns[None][0] == turns[0][0], "cached_tokens": turns[None][1]}
    print(json.dumps(out["prefix_cache"]), flush=True)

    # decode: ~1.1B parameters on the GPU (tiny under --smoke)
    size = (64, 2, 96, 128, 4, 2) if args.smoke else (2048, 16, 32000, 5632, 32, 8)
    rows, new = (4, 8) if args.smoke else (32, 128)
    ref = llama(*size, dtype, device)
    params = sum(p.numel() for p in ref.parameters())
    prompts = torch.randint(3, size[2], (rows, 64), generator=g)
    eng = shardgen.Engine(llama(*size, dtype, None), backend="fsdp2", max_batch_size=rows)
    times: dict[str, list[float]] = {"hf": [], "shardgen": []}
    for _ in range(args.rounds + 1):  # the first round warms up
        for name in times:
            if cuda:
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            if name == "hf":
                hf(ref, prompts.to(device), torch.ones_like(prompts).to(device), new)
            else:
                eng.generate_ids(prompts.to(device), max_new_tokens=new)
            if cuda:
                torch.cuda.synchronize(device)
            times[name].append(time.perf_counter() - t0)
    policy = eng.gather_policy
    eng.close()
    tok = {k: rows * new / (sum(v[1:]) / len(v[1:])) for k, v in times.items()}
    out["decode"] = {"params": params, "rows": rows, "new_tokens": new, "policy": policy, "tok_s": tok,
                     "shardgen_over_hf": tok["shardgen"] / tok["hf"]}  # fmt: skip
    print(json.dumps(out["decode"]), flush=True)
    ok = all(r.get("equal_hf") for r in modes) and out["prefix_cache"]["equal"]
    out["ok"] = ok
    print(json.dumps({"ok": ok}), flush=True)
    write_json(args.json, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
