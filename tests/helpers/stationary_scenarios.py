"""Scenarios for tests/multirank/test_stationary.py (gather="stationary"); they run inside gloo ranks
of a World.

Token equality with single-process HF ``generate()`` on every architecture of tests/helpers/models.py,
the collectives of real and shadow forwards (recorded, and against the plan's count), and
training between rollouts. Each rank's workload differs (a rank prefilling while another
decodes, refills, a rank with no requests), so every exchange runs with uneven token counts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from ds_scenarios import _param_group, _wrap, install_recorder, record
from engine_scenarios import assert_lockstep
from models import batch, hf_generate, tiny_model
from numerics import Row, assert_ids_agree, assert_rows_agree
from world import rank, world_size

import shardgen
from shardgen.generation.plan import IDLE_PLAN, Access

# Architectures and sizes: hidden 36 and vocabulary 101 divide by neither 2 nor 3 (FSDP2: padded
# last shards; DeepSpeed: rows cut across ranks, in the embeddings, the head and the MLP).
ODD = dict(hidden_size=36, vocab_size=101, intermediate_size=50)
ARCHS = {
    "llama-odd": ("llama", ODD),
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    "qwen2": ("qwen2", {}),  # q/k/v biases
    "gpt2": ("gpt2", {}),  # Conv1D everywhere (fallback), tied head
    "mixtral": ("mixtral", {}),  # an MoE block in the middle of each layer (fallback)
    "opt": ("opt", {}),  # biases, LayerNorms, learned positions: an nn.Embedding subclass's own forward
    "gemma": ("gemma", {}),  # a scaled-embedding subclass of nn.Embedding, tied to the head
}


def _recorder() -> None:
    install_recorder()
    _wrap("all_to_all_single")


def greedy_matches_hf(archs: list[str], backend: str, gather: str = "stationary") -> dict:
    """Per architecture: rank 0 one call of 4 prompts; rank 1 two calls (prefill and refills while
    rank 0 decodes: batch of 2); rank 2 (3 ranks) no requests. Greedy output == HF."""
    out = {}
    for name in archs:
        arch, over = ARCHS[name]
        ref = tiny_model(arch, seed=21, **over)
        eng = shardgen.Engine(
            tiny_model(arch, seed=21, **over), backend=backend, gather=gather, max_batch_size=2
        )
        calls = {0: 1, 1: 2}.get(rank(), 0)
        vocab = over.get("vocab_size", 96)
        for c in range(calls):
            ids, mask = batch([3 + rank(), 8, 5, 1 + 2 * c], seed=100 + 10 * rank() + c, vocab=vocab)
            if c == 0:
                kw = dict(max_new_tokens=6 + 3 * rank(), pad_token_id=0)
                got = eng.generate_ids(ids, attention_mask=mask, **kw)
                exp = hf_generate(ref, ids, mask, **kw)
                assert_ids_agree(got, exp, mask, ref, what=f"{name} rank {rank()}")  # rows leave the batch
                continue
            # one request at a time, different lengths: finished slots are refilled while others decode
            prompts = [ids[i][mask[i].bool()] for i in range(len(ids))]
            futs = [eng.submit(p, max_new_tokens=3 + 4 * i, pad_token_id=0) for i, p in enumerate(prompts)]
            for i, (p, f) in enumerate(zip(prompts, futs, strict=True)):
                exp = hf_generate(
                    ref, p[None], torch.ones_like(p[None]), max_new_tokens=3 + 4 * i, pad_token_id=0
                )
                got = f.result(timeout=120).token_ids
                mine, alone = (Row(p.tolist(), t, None, None) for t in (got, exp[0, p.numel() :].tolist()))
                assert_rows_agree([mine], [alone], model=ref, what=f"{name} rank {rank()} request {i}")
        eng.close()
        st = eng.stats()
        out[name] = {
            "stats": st,
            "chosen": dict(eng._driver.mode.chosen),
            "policy": eng.gather_policy,
            "plan": eng.backend.stationary.layout.describe() if eng.backend.stationary is not None else None,
            "cut": bool(eng.backend.stationary.cut.shards) if eng.backend.stationary is not None else None,
        }
        assert_lockstep([st] if world_size() == 1 else _gathered(st))
    return out


def _gathered(st: dict) -> list[dict]:
    every: list = [None] * world_size()
    dist.all_gather_object(every, st)
    return every


def _backend(arch: str, backend: str, over: dict):
    from shardgen.backends import make_backend

    group = _param_group()
    model = tiny_model(arch, seed=22, **over)
    ref = tiny_model(arch, seed=22, **over)
    b = make_backend(backend, model, param_group=group, device=torch.device("cpu"))
    assert b.enable_stationary() is None
    return b, ref


def collectives_real_vs_shadow(arch: str, backend: str) -> dict:
    """Three stationary forwards with different agreed shapes; in each, some ranks forward real
    inputs and the others shadow. Every forward's recorded collectives, the logits against the
    unsharded model, and the plan's count for each rank."""
    from shardgen.backends.stationary import stationary_cost

    _recorder()
    name = arch
    arch, over = ARCHS[name]
    b, ref = _backend(arch, backend, over)
    me, world = rank(), world_size()
    schedule = [  # per forward: (rows, width) of every rank's input_ids; (0, 0) shadows
        [(2, 5)] + [(0, 0)] * (world - 1),
        [(3, 1)] + [(1, 4)] * (world - 1),
        [(0, 0)] * (world - 1) + [(1, 7)],
    ]
    seqs, diffs, plans = [], [], []
    with record() as first:
        first_shapes = [(1, 1)] * world  # the first forward also gathers the kept state
        one = torch.ones((1, 1), dtype=torch.long)
        b.forward(IDLE_PLAN.agreed(Access.STATIONARY, first_shapes), {"input_ids": one, "use_cache": False})
    for dims in schedule:
        shapes = [(r * w, r) for r, w in dims]  # (tokens, head rows): the head sees one position a row
        rows, width = dims[me]
        with record() as rec:
            if rows:
                gen = torch.Generator().manual_seed(me)
                ids = torch.randint(3, over.get("vocab_size", 96), (rows, width), generator=gen)
                kw = dict(use_cache=False, logits_to_keep=1)  # as the decoder passes them: the head sees rows
                plan = IDLE_PLAN.agreed(Access.STATIONARY, shapes)  # as the tick agrees it
                logits = b.forward(plan, {"input_ids": ids, **kw}).logits
                with torch.no_grad():
                    diffs.append((logits - ref(input_ids=ids, **kw).logits).abs().max().item())
            else:
                b.shadow_forward(IDLE_PLAN.agreed(Access.STATIONARY, shapes))
        seqs.append(rec.calls)
        cost = stationary_cost(b.stationary.layout, shapes, me)
        plans.append((cost.collectives, cost.elements))
    b.close()
    return {
        "seqs": seqs,
        "diffs": diffs,
        "plans": plans,
        "first": first.calls,
        "kept_bytes": b.stationary.kept_bytes(),
    }


def _uneven_greedy(eng, ref, vocab: int = 96) -> int:
    """Rank 0: one call; rank 1: two (the second while rank 0 is done); others: none. == HF."""
    calls = {0: 1, 1: 2}.get(rank(), 0)
    for c in range(calls):
        ids, mask = batch([4 + rank(), 2, 7], seed=300 + 10 * rank() + c, vocab=vocab)
        kw = dict(max_new_tokens=5 + 3 * c + rank(), pad_token_id=0)
        got = eng.generate_ids(ids, attention_mask=mask, **kw)
        exp = hf_generate(ref, ids, mask, **kw)
        assert_ids_agree(got, exp, mask, ref, what=f"rank {rank()} call {c}")  # rows leave the batch
    return calls


def user_sharded_greedy(kind: str, name: str = "llama-odd") -> dict:
    """A model the user sharded (``fully_shard`` on the default group) or partitioned
    (``deepspeed.initialize`` at ZeRO-3, no optimizer), in the stationary mode: greedy == HF."""
    from rollout_scenarios import _user_fsdp2

    arch, over = ARCHS[name]
    ref = tiny_model(arch, seed=23, **over)
    model = tiny_model(arch, seed=23, **over)
    if kind == "fsdp2-user":
        target, backend = _user_fsdp2(model), "fsdp2"
    else:
        import deepspeed

        zero = {"stage": 3, "memory_efficient_linear": False}
        target, *_ = deepspeed.initialize(
            model=model, config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero}
        )
        backend = "deepspeed"
    eng = shardgen.Engine(target, backend=backend, gather="stationary")
    calls = _uneven_greedy(eng, ref, vocab=ref.config.vocab_size)
    eng.close()
    return {"calls": calls, "stats": eng.stats(), "plan": eng.backend.stationary.layout.describe()}


def mixed_precision_greedy(kind: str, gather: str, name: str = "llama-odd") -> dict:
    """A model the user set to compute in bfloat16 over fp32 weights (``fsdp2``: ``fully_shard``
    with ``MixedPrecisionPolicy(param_dtype=bfloat16)``, as torchtitan and TRL do; ``deepspeed``:
    ``deepspeed.initialize`` at ZeRO-3 with ``bf16`` enabled): greedy tokens and their
    log-probabilities == HF on the model with its parameters cast to bfloat16 and its buffers
    (rotary frequencies) left fp32, which is what both compute with."""
    arch, over = ARCHS[name]
    ref = tiny_model(arch, seed=25, **over)
    for p in ref.parameters():
        p.data = p.data.to(torch.bfloat16)
    model = tiny_model(arch, seed=25, **over)
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cpu", (world_size(),))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        target = model
    else:
        import deepspeed

        zero = {"stage": 3, "memory_efficient_linear": False}
        config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero, "bf16": {"enabled": True}}
        target, *_ = deepspeed.initialize(model=model, config=config)
    eng = shardgen.Engine(target, backend=kind, gather=gather)
    calls = _uneven_greedy(eng, ref, vocab=ref.config.vocab_size)
    # The log-probabilities too, bit for bit: a forward in fp32 would mostly pick the same tokens.
    prompt = batch([5 + rank()], seed=310 + rank(), vocab=ref.config.vocab_size)[0][0]
    got = eng.submit(prompt, max_new_tokens=4, logprobs=True, pad_token_id=0).result(timeout=120)
    with torch.no_grad():
        hf = ref.generate(prompt[None], max_new_tokens=4, do_sample=False, synced_gpus=False, pad_token_id=0,
                          output_logits=True, return_dict_in_generate=True)  # fmt: skip
    assert got.token_ids == hf.sequences[0, prompt.numel() :].tolist()
    steps = zip(hf.logits, got.token_ids, strict=True)
    exp = [torch.log_softmax(lg.float(), -1)[0, t].item() for lg, t in steps]
    assert got.logprobs == exp, (got.logprobs, exp)
    eng.close()
    if kind == "fsdp2":
        model.reshard()  # FSDP2 keeps the root unit unsharded (in bfloat16) after a forward
        assert all(p.dtype == torch.float32 for p in model.parameters())  # the user's fp32 masters stay
    return {"calls": calls, "stats": eng.stats(), "policy": eng.gather_policy}


def pretrained_greedy(path: str, backend: str) -> dict:
    """``Engine.from_pretrained`` (loaded straight into shards) in the stationary mode: == HF."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(path).eval()
    eng = shardgen.Engine.from_pretrained(path, backend=backend, gather="stationary")
    calls = _uneven_greedy(eng, ref, vocab=ref.config.vocab_size)
    eng.close()
    return {"calls": calls, "policy": eng.gather_policy, "forwards": eng.backend.stationary.forwards}


def teacher_forced_batched(model, b, temperature: float) -> torch.Tensor:
    """[R, G] log p of every response token from ONE padded forward of the whole batch (every rank
    runs exactly one, so a sharded model's hooks pair up across ranks)."""
    mask = b.attention_mask
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=b.input_ids, attention_mask=mask, position_ids=pos).logits.float()
    out = torch.zeros_like(b.logprobs)
    w = b.prompt_width
    for i in range(len(b)):
        g = int(b.response_lengths[i])
        lp = torch.log_softmax(logits[i, w - 1 : w - 1 + g] / temperature, -1)
        out[i, :g] = lp.gather(-1, b.input_ids[i, w : w + g, None]).squeeze(-1)
    return out


def train_between(mode: str, steps: int = 2, refresh: bool = True) -> dict:
    """rollout, train, rollout, ... in the stationary mode (rollout_scenarios.train_between's
    workload): the losses equal the same steps without an engine, and each rollout's logprobs
    equal the trained model's (a teacher-forced forward inside the next pause): the kept
    parameters were gathered again after the training step. ``refresh=False`` keeps the stale
    ones (the negative control: the logprobs then differ)."""
    from rollout_scenarios import EOS, _ds_initialize, _train_step, _user_fsdp2, id_prompts

    lr = 0.5
    ids = batch([6, 6], seed=100 + rank())[0]
    ds = mode == "deepspeed"

    def build():
        model = tiny_model("llama", seed=7).train()
        if ds:
            eng = _ds_initialize(model, lr)
            return eng, eng
        return (_user_fsdp2(model) if mode == "fsdp2-user" else model), model

    step_model, _ = build()
    if mode == "fsdp2":
        _user_fsdp2(step_model)
    opt = None if ds else torch.optim.SGD(step_model.parameters(), lr=lr)
    base = [_train_step(step_model, opt, ids, ds) for _ in range(steps + 1)]
    del step_model, opt

    step_model, target = build()
    losses, diffs = [], []
    prompts = id_prompts([5, 7, 3] if rank() == 0 else [6], seed=rank())
    with shardgen.Engine(target, backend="deepspeed" if ds else "fsdp2", gather="stationary") as eng:
        if not refresh:
            eng.backend.stationary.invalidate = lambda: None
        opt = None if ds else torch.optim.SGD(step_model.parameters(), lr=lr)
        for _ in range(steps):
            b = eng.rollout(prompts, n=2, seed=5, max_new_tokens=8, eos_token_id=EOS, temperature=0.8)
            with eng.paused():
                fwd = step_model.module if ds else step_model
                diffs.append((b.logprobs - teacher_forced_batched(fwd, b, 0.8)).abs().max().item())
                losses.append(_train_step(step_model, opt, ids, ds))
        b = eng.rollout(prompts, n=2, seed=5, max_new_tokens=8, eos_token_id=EOS, temperature=0.8)
        with eng.paused():
            fwd = step_model.module if ds else step_model
            diffs.append((b.logprobs - teacher_forced_batched(fwd, b, 0.8)).abs().max().item())
    losses.append(_train_step(step_model, opt, ids, ds))
    return {"base": base, "losses": losses, "diffs": diffs, "stationary": eng.backend.stationary.forwards}


def auto_mixes_modes(backend: str) -> dict:
    """``auto`` over a model whose replica does not fit: per forward, the cost model's choice. The
    cost model is replaced by a threshold (stationary up to 8 tokens in the forward, per-layer
    beyond) so that one engine mixes both modes, prefills gathering and decode steps not, on
    every rank at the same ticks. Greedy == HF throughout (a rank prefilling while another
    decodes, refills)."""
    from shardgen.core import policy

    real = policy.ForwardMode.cheaper
    policy.ForwardMode.cheaper = lambda self, shapes: (
        "stationary" if sum(t for t, _ in shapes) <= 8 else "per-layer"
    )
    try:  # the World's ranks run later scenarios: put the cost model back
        arch, over = ARCHS["llama-odd"]
        ref = tiny_model(arch, seed=24, **over)
        model = tiny_model(arch, seed=24, **over)
        eng = shardgen.Engine(model, backend=backend, gather="auto", memory_budget_gb=1e-9, max_batch_size=2)
        _uneven_greedy(eng, ref, vocab=over["vocab_size"])
        eng.close()
    finally:
        policy.ForwardMode.cheaper = real
    return {"policy": eng.gather_policy, "chosen": dict(eng._driver.mode.chosen), "stats": eng.stats()}
