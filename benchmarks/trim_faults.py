"""What ``malloc_trim(0)`` (``pool.trim_heap``, called when a pause starts) costs the next training step.

    python benchmarks/trim_faults.py --reps 20

One process, no engine, no ranks: the model of ``train_pause.py`` trains on one batch; steps
alternate between one right after another step and one right after ``trim_heap()``. Printed:
each kind's median step time and median count of minor page faults (``getrusage``) in the step.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=20, help="pairs of steps (plain, after a trim)")
    args = ap.parse_args()

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardgen.backends.buffer_pool import trim_heap

    torch.set_num_threads(1)
    cfg = LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    ids = torch.randint(3, 512, (4, 64))

    def step() -> tuple[float, int]:
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        dt = time.perf_counter() - t0
        return 1000 * dt, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults

    for _ in range(3):  # warm-up
        step()
    kinds: dict[str, list[tuple[float, int]]] = {"after a step": [], "after malloc_trim(0)": []}
    for _ in range(args.reps):
        kinds["after a step"].append(step())
        trim_heap()
        kinds["after malloc_trim(0)"].append(step())
    for kind, xs in kinds.items():
        ms = statistics.median(x[0] for x in xs)
        faults = statistics.median(x[1] for x in xs)
        print(f"{kind}: {ms:.1f} ms per step, {faults:.0f} minor page faults (medians of {len(xs)})")


if __name__ == "__main__":
    main()
