"""A training step inside ``engine.paused()`` against the same step with no engine, side by side.

    python benchmarks/train_pause.py                       # 2 gloo ranks, FSDP2 and DeepSpeed
    python benchmarks/train_pause.py --modes fsdp2 --rounds 6 --steps 5

Two copies of the same model (Llama, 4 layers, hidden 256) set up by the user: ``fully_shard``
(``fsdp2``) or ``deepspeed.initialize`` ZeRO-3 with a torch optimizer (``deepspeed``). Rounds
alternate: K training steps on copy A, no engine anywhere; then an engine opens on copy B, one
rollout, and K steps on B inside ``paused()``; the engine closes. Both copies see the same
batches, so their losses must be equal (checked), and the step times are compared. A third
method, ``hooks off``, does the same as B with the backend's pause hooks disabled: training then
runs on shardgen's generation setup (private group; for DeepSpeed no prefetch and no persistence).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import relaunch_as_ranks, script_args  # noqa: E402


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    import shardgen

    torch.set_num_threads(1)
    shardgen.init()
    rank = dist.get_rank()
    cfg = LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randint(3, 512, (4, 64), generator=g) for _ in range(args.steps)]
    prompts = [torch.randint(3, 512, (8,), generator=g).tolist() for _ in range(2 + rank)]

    def build(mode: str):
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).train()
        if mode == "deepspeed":
            import deepspeed

            opt = torch.optim.SGD(model.parameters(), lr=1e-2)
            ds_cfg = {
                "train_micro_batch_size_per_gpu": 1,
                "zero_allow_untested_optimizer": True,
                "zero_optimization": {"stage": 3},
            }
            eng, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_cfg)
            return eng, None
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        return model, torch.optim.SGD(model.parameters(), lr=1e-2)

    def steps(model, opt, ds: bool) -> tuple[float, list[float]]:
        losses = []
        dist.barrier()
        t0 = time.perf_counter()
        for ids in batches:
            out = model(input_ids=ids, labels=ids)
            if ds:
                model.backward(out.loss)
                model.step()
            else:
                out.loss.backward()
                opt.step()
                opt.zero_grad()
            losses.append(float(out.loss.detach()))
        dist.barrier()
        return (time.perf_counter() - t0) / len(batches), losses

    for mode in args.modes:
        ds = mode == "deepspeed"
        models = {m: build(mode) for m in ("none", "engine", "hooks off")}
        times: dict[str, list[float]] = {m: [] for m in models}
        losses: dict[str, list[float]] = {m: [] for m in models}
        for r in range(args.rounds + 1):  # round 0 warms up, not counted
            for method, (model, opt) in models.items():
                if method == "none":
                    dt, ls = steps(model, opt, ds)
                else:
                    with shardgen.Engine(model, backend="deepspeed" if ds else "fsdp2") as eng:
                        if method == "hooks off":  # (close() still hands the model back)
                            eng.backend.enter_pause = eng.backend.exit_pause = lambda: None
                        eng.rollout(prompts, n=2, max_new_tokens=8, seed=r)
                        with eng.paused():
                            dt, ls = steps(model, opt, ds)
                        for name in ("enter_pause", "exit_pause"):
                            eng.backend.__dict__.pop(name, None)
                if r > 0:
                    times[method].append(dt)
                losses[method] += ls
        assert losses["none"] == losses["engine"] == losses["hooks off"], "loss curves differ"
        if rank == 0:
            base = statistics.median(times["none"])
            print(f"\n{mode}: {args.rounds} rounds x {args.steps} steps, median step time (losses equal)")
            print("| method | ms / step | vs no engine |\n|---|---|---|")
            for method, ts in times.items():
                med = statistics.median(ts)
                print(f"| {method} | {1000 * med:.1f} | {med / base:.3f} |")
            sys.stdout.flush()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--modes", nargs="+", default=["fsdp2", "deepspeed"], choices=["fsdp2", "deepspeed"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args(script_args())
    if "LOCAL_RANK" not in os.environ:
        relaunch_as_ranks(__file__, args.nproc)
    rank_main(args)


if __name__ == "__main__":
    main()
