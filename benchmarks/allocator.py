"""The mmap-threshold setting against gather buffers kept across forwards: memory bound and speed.

    git archive <commit before the change> src | tar -x -C /tmp/shardgen-before   # once
    PYTHONPATH=src .venv/bin/python benchmarks/allocator.py --before-src /tmp/shardgen-before/src

Arms, each a fresh set of 2 gloo ranks (glibc's threshold cannot be reset in a process),
interleaved and rotated per repetition:

- ``before``: the tree given by ``--before-src`` (its backends fix glibc's mmap threshold at
  128 KiB when created on a CPU, process-wide);
- ``after``: this tree (no allocator setting; gathers into kept buffers, ``backends/buffer_pool.py``);
- ``after+setting``: this tree with the old setting applied by the benchmark at start
  (``mallopt(M_MMAP_THRESHOLD, 128 KiB)``): what the setting alone does to it.

Each arm measures, in one process:

1. memory (the bound of ``tests/multirank/test_loading.py::test_sharded_loading_memory_and_outputs``): per
   backend, a warm-up engine on a tiny checkpoint, then garbage collection, ``malloc_trim`` and
   a reset of VmHWM (``clear_refs``); ``Engine.from_pretrained`` of the test's ~340 MB fp32
   checkpoint (40 layers, vocabulary 32000) and a 5-token generation of 3 prompts; VmHWM
   growth (MiB, worst rank) after loading and after generating, against the bound
   1.25 x model / N + 2 layers;
2. per-layer decode on the medium Llama of ``ds_decode.py`` (hidden 512, 6 layers, vocabulary
   32000; a batch of 4 prompts of 8 tokens, greedy, no EOS): ``Engine(model, backend=...)`` for
   fsdp2 and deepspeed, and the floor: the unsharded model's ``generate`` (``floor compute``) plus
   the cheaper of two ways to move the same bytes per step in per-layer chunks into preallocated
   buffers (``floor all_gather``: one ``all_gather_into_tensor`` per chunk; ``floor broadcasts``:
   one broadcast per rank per chunk, as the backends' kept buffers take them); one decode step is
   ``(t(N tokens) - t(1 token)) / (N - 1)``, methods interleaved within each round;
3. a user's training step in ``engine.paused()``: forward, backward and optimizer step (SGD) on
   the same medium model the user sharded (``fully_shard`` per layer / ``deepspeed.initialize``
   ZeRO-3), after one rollout, median of the timed steps.

Prints one table: per arm the medians over repetitions with their range, and each arm's ratio
to ``before`` (paired by repetition).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import reset_peak, script_args, vm_hwm_mb  # noqa: E402

MMAP_THRESHOLD = 128 << 10
M_MMAP_THRESHOLD = -3


# ----------------------------------------------------------------------------- checkpoints
def write_checkpoints(root: str) -> tuple[str, str]:
    """The loading test's memory checkpoint (fp32, untied, index-sharded) and a tiny warm-up one."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    common = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0, max_position_embeddings=256)
    big = LlamaConfig(
        vocab_size=32000, hidden_size=384, intermediate_size=1024, num_hidden_layers=40,
        num_attention_heads=6, num_key_value_heads=2, head_dim=64, tie_word_embeddings=False, **common,
    )  # fmt: skip
    tiny = LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, **common,
    )  # fmt: skip
    out = []
    for name, cfg, shard in (("big", big, "20MB"), ("tiny", tiny, "5GB")):
        path = os.path.join(root, name)
        torch.manual_seed(1)
        model = AutoModelForCausalLM.from_config(cfg)
        model.generation_config.pad_token_id = 0
        model.generation_config.eos_token_id = 2
        model.save_pretrained(path, max_shard_size=shard)
        out.append(path)
    return out[0], out[1]


def checkpoint_mb(path: str) -> tuple[float, float]:
    """(model, one decoder layer) in MiB, fp32."""
    from safetensors import safe_open

    total = layer = 0
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), "pt") as f:
                for key in f.keys():
                    n = f.get_slice(key).get_shape()
                    size = 4
                    for d in n:
                        size *= d
                    total += size
                    layer += size if ".layers.0." in key else 0
    return total / 2**20, layer / 2**20


# ----------------------------------------------------------------------------- in a rank
def worst(value: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def measure_memory(big: str, tiny: str) -> dict:
    import torch
    import torch.distributed as dist

    import shardgen

    rank = dist.get_rank()
    out = {}
    for backend in ("fsdp2", "deepspeed"):
        ids = torch.tensor([[5, 6, 7]])
        with shardgen.Engine.from_pretrained(tiny, backend=backend, dtype="float32") as warm:
            warm.generate_ids(ids, torch.ones_like(ids), max_new_tokens=1)
        base = reset_peak()
        eng = shardgen.Engine.from_pretrained(big, backend=backend, dtype="float32", max_batch_size=4)
        load = vm_hwm_mb() - base
        g = torch.Generator().manual_seed(rank)
        lengths = [6, 3, 5]
        ids = torch.zeros((3, 6), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, n in enumerate(lengths):
            ids[i, 6 - n :] = torch.randint(3, 32000, (n,), generator=g)
            mask[i, 6 - n :] = 1
        eng.generate_ids(ids, mask, max_new_tokens=5)
        gen = vm_hwm_mb() - base
        eng.close()
        del eng
        out[backend] = {"load_mb": worst(load), "gen_mb": worst(gen)}
    return out


def medium_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=32000, hidden_size=512, intermediate_size=1024, num_hidden_layers=6,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip


def build_medium(train: bool = False):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(medium_config())
    m.generation_config.eos_token_id = None
    m.generation_config.pad_token_id = 0
    return m.train() if train else m.eval()


def floor_buffers(plain, world: int) -> list:
    """Per gather unit of ``plain`` (the embedding, each layer, the rest), a rank's shard and the
    gathered buffer of the same bytes (fp32)."""
    import torch

    def nbytes(mod) -> int:
        return sum(p.numel() * p.element_size() for p in mod.parameters())

    chunks = [nbytes(plain.model.embed_tokens)] + [nbytes(layer) for layer in plain.model.layers]
    chunks.append(nbytes(plain) - sum(chunks))
    return [(torch.empty(c // 4 // world), torch.empty(c // 4 // world * world)) for c in chunks]


def floor_broadcasts(bufs: list, n: int, group) -> None:
    """``n`` steps of the floor's gathers: per unit, the shard copied into its slice, then one
    broadcast per rank into its slice. Collective on ``group``: every rank, same ``n``."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    for _ in range(n):
        for src, dst in bufs:
            parts = dst.chunk(world)
            parts[rank].copy_(src)
            for r in range(world):
                dist.broadcast(parts[r], group_src=r, group=group)


def measure_decode(args: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist

    import shardgen

    world = dist.get_world_size()
    g = torch.Generator().manual_seed(1234)  # the same batch on every rank
    ids = torch.randint(3, 32000, (args.batch, args.prompt_len), generator=g)
    mask = torch.ones_like(ids)
    engines = {
        b: shardgen.Engine(build_medium(), backend=b, gather="per-layer", max_batch_size=args.batch)
        for b in args.backends
    }
    plain = build_medium()

    bufs = floor_buffers(plain, world)
    group = dist.new_group(backend="gloo")

    def compute(n: int) -> None:
        with torch.no_grad():
            plain.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False)

    def all_gather(n: int) -> None:
        for _ in range(n):
            for src, dst in bufs:
                dist.all_gather_into_tensor(dst, src, group=group)

    def broadcasts(n: int) -> None:  # the same bytes as one broadcast per rank into its slice
        floor_broadcasts(bufs, n, group)

    methods = {f"shardgen {b}": (lambda n, e=e: e.generate_ids(ids, mask, max_new_tokens=n, eos_token_id=[]))
               for b, e in engines.items()}  # fmt: skip
    methods.update({"floor compute": compute, "floor all_gather": all_gather, "floor broadcasts": broadcasts})

    def timed(fn, n: int) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn(n)
        dist.barrier()
        return time.perf_counter() - t0

    for fn in methods.values():  # warm-up: first forwards, pools, kernels
        fn(2)
    steps: dict[str, list[float]] = {m: [] for m in methods}
    for _ in range(args.rounds):
        for name, fn in methods.items():
            full, one = timed(fn, args.new_tokens), timed(fn, 1)
            steps[name].append(1e3 * (full - one) / (args.new_tokens - 1))
    for e in engines.values():
        e.close()
    # The floor: the unsharded step plus the cheaper of two ways to move the same bytes.
    steps["floor"] = [
        c + min(a, b)
        for c, a, b in zip(
            steps["floor compute"], steps["floor all_gather"], steps["floor broadcasts"], strict=True
        )
    ]
    return steps


def training_step(model, opt, batch, ds: bool):
    """One timed step (seconds): forward, backward, optimizer step."""
    import torch.distributed as dist

    def step() -> float:
        dist.barrier()
        t0 = time.perf_counter()
        loss = model(input_ids=batch, labels=batch).loss
        if ds:
            model.backward(loss)
            model.step()
        else:
            loss.backward()
            opt.step()
            opt.zero_grad()
        dist.barrier()
        return time.perf_counter() - t0

    return step


def measure_training(args: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist

    import shardgen

    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    batch = torch.randint(3, 32000, (4, 64), generator=g)
    prompts = [torch.randint(3, 32000, (8,), generator=g).tolist() for _ in range(2)]
    out = {}
    for backend in args.backends:
        model = build_medium(train=True)
        if backend == "deepspeed":
            import deepspeed

            opt = torch.optim.SGD(model.parameters(), lr=1e-3)
            ds_cfg = {
                "train_micro_batch_size_per_gpu": 1,
                "zero_allow_untested_optimizer": True,
                "zero_optimization": {"stage": 3},
            }
            model, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_cfg)
        else:
            from torch.distributed.fsdp import fully_shard

            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)

        step = training_step(model, opt, batch, backend == "deepspeed")
        times = []
        with shardgen.Engine(model, backend=backend) as eng:
            eng.rollout(prompts, n=2, max_new_tokens=8, seed=0)
            with eng.paused():
                step()  # warm-up
                times = [1e3 * step() for _ in range(args.train_steps)]
        out[backend] = times
    return out


def rank_main(args: argparse.Namespace) -> None:
    arm = os.environ["ALLOCATOR_ARM"]
    if arm.endswith("+setting"):
        ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)  # the old setting, explicitly
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch
    import torch.distributed as dist

    import shardgen

    torch.set_num_threads(1)
    shardgen.init()
    result: dict = {"arm": arm}
    if not args.skip_memory:
        big, tiny = os.environ["ALLOCATOR_CKPTS"].split(os.pathsep)
        result["memory"] = measure_memory(big, tiny)
    result["decode_ms"] = measure_decode(args)
    if args.train_steps:
        result["train_ms"] = measure_training(args)
    if dist.get_rank() == 0:
        with open(os.environ["ALLOCATOR_OUT"], "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- the parent
def launch(arm: str, src: str, out: str, ckpts: str) -> dict:
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join([src, env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        OMP_NUM_THREADS="1",
        DS_ACCELERATOR="cpu",
        ALLOCATOR_ARM=arm,
        ALLOCATOR_OUT=out,
        ALLOCATOR_CKPTS=ckpts,
        SHARDGEN_BENCHMARK_ARGV=json.dumps(sys.argv[1:]),
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", os.path.abspath(__file__)]
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, timeout=1800, stdout=subprocess.DEVNULL)
    with open(out) as f:
        res = json.load(f)
    print(f"  {arm}: {time.perf_counter() - t0:.0f} s", flush=True)
    return res


def spread(values: list[float], fmt: str = "{:.0f}") -> str:
    med = statistics.median(values)
    if len(values) == 1:
        return fmt.format(med)
    return f"{fmt.format(med)} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def report(runs: dict[str, list[dict]], bound: float | None, arms: list[str]) -> str:
    lines = []
    ref = "before" if "before" in runs else arms[0]
    methods = list(runs[arms[0]][0]["decode_ms"])
    head = ["arm"]
    if bound is not None:
        head += [f"{b}: MiB loading+generating (bound {bound:.0f})" for b in ("fsdp2", "deepspeed")]
    head += [f"{m}: ms/step" for m in methods] + [
        f"{m} x floor" for m in methods if not m.startswith("floor")
    ]
    head += [f"{m}: vs {ref}" for m in methods if not m.startswith("floor")]
    trains = list(runs[arms[0]][0].get("train_ms", {}))
    head += [f"train {b}: ms/step" for b in trains] + [f"train {b}: vs {ref}" for b in trains]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    med = {
        a: [{m: statistics.median(r["decode_ms"][m]) for m in methods} for r in rs] for a, rs in runs.items()
    }
    tmed = {
        a: [{b: statistics.median(r["train_ms"][b]) for b in trains} for r in rs] for a, rs in runs.items()
    }
    for arm in arms:
        rs = runs[arm]
        row = [arm]
        if bound is not None:
            row += [spread([r["memory"][b]["gen_mb"] for r in rs]) for b in ("fsdp2", "deepspeed")]
        row += [spread([m[x] for m in med[arm]]) for x in methods]
        row += [
            spread([m[x] / m["floor"] for m in med[arm]], "{:.2f}")
            for x in methods
            if not x.startswith("floor")
        ]
        pairs = list(zip(med[arm], med[ref], strict=True))
        row += [
            spread([a[x] / b[x] for a, b in pairs], "{:.2f}") for x in methods if not x.startswith("floor")
        ]
        row += [spread([t[b] for t in tmed[arm]]) for b in trains]
        tpairs = list(zip(tmed[arm], tmed[ref], strict=True))
        row += [spread([a[b] / r[b] for a, r in tpairs], "{:.2f}") for b in trains]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before-src", help="the src folder of the tree before the change (arm 'before')")
    p.add_argument("--arms", nargs="+", default=["before", "after", "after+setting"])
    p.add_argument("--reps", type=int, default=2, help="repetitions of every arm, interleaved")
    p.add_argument("--rounds", type=int, default=2, help="timed rounds per method within an arm")
    p.add_argument("--backends", nargs="+", default=["fsdp2", "deepspeed"])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=12)
    p.add_argument("--train-steps", type=int, default=3, help="timed training steps (0: none)")
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args(script_args())
    if "RANK" in os.environ:
        rank_main(args)
        return
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "src")
    arms = [a for a in args.arms if a != "before" or args.before_src]
    srcs = {a: (args.before_src if a == "before" else os.path.normpath(here)) for a in arms}
    with tempfile.TemporaryDirectory() as tmp:
        ckpts, bound = "", None
        if not args.skip_memory:
            big, tiny = write_checkpoints(tmp)
            ckpts = os.pathsep.join([big, tiny])
            model_mb, layer_mb = checkpoint_mb(big)
            bound = 1.25 * model_mb / 2 + 2 * layer_mb
        runs: dict[str, list[dict]] = {a: [] for a in arms}
        for rep in range(args.reps):
            order = arms[rep % len(arms) :] + arms[: rep % len(arms)]  # rotated: no arm always first
            print(f"repetition {rep + 1}/{args.reps}: {', '.join(order)}", flush=True)
            for arm in order:
                runs[arm].append(launch(arm, srcs[arm], os.path.join(tmp, f"{arm}-{rep}.json"), ckpts))
    table = report(runs, bound, arms)
    print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "runs": runs, "table": table}, f, indent=2)


if __name__ == "__main__":
    main()
