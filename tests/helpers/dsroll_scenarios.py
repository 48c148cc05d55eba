"""Scenarios for tests/multirank/test_integrations_deepspeed.py: ``ShardgenRollout`` against DeepSpeed's own
``HybridEngineRollout`` on a ``deepspeed.initialize`` ZeRO-3 engine (they run inside gloo ranks of
a World, DS_ACCELERATOR=cpu)."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from models import batch, tiny_model

PAD, MAX_NEW = 0, 10
DROPOUT = {"attention_dropout": 0.3}  # the train_between model: dropout changes what a forward gives
EOS = list(range(2, 10))  # many EOS ids: a random tiny model stops rows at different steps


class Tok:
    """What both rollout engines read of a tokenizer: pad and EOS ids (and decode, for texts)."""

    def __init__(self, eos: int | list[int], pad: int = PAD) -> None:
        self.eos_token_id, self.pad_token_id = eos, pad

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))


def warm_up() -> bool:
    """Import DeepSpeed and start its comm layer (the first time ever it JIT-builds an op)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    from shardgen.backends.deepspeed import internals

    internals.ensure_ds_comm(deepspeed)
    return True


def _ds_engine(seed: int, lr: float = 0.5, **over):
    import deepspeed

    model = tiny_model("llama", seed=seed, **over).train()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1000},
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    if not over:
        engine.module.eval()  # for HybridEngineRollout, which leaves the mode alone
    return engine


def _request(lengths: list[int], seed: int):
    from deepspeed.runtime.rollout import RolloutRequest

    if not lengths:  # a rank with no prompt this step: [0, 0]
        empty = torch.zeros((0, 0), dtype=torch.long)
        return RolloutRequest(empty, empty.clone())
    ids, mask = batch(lengths, seed=seed)
    return RolloutRequest(ids, mask)


def _greedy(**kw):
    from deepspeed.runtime.rollout import SamplingConfig

    return SamplingConfig(max_new_tokens=MAX_NEW, temperature=0.0, **kw)


def _as_lists(b) -> tuple:
    return (b.input_ids.tolist(), b.attention_mask.tolist(), b.response_start_idx.tolist())


def single_process_layout(ref, request, tok: Tok, n: int = 1):
    """What ``HybridEngineRollout.generate`` returns on one process (greedy): HF decodes
    ``MAX_NEW`` tokens with EOS off, then its own post-processing."""
    from deepspeed.runtime.rollout import HybridEngineRollout

    ids = request.prompt_ids.repeat_interleave(n, 0)
    mask = request.prompt_attention_mask.repeat_interleave(n, 0)
    with torch.no_grad():
        out = ref.generate(
            ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=None, do_sample=False,
            pad_token_id=tok.pad_token_id, synced_gpus=False,
        )  # fmt: skip
    width = ids.shape[1]
    out, resp_attn = HybridEngineRollout._pad_after_eos(out, width, tok.eos_token_id, tok.pad_token_id)
    attn = torch.cat([mask.long(), resp_attn], dim=1)
    return out.tolist(), attn.tolist(), [width] * ids.shape[0]


def _gathered_ref(ds, seed: int, **over):
    """An unsharded copy of ``ds``'s current weights. Collective (a ZeRO-3 gather, every rank)."""
    import deepspeed

    with torch.random.fork_rng():  # tiny_model seeds torch: the trainer's dropout draws stay as they are
        ref = tiny_model("llama", seed=seed, **over)
    with deepspeed.zero.GatheredParameters(list(ds.module.parameters())):
        state = {k: v.detach().clone() for k, v in ds.module.state_dict().items()}
    ref.load_state_dict(state)
    return ref.eval()


# ----------------------------------------------------------------------------- scenarios
def greedy_vs_hybrid() -> dict:
    """Equal B on every rank: HybridEngineRollout first, then ShardgenRollout on the same engine, at
    n = 1 and 2, and ours with continuous_batch_size. -> each side's batches, and the response
    counts of DeepSpeed's ResponseTokenBatch of ours."""
    from deepspeed.runtime.rollout import HybridEngineRollout, ResponseTokenBatch

    from shardgen.integrations.deepspeed import ShardgenRollout

    seed, lengths = 11, [4, 7, 5]
    tok = Tok(eos=EOS)
    ds = _ds_engine(seed)
    req = _request(lengths, seed=seed + dist.get_rank())  # equal B, each rank its own prompts
    configs = [_greedy(), _greedy(n_samples_per_prompt=2), _greedy(continuous_batch_size=2)]
    hybrid = HybridEngineRollout(ds, tok)
    # Its continuous path does not run with transformers 5 (DeepSpeedStaticCache has no
    # get_query_offset): ours is checked against its default path's rows there.
    theirs = [_as_lists(hybrid.generate(req, c)) for c in configs[:2]]
    ours_engine = ShardgenRollout(ds, tok, max_batch_size=4)
    ours, targets = [], []
    for c in configs:
        b = ours_engine.generate(req, c)
        ours.append(_as_lists(b))
        rt = ResponseTokenBatch.from_rollout(b)
        width = req.prompt_ids.shape[1]
        targets.append((rt.response_mask.sum(-1).tolist(), b.attention_mask[:, width:].sum(-1).tolist()))
    types = type(b).__module__ + "." + type(b).__name__
    ours_engine.shutdown()
    ref = tiny_model("llama", seed=seed)
    single = single_process_layout(ref, req, tok)
    return {"theirs": theirs, "ours": ours, "targets": targets, "type": types, "single": single,
            "eos": tok.eos_token_id}  # fmt: skip


def _steps_b(rank: int, world: int, step: int) -> list[int]:
    """Prompt lengths of ``rank`` at ``step``: 3, 1 or 0 prompts, a different rank empty each step."""
    counts = [3, 1, 0] if world >= 3 else [3, 0, 1]
    k = counts[(rank + step) % len(counts)]
    return [4 + (i + rank + step) % 5 for i in range(k)]


def shardgen_uneven(steps: int = 3, speculate: int = 0) -> dict:
    """Steps of uneven B per rank (zero included), greedy then sampled with n = 2, then each rank's
    own greedy rows against the single-process layout of the same weights. ``speculate``: the
    engine option, a verify forward's columns priced as before any is measured (so that drafts
    run whatever this machine's timings); ``stats``: each call's ``last_stats``."""
    from shardgen.generation import drafts

    cost = drafts.Pacer.cost
    if speculate:
        drafts.Pacer.cost = lambda self, width, rows=None: 1.0 + drafts.UNMEASURED_COLUMN_COST * (width - 1)  # type: ignore[method-assign]
    try:
        return _shardgen_uneven(steps, speculate)
    finally:
        drafts.Pacer.cost = cost  # type: ignore[method-assign]


def _shardgen_uneven(steps: int, speculate: int) -> dict:
    from deepspeed.runtime.rollout import ResponseTokenBatch, SamplingConfig

    from shardgen.integrations.deepspeed import ShardgenRollout

    rank, world = dist.get_rank(), dist.get_world_size()
    seed = 13
    tok = Tok(eos=EOS)
    ds = _ds_engine(seed)
    ref = tiny_model("llama", seed=seed)
    rollout = ShardgenRollout(ds, tok, seed=3, speculate=speculate)
    stats = []
    mismatches, shapes = [], []
    t0 = time.monotonic()
    for step in range(steps):
        req = _request(_steps_b(rank, world, step), seed=100 * step + rank)
        got = rollout.generate(req, _greedy())
        stats.append(rollout.last_stats)
        if req.prompt_ids.shape[0]:
            if _as_lists(got) != single_process_layout(ref, req, tok):
                mismatches.append(step)
        sampled = rollout.generate(
            req, SamplingConfig(max_new_tokens=MAX_NEW, temperature=0.8, top_k=20, n_samples_per_prompt=2)
        )
        stats.append(rollout.last_stats)
        ResponseTokenBatch.from_rollout(sampled)
        b, width = req.prompt_ids.shape
        lps = rollout.last_batch.logprobs  # shardgen's own batch of the same rows
        if (
            tuple(sampled.input_ids.shape) != (2 * b, width + MAX_NEW)
            or not torch.equal(sampled.input_ids[:, :width], req.prompt_ids.repeat_interleave(2, 0))
            or lps.shape[0] != 2 * b
            or bool((lps > 0).any())
        ):
            mismatches.append(f"sampled {step}")
        shapes.append((tuple(got.input_ids.shape), tuple(sampled.input_ids.shape)))
    elapsed = time.monotonic() - t0
    rollout.shutdown()
    return {"mismatches": mismatches, "shapes": shapes, "elapsed": elapsed, "stats": stats}


def _train_step(ds, ids) -> float:
    out = ds(input_ids=ids, labels=ids)
    ds.backward(out.loss)
    ds.step()
    return float(out.loss.detach())


def train_between(steps: int = 2) -> dict:
    """generate, train, generate, train ... on the DeepSpeed engine (uneven B per rank): the
    training losses equal the same steps with no rollout engine, bit for bit, and each rollout's
    greedy rows equal the single-process layout on the weights gathered at that step (which
    change: the rows differ from the first weights'); between calls the model is on DeepSpeed's
    own setup (groups, prefetch, persistence). The model has dropout and is in training mode:
    rollouts run in eval mode, the trainer's steps in its own."""
    from rollout_scenarios import _user_setup_in_place

    from shardgen.integrations.deepspeed import ShardgenRollout

    rank = dist.get_rank()
    seed = 17
    tok = Tok(eos=EOS)
    train_ids = batch([6, 6], seed=200 + rank)[0]
    torch.manual_seed(1)  # the trainer's dropout draws
    ds = _ds_engine(seed, **DROPOUT)
    base = [_train_step(ds, train_ids) for _ in range(steps)]
    del ds

    torch.manual_seed(1)
    ds = _ds_engine(seed, **DROPOUT)  # in training mode, as a trainer leaves it
    with torch.random.fork_rng():
        first = tiny_model("llama", seed=seed, **DROPOUT)
    rollout = ShardgenRollout(ds, tok)
    losses, equal, changed, restored, modes = [], [], [], [], []
    for step in range(steps + 1):
        req = _request([5, 6] if rank == 0 else [7], seed=300 + step)  # the same prompts each step
        got = _as_lists(rollout.generate(req, _greedy()))
        restored.append(_user_setup_in_place(rollout.shardgen_engine, "deepspeed"))  # paused: DeepSpeed's own
        modes.append(ds.module.training)  # back in the trainer's mode
        ref = _gathered_ref(ds, seed, **DROPOUT)  # in the pause: DeepSpeed's own groups, every rank
        equal.append(got == single_process_layout(ref, req, tok))
        changed.append(got != single_process_layout(first, req, tok))
        if step < steps:
            losses.append(_train_step(ds, train_ids))
    rollout.shutdown()
    return {"base": base, "losses": losses, "equal": equal, "changed": changed, "restored": restored,
            "modes": modes}  # fmt: skip


def quota_steps(steps: int = 2) -> dict:
    """``ShardgenRollout(groups=1, max_staleness=1, stale="finish")``, sampled, n = 2: each step rank
    r sends 2 + r prompts and gets one whole group back (held groups first), the trainer steps in
    between; then a drain (``rollout.groups = rollout.held``, no prompts) serves the rest. -> the
    prompts sent and served (per call), whether each returned row's prompt columns are its
    group's (``last_batch.prompts``), and per served group (weight version at its call, its
    tokens' lowest and highest versions, the version at the call that served it)."""
    from deepspeed.runtime.rollout import SamplingConfig

    from shardgen.integrations.deepspeed import ShardgenRollout

    rank = dist.get_rank()
    n = 2
    ds = _ds_engine(19)
    rollout = ShardgenRollout(ds, Tok(eos=EOS), groups=1, max_staleness=1, stale="finish", seed=5)
    eng = rollout.shardgen_engine
    sampling = SamplingConfig(max_new_tokens=MAX_NEW, temperature=0.9, top_p=1.0, top_k=0,
                              n_samples_per_prompt=n)  # fmt: skip
    train_ids = batch([6, 6], seed=210 + rank)[0]
    sent, served, laid_out, spans, born = [], [], [], [], {}
    for step in range(steps + 1):
        last = step == steps
        if last:
            rollout.groups = rollout.held
        req = _request([] if last else [4 + k for k in range(2 + rank)], seed=400 + 10 * rank + step)
        for ids, m in zip(req.prompt_ids, req.prompt_attention_mask, strict=True):
            sent.append(ids[m.bool()].tolist())
            born[tuple(sent[-1])] = eng.version  # the weights its first tokens are drawn under
        now = eng.version
        out = rollout.generate(req, sampling)
        b = rollout.last_batch
        served.append([list(p) for p in b.prompts])
        w = int(out.response_start_idx[0]) if len(b) else 0
        laid_out.append(all(
            out.input_ids[i, :w][out.attention_mask[i, :w].bool()].tolist() == list(b.prompts[i // n])
            for i in range(len(b))
        ))  # fmt: skip
        for k, p in enumerate(b.prompts):
            v = b.versions[k * n : k * n + n][b.response_mask[k * n : k * n + n].bool()]
            spans.append((born[tuple(p)], int(v.min()), int(v.max()), now))
        if not last:
            _train_step(ds, train_ids)
    left = rollout.held
    rollout.shutdown()
    return {"sent": sent, "served": served, "laid_out": laid_out, "spans": spans, "left": left}


def hybrid_uneven(engine: str) -> dict:
    """The same uneven first step (3, 0 and 1 prompts) through ``engine`` (``hybrid``: DeepSpeed's
    HybridEngineRollout; ``shardgen``), then the trainer's next collective, a barrier. A rank whose
    generate raises (HF cannot decode 0 rows) goes on to the barrier, as a trainer that skips a
    failed step would."""
    from deepspeed.runtime.rollout import HybridEngineRollout

    from shardgen.integrations.deepspeed import ShardgenRollout

    rank, world = dist.get_rank(), dist.get_world_size()
    seed = 13
    tok = Tok(eos=EOS)
    ds = _ds_engine(seed)
    rollout = HybridEngineRollout(ds, tok) if engine == "hybrid" else ShardgenRollout(ds, tok)
    req = _request(_steps_b(rank, world, 0), seed=rank)
    error = None
    t0 = time.monotonic()
    try:
        rows = rollout.generate(req, _greedy()).batch_size
    except RuntimeError as e:
        rows, error = None, f"{type(e).__name__}: {e}"
    dist.barrier()
    elapsed = time.monotonic() - t0
    rollout.shutdown()
    return {"rows": rows, "error": error, "elapsed": elapsed}


def rollout_score(steps: int = 2) -> dict:
    """The OPSD teacher through ``ShardgenRollout.score``, rows uneven per rank (a different rank
    with none each step): a sampled rollout (n = 2), then ``score`` of its own rows (equal to the
    rollout's logprobs), of its responses under teacher prompts (HINT + prompt, top-k) against a
    single-process HF forward on the weights gathered at that step, then a training step: the
    next step scores on the new weights. -> per step: (self diff, teacher diff, rows)."""
    from deepspeed.runtime.rollout import SamplingConfig
    from score_scenarios import HINT, reference, worst

    from shardgen.generation.requests import unpadded_rows
    from shardgen.integrations.deepspeed import ShardgenRollout

    rank, world = dist.get_rank(), dist.get_world_size()
    seed, temp, k = 19, 0.8, 3
    ds = _ds_engine(seed, lr=0.5)
    ds.module.train()  # as a trainer leaves it
    rollout = ShardgenRollout(ds, Tok(eos=EOS), seed=5)
    train_ids = batch([6, 6], seed=400 + rank)[0]
    out: dict = {"self": [], "teacher": [], "rows": [], "modes": []}
    for step in range(steps):
        req = _request(_steps_b(rank, world, step), seed=500 * step + rank)
        cfg = SamplingConfig(max_new_tokens=MAX_NEW, temperature=temp, n_samples_per_prompt=2)
        rollout.generate(req, cfg)
        b = rollout.last_batch
        own = rollout.score(b, temperature=temp)
        rows = unpadded_rows(req.prompt_ids, req.prompt_attention_mask) if len(b) else []
        prompts = [r.tolist() for r in rows]
        teacher = [HINT + p for p in prompts for _ in range(2)]
        sb = rollout.score(b, prompts=teacher, top_k=k)
        lengths = b.response_lengths.tolist()
        responses = [b.response_ids[i, : int(g)].tolist() for i, g in enumerate(lengths)]
        out["modes"].append(ds.module.training)  # score leaves the module in the trainer's mode
        ref = _gathered_ref(ds, seed)  # in the pause: collective, every rank
        out["self"].append((own.logprobs - b.logprobs).abs().max().item() if len(b) else 0.0)
        out["teacher"].append(worst(sb, reference(ref, teacher, responses, top_k=k), top_k=k))
        out["rows"].append((len(b), len(own), len(sb)))
        _train_step(ds, train_ids)  # every rank trains, rows or not
    rollout.shutdown()
    return out


class IdsOnly:
    """A tokenizer as DeepSpeed's rollout tests pass one: the two ids, nothing else (no decode)."""

    def __init__(self, eos: int | list[int] | None, pad: int | None = PAD) -> None:
        self.eos_token_id, self.pad_token_id = eos, pad


def _eos_cut(b, width: int, eos: list[int], pad: int) -> list[str]:
    """What breaks the default path's rule in ``b``'s rows: the first EOS kept (attention 1), every
    later position the pad id with attention 0, a generated pad id attention 0, the rest 1."""
    bad = []
    for i, (ids, attn) in enumerate(zip(b.input_ids.tolist(), b.attention_mask.tolist(), strict=True)):
        resp, mask = ids[width:], attn[width:]
        cut = next((k for k, t in enumerate(resp) if t in eos), None)
        for k, (t, m) in enumerate(zip(resp, mask, strict=True)):
            want = 1 if (cut is not None and k == cut) else int(t != pad and (cut is None or k < cut))
            if (cut is not None and k > cut and t != pad) or m != want:
                bad.append(f"row {i} column {k}: id {t}, attention {m}")
    return bad


def contract() -> dict:
    """DeepSpeed's RolloutEngine contract on ShardgenRollout, a tokenizer of two ids (no decode):
    built by DeepSpeed's own ``build_rollout`` (its HybridEngineRollout name pointed at ours for
    the call); ``.engine``; ``sync_weights``; greedy rows cut after EOS; a zero-row request
    ``[0, P]`` on one rank while the other decodes, on each rank in turn; the continuous path;
    pad id 0 (a generated 0 masked). -> what each check saw, per rank."""
    import deepspeed.runtime.rollout as dsr
    from deepspeed.runtime.rollout import RolloutConfig, RolloutRequest

    import shardgen
    from shardgen.integrations.deepspeed import ShardgenRollout

    rank = dist.get_rank()
    seed = 23
    tok = IdsOnly(eos=EOS)
    ds = _ds_engine(seed)
    real, dsr.HybridEngineRollout = dsr.HybridEngineRollout, ShardgenRollout
    try:
        rollout = dsr.build_rollout(RolloutConfig(), student_engine=ds, tokenizer=tok)
    finally:
        dsr.HybridEngineRollout = real
    out: dict = {
        "type": type(rollout).__name__,
        "engine": rollout.engine is ds and rollout.tokenizer is tok,
        "shardgen_engine": isinstance(rollout.shardgen_engine, shardgen.Engine),
        "sync": rollout.sync_weights(3),
        "cut": [], "empty": [], "rows": [], "texts": [], "stopped": 0,
    }  # fmt: skip
    ids, mask = batch([4, 7, 5], seed=seed + rank)
    out["width"] = ids.shape[1]
    for step in range(2):
        empty = rank == step  # rank 0 has no row at step 0, rank 1 at step 1
        req = RolloutRequest(ids[:0], mask[:0]) if empty else RolloutRequest(ids, mask)
        for cfg in (_greedy(), _greedy(continuous_batch_size=2), _greedy(n_samples_per_prompt=2)):
            b = rollout.generate(req, cfg)
            out["rows"].append(b.batch_size)
            if empty:
                out["empty"].append(
                    (tuple(b.input_ids.shape), b.input_ids.dtype, b.attention_mask.dtype,
                     tuple(b.response_start_idx.shape), b.response_start_idx.dtype)
                )  # fmt: skip
            elif cfg.continuous_batch_size is None:
                out["cut"] += _eos_cut(b, ids.shape[1], EOS, PAD)
                resp = b.input_ids[:, ids.shape[1] :].tolist()
                out["stopped"] = out.get("stopped", 0) + sum(any(t in EOS for t in row) for row in resp)
            out["texts"].append(rollout.last_batch.texts)
    rollout.shutdown()
    return out
