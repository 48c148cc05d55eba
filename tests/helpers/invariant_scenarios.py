"""Scenarios for tests/multirank/test_invariant_numerics.py (inside gloo ranks of a World).

Under ``numerics="invariant"`` every request's tokens and logprobs must be the bits it gets
served alone, whether batched with other prompts, prefilled in chunks, or half served from the
prefix cache; and the trainer's forward inside ``invariant_numerics()`` (and ``score()``) must
give the rollout's logprobs bit for bit. Each rank counts its own rows; ranks hold uneven
numbers of prompts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from models import tiny_model
from rollout_scenarios import EOS, id_prompts

KW = dict(n=2, temperature=1.0, max_new_tokens=8, seed=5, eos_token_id=EOS)


def _model(dtype: str):
    return tiny_model("llama", seed=11, hidden_size=64, intermediate_size=128).to(getattr(torch, dtype))


def _same(a, b, ra: int, rb: int) -> tuple[bool, bool]:
    """(tokens equal, logprobs bit-equal) of row ``ra`` of ``a`` and row ``rb`` of ``b``."""
    ta, tb = a.response_ids[ra][a.response_mask[ra].bool()], b.response_ids[rb][b.response_mask[rb].bool()]
    if not torch.equal(ta, tb):
        return False, False
    n = len(ta)
    return True, torch.equal(a.logprobs[ra][:n], b.logprobs[rb][:n])


def _reply(row: int, completion) -> list[int]:
    """A tool's reply of three tokens, the same for every row (multi-turn: a second turn)."""
    return [7, 8, 9]


def trainer_logprobs(model, b) -> torch.Tensor:
    """The README's ``my_logprobs``: one forward over the padded batch, at the rollout's T."""
    pos = (b.attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=pos).logits
    lp = torch.log_softmax(logits[:, b.prompt_width - 1 : -1].float() / KW["temperature"], dim=-1)
    return lp.gather(-1, b.response_ids[..., None]).squeeze(-1) * b.response_mask


def invariant_rollouts(backend: str, gather: str, dtype: str, routes: bool = True) -> dict:
    """-> {what: [rows equal, rows compared]} for this rank: ``alone`` (tokens), ``alone_lp``,
    ``chunked``, ``cached`` (logprobs bit-equal to alone), ``trainer`` and ``score`` (tokens of the
    batch whose logprobs equal the trainer's forward / ``score()`` bit for bit). ``routes=False``
    disables the switch's op replacements (the control: the counts must then fall short)."""
    from shardgen.numerics import mode

    saved = dict(mode._ROUTES)
    if not routes:
        mode._ROUTES.clear()
    try:
        return _rollouts(backend, gather, dtype)
    finally:
        mode._ROUTES.update(saved)  # the world's next scenario gets the switch back


def _rollouts(backend: str, gather: str, dtype: str) -> dict:
    import shardgen

    rank = dist.get_rank()
    lengths = {0: [21, 34, 18], 1: [27], 2: [19, 40]}[rank % 3]
    prompts = id_prompts(lengths, seed=20 + rank)
    heads = [p[:17] for p in prompts]  # the prefix cache serves a whole block (16 tokens) of each
    out: dict[str, list[int]] = {}

    def count(key: str, ok: bool) -> None:
        got = out.setdefault(key, [0, 0])
        got[0] += int(ok)
        got[1] += 1

    base = dict(backend=backend, gather=gather, numerics="invariant", max_batch_size=4)
    model = _model(dtype)
    with shardgen.Engine(model, **base, prefix_cache_tokens=0) as eng:
        batched = eng.rollout(prompts, **KW)
        alone = [eng.rollout([p], **KW) for p in prompts]
        streamed = dict(eng.rollout_iter(prompts, **KW))  # groups as they finish
        turns = eng.rollout(prompts, env=_reply, max_turns=2, **KW)  # the first turn is the rollout's
        with eng.paused(), torch.no_grad(), shardgen.invariant_numerics():
            mine = trainer_logprobs(eng.model, batched)
        scored = eng.score(batched).logprobs
        # Unset under the switch, speculation is on: the repeated prompts above draft from the
        # batched call's rows, and every comparison below holds with it.
        out["speculating"] = [int(eng.config.speculate > 0), 1]
    mask = batched.response_mask.bool()
    for r in range(len(batched)):
        count("trainer", torch.equal(mine[r][mask[r]], batched.logprobs[r][mask[r]]))
        count("score", torch.equal(scored[r][mask[r]], batched.logprobs[r][mask[r]]))
    for i in range(len(prompts)):
        for j in range(KW["n"]):
            tok, lp = _same(alone[i], batched, j, i * KW["n"] + j)
            count("alone", tok)
            count("alone_lp", lp)
            count("streamed", all(_same(streamed[i], batched, j, i * KW["n"] + j)))
            first = turns.logprobs[i * KW["n"] + j][: int(batched.response_mask[i * KW["n"] + j].sum())]
            count("turn", torch.equal(first, batched.logprobs[i * KW["n"] + j][: len(first)]))
    with shardgen.Engine(_model(dtype), **base, prefix_cache_tokens=0, max_prefill_tokens=5,
                         share_prefill=False) as eng:  # fmt: skip
        chunked = eng.rollout(prompts, **KW)
    with shardgen.Engine(_model(dtype), **base) as eng:
        eng.rollout(heads, **{**KW, "max_new_tokens": 2})
        cached = eng.rollout(prompts, **KW)
        hits = eng.stats()["cached_prompt_tokens"]
    for r in range(len(batched)):
        count("chunked", all(_same(chunked, batched, r, r)))
        count("cached", all(_same(cached, batched, r, r)))
    out["cache_hits"] = [int(hits > 0) if prompts else 1, 1]
    return out


def speculative_rollouts(backend: str, gather: str, dtype: str) -> dict:
    """-> {what: [rows equal, rows compared]} for this rank: two epochs over its prompts with
    ``speculate`` on, every row (tokens, logprobs bits) the plain engine's; every other draft
    has its last token made wrong, so that both acceptance and rejection happen; ``drafts``:
    some drafts accepted and some rejected on this rank."""
    import shardgen
    from shardgen.generation import drafts

    real, cost = drafts.DraftStore.draft, drafts.Pacer.cost
    calls = [0]

    def draft(self, seq, limit):  # every other draft's last token wrong
        d = real(self, seq, limit)
        calls[0] += 1
        return [*d[:-1], (d[-1] + 5) % 96] if d and calls[0] % 2 else d

    rank = dist.get_rank()
    prompts = id_prompts({0: [21, 34, 18], 1: [27], 2: [19, 40]}[rank % 3], seed=20 + rank)
    base = dict(backend=backend, gather=gather, numerics="invariant", max_batch_size=4, prefix_cache_tokens=0)
    runs, stats = {}, {}
    drafts.DraftStore.draft = draft  # type: ignore[method-assign]
    # Columns priced as before any is measured: which drafts run does not hang on timings.
    drafts.Pacer.cost = lambda self, width, rows=None: 1.0 + drafts.UNMEASURED_COLUMN_COST * (width - 1)  # type: ignore[method-assign]
    try:
        for spec in (0, 4):
            with shardgen.Engine(_model(dtype), **base, speculate=spec) as eng:
                runs[spec] = [eng.rollout(prompts, **KW) for _ in range(2)]
                stats = eng.stats()
    finally:
        drafts.DraftStore.draft, drafts.Pacer.cost = real, cost  # type: ignore[method-assign]
    out: dict[str, list[int]] = {}
    for epoch, (a, b) in enumerate(zip(runs[0], runs[4], strict=True)):
        same = [all(_same(a, b, r, r)) for r in range(len(a))]
        out[f"epoch{epoch}"] = [sum(same), len(same)]
    out["drafts"] = [int(0 < stats["accepted"] < stats["drafted"]), 1]
    out["folded"] = [int(stats["folded_prefills"] > 0), 1]  # a prefill fed drafts too
    return out


#: Prompts whose answers share no numbers: a rank's own rollouts of the others draft nothing.
SHARED_PROMPTS = ["count from 1 to 20 :", "count down from 60 to 41 :", "count from 25 to 40 :"]


def shared_history(backend: str, gather: str, share: bool = True) -> dict:
    """Each rank decodes one prompt per call, dealt round the ranks (rank r takes prompt r + call),
    as a trainer's sampler deals prompts anew each epoch: from the second call on, a rank's prompt
    is one another rank answered, and the drafts come from that rank's rollout (shared through the
    tick). -> the rows equal to the plain engine's (greedy), the draft tokens accepted per call,
    the rollouts received and the ints a rank may share per tick. ``share``:
    ``EngineConfig.speculate_share`` (False: the control; the tick then carries no payload)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import shardgen
    from shardgen.toy import toy_model_path

    rank, world = dist.get_rank(), dist.get_world_size()
    path = toy_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    rows: dict[int, list] = {}
    accepted = []
    for spec in (0, 8) if share else (8,):  # (the control compares no rows)
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        with shardgen.Engine(
            model, tok, backend=backend, gather=gather, speculate=spec, speculate_share=share
        ) as eng:
            payload = eng._driver.cp.payload  # the ints a rank may share per tick
            rows[spec] = []
            for call in range(world):
                dist.barrier()  # every rank's earlier rollouts are finished (and shared by the next tick)
                before = eng.stats()["accepted"]
                prompt = SHARED_PROMPTS[(rank + call) % world]
                out = eng.generate([prompt], max_new_tokens=24, do_sample=False)
                rows[spec].append(out[0].token_ids)
                if spec:
                    accepted.append(eng.stats()["accepted"] - before)
            received = eng.stats()["drafts_received"]
    return {
        "equal": rows[0] == rows[8] if share else None, "accepted": accepted, "received": received,
        "payload": payload,
    }  # fmt: skip
