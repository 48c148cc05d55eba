"""Multi-turn rollouts and the prefix cache: scenarios for tests/multirank/test_turns_multirank.py (inside the
gloo ranks of a World) that tests/unit/test_turns.py runs in one process too (the local backend).

Every rank runs conversations whose number of turns depends on its rank and row (uneven turns),
on two engines over the same weights: the prefix cache on and off. The caller compares their
rows (``rows_of``) and the prompt tokens each computed.
"""

from __future__ import annotations

from typing import Any

import torch
from models import VOCAB, tiny_model
from numerics import LOGPROB_ATOL

REPLY = 6  # tokens per environment reply
EOS = [2]


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def prompts_of(r: int, count: int, length: int = 20) -> list[list[int]]:
    g = torch.Generator().manual_seed(100 + r)
    return [torch.randint(3, VOCAB, (length + 3 * i,), generator=g).tolist() for i in range(count)]


def env_for(r: int, n: int):
    """Rank ``r``'s environment: a reply of ``REPLY`` ids derived from the conversation so far, and
    the end (None) after ``1 + (r + row // n) % 3`` model turns (rows of a prompt end alike; rows
    and ranks take different numbers of turns). Deterministic: both engines see the same env."""

    seen: dict[int, int] = {}

    def env(row: int, c: Any) -> list[int] | None:
        seen[row] = seen.get(row, 0) + 1  # the model turns of this row so far
        if seen[row] >= 1 + (r + row // n) % 3:
            return None
        ctx = list(c.prompt_token_ids) + list(c.token_ids)
        return [3 + (sum(ctx[-4:]) * (j + 7) + len(ctx)) % (VOCAB - 3) for j in range(REPLY)]

    return env


def rows_of(b) -> list[dict[str, Any]]:
    """Per row: prompt, response tokens, response mask, logprobs, turns (JSON-able)."""
    out = []
    for i in range(len(b)):
        p, g = int(b.prompt_lengths[i]), int(b.response_lengths[i])
        w = b.prompt_width
        out.append({
            "prompt": b.input_ids[i, w - p : w].tolist(),
            "tokens": b.response_ids[i, :g].tolist(),
            "mask": b.response_mask[i, :g].tolist(),
            "logprobs": b.logprobs[i, :g].tolist(),
            "turns": None if b.turns is None else b.turns[i],
            "seed": b.seeds[i],
            "finish": b.finish_reasons[i],
        })  # fmt: skip
    return out


def _scale(model: Any, factor: float) -> None:
    """Change every weight in place (a stand-in for a training step: x * factor + (factor - 1) / 10,
    so that no normalisation undoes it), on its shards: a DeepSpeed-partitioned parameter's
    partition, a DTensor's local shard, or a plain tensor."""
    with torch.no_grad():
        for p in model.parameters():
            part = getattr(p, "ds_tensor", None)
            (part if part is not None else p.data).mul_(factor).add_((factor - 1) / 10)


def conversations(
    backend: str,
    gather: str = "per-layer",
    max_prefill_tokens: int | None = None,
    arch: str = "llama",
    counts: tuple[int, ...] = (2, 1, 0),
    share_prefill: bool = True,
) -> dict[str, Any]:
    """On each engine (cache on: ``prefix_cache_tokens`` None; off: 0): greedy conversations
    (n = 1), sampled ones (n = 2), then ``paused()`` with the weights scaled inside, then the same
    greedy conversations again (the cache must not serve the KV of the old weights). -> per
    engine, the rows of each part and the stats."""
    import shardgen

    r = rank()
    prompts = prompts_of(r, counts[r % len(counts)])
    res: dict[str, Any] = {}
    for name, cap in (("on", None), ("off", 0)):
        model = tiny_model(arch, seed=5)
        opts = dict(backend=backend, gather=gather, max_prefill_tokens=max_prefill_tokens, max_batch_size=4,
                    prefix_cache_tokens=cap, share_prefill=share_prefill)  # fmt: skip
        with shardgen.Engine(model, **opts) as eng:
            kw = dict(max_new_tokens=5, eos_token_id=EOS, max_turns=4)
            greedy = eng.rollout(prompts, n=1, env=env_for(r, 1), do_sample=False, **kw)
            sampled = eng.rollout(prompts, n=2, env=env_for(r, 2), temperature=0.9, seed=r, **kw)
            with eng.paused():
                _scale(eng.model, 1.25)
            after = eng.rollout(prompts, n=1, env=env_for(r, 1), do_sample=False, **kw)
            stats = eng.stats()
        res[name] = {
            "greedy": rows_of(greedy), "sampled": rows_of(sampled), "after": rows_of(after),
            "computed": stats["prefill_tokens"], "cached": stats["cached_prompt_tokens"],
            "drops": stats["prefix_cache_drops"], "policy": eng.gather_policy,
        }  # fmt: skip
    return res


def held_conversations(backend: str, gather: str = "per-layer") -> dict[str, Any]:
    """Partial rollouts of conversations over a training step, uneven per rank: rank r asks for
    a quota of 1 of ``3 - r`` prompts (n = 2) whose rows take ``1 + (r + i) % 3`` turns
    (``env_for``), so rank 0 holds 2 groups, rank 1 one, rank 2 none; ``paused()`` shrinks the
    weights at once, while the held ones are mid-turn or wait at a turn boundary (each forward
    sleeps 3 ms); then a call without env= serves them first, beside one new single-turn prompt.
    Greedy. -> per group served (prompt index, -1 for the new one; turns), the rows spanning the
    step, the groups held after; every drawn token checked against its version's weights
    (``check_versions``: a resumed conversation equals its prefix fed to the new weights)."""

    from rollout_scenarios import _pair, check_versions, shrink_weights, slow_forwards

    import shardgen
    from shardgen.generation.partial import held_groups

    r = rank()
    model, ref = _pair()
    prompts, extra = prompts_of(r, 3 - r), prompts_of(10 + r, 1)
    kw = dict(n=2, max_new_tokens=6, eos_token_id=[], do_sample=False, temperature=0.8)
    with shardgen.Engine(model, backend=backend, gather=gather, max_batch_size=6) as eng:
        slow_forwards(eng)
        first = eng.rollout(prompts, env=env_for(r, 2), max_turns=3, groups=1, max_staleness=1, **kw)
        held = held_groups(eng)
        with eng.paused():  # the held conversations park mid-turn or wait at their boundary
            shrink_weights(model)
        after = eng.rollout(extra, groups=held + 1, max_staleness=1, **kw)
        left = held_groups(eng)
    spans = 0
    for b in (first, after):
        spans += check_versions(b, ref, kw["temperature"], greedy=True)
    given = [tuple(p) for p in prompts] + [tuple(extra[0])]
    served = [(given.index(tuple(p)) if tuple(p) in given[:-1] else -1, b.turns[k * 2 : k * 2 + 2])
              for b in (first, after) for k, p in enumerate(b.prompts)]  # fmt: skip
    return {"served": served, "count": len(prompts), "held": held, "spans": spans, "left": left}


def assert_held_conversations(out: list[dict]) -> None:
    """Every rank's groups served once, whole, in the turns its env gives each prompt's rows
    (the row numbers of the submitting call held across calls); some row spans the step."""
    for r, res in enumerate(out):
        got = sorted(i for i, _ in res["served"])
        assert got == [-1, *range(res["count"])], f"rank {r}: served {res['served']}"
        assert res["held"] == res["count"] - 1 and res["left"] == 0, f"rank {r}: {res}"
        for i, turns in res["served"]:
            want = [1, 1] if i < 0 else [1 + (r + i) % 3] * 2
            assert turns == want, f"rank {r} prompt {i}: turns {turns}, want {want}"
    assert sum(res["spans"] for res in out) > 0, "no conversation spanned the step"


# ----------------------------------------------------------------------------- the checks
def assert_same_rows(on: list[dict], off: list[dict], what: str) -> None:
    """Rows of the cache-on and cache-off engines: the same conversations (tokens, masks, turns),
    logprobs within the numeric promise (the cached path computes in other shapes)."""
    assert len(on) == len(off), what
    for i, (a, b) in enumerate(zip(on, off, strict=True)):
        for key in ("prompt", "tokens", "mask", "turns", "seed", "finish"):
            assert a[key] == b[key], f"{what} row {i}: {key} {a[key]} != {b[key]}"
        diff = max((abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"], strict=True)), default=0.0)
        assert diff <= LOGPROB_ATOL, f"{what} row {i}: logprobs {diff:.3g} apart"


def assert_conversations(res: dict, cached: bool = True) -> None:
    on, off = res["on"], res["off"]
    for part in ("greedy", "sampled", "after"):
        assert_same_rows(on[part], off[part], part)
    assert off["cached"] == 0 and off["drops"] == 0
    if cached:
        assert on["cached"] > 0 and on["computed"] + on["cached"] == off["computed"], (on, off)
        assert on["drops"] > 0  # the pause dropped what the cache held
    else:
        assert on["cached"] == 0 and on["computed"] == off["computed"]
    # the pause changed the weights (the same conversations score differently), and the cache-on
    # engine's rows after it equal the cache-off engine's (above): no KV of the old weights served
    assert [r["logprobs"][:3] for r in on["after"]] != [r["logprobs"][:3] for r in on["greedy"]]


def turn_gaps(backend: str) -> dict[str, Any]:
    """``gather="once"``: the whole weights stay gathered across a multi-turn call's turns and go
    back once it returns, or once it is left open (a ``rollout_iter`` not read on) for
    ``TURN_HOLD_TICKS`` idle ticks; a partial rollout's call (``groups=``) keeps them too. Every
    rank alike: 2 prompts (n = 1) whose conversations take
    1 and 3 model turns, an environment that sleeps 50 ms a step (every turn's gap is idle on
    every rank). -> the whole-model gathers of the call, whether the weights went back after
    it and after the iterator was left open, and the multi-turn calls open then."""
    import time

    import shardgen

    seen: dict[int, int] = {}

    def env(row: int, c: Any) -> list[int] | None:
        time.sleep(0.05)
        seen[row] = seen.get(row, 0) + 1  # model turns so far: row 0 ends after 1, row 1 after 3
        return None if seen[row] >= 1 + 2 * row else [3 + row] * REPLY

    def released(eng: Any, within: float) -> bool:
        """Within ``within`` s, the replica released: the flag down and its storage freed (as
        ``engine_scenarios.gather_policy`` checks a release)."""
        deadline = time.monotonic() + within
        while eng._driver.gathered and time.monotonic() < deadline:
            time.sleep(0.01)
        return not eng._driver.gathered and eng.backend.gathered_bytes() == 0

    prompts = prompts_of(rank(), 2)
    kw = dict(n=1, env=env, max_turns=4, max_new_tokens=3, eos_token_id=[], do_sample=False)
    model = tiny_model("llama", seed=5)
    with shardgen.Engine(model, backend=backend, gather="once", max_batch_size=4) as eng:
        b = eng.rollout(prompts, **kw)
        gathers = eng.stats()["whole_gathers"]
        after_call = released(eng, 5.0)
        seen.clear()
        it = eng.rollout_iter(prompts, **kw)
        first = next(it)  # the 1-turn conversation; the other's next turn waits on this iterator
        t0 = time.monotonic()
        after_open = released(eng, 10.0)
        held_s = time.monotonic() - t0
        open_calls = eng._shared.turns_open()
        it.close()
        seen.clear()
        before = eng.stats()["whole_gathers"]
        quota = eng.rollout(prompts, groups=2, **kw)  # a partial rollout's conversations alike
        quota_gathers = eng.stats()["whole_gathers"] - before
    return {"turns": b.turns, "gathers": gathers, "after_call": after_call, "first": first[0],
            "after_open": after_open, "held_s": held_s, "open_calls": open_calls,
            "quota_turns": quota.turns, "quota_gathers": quota_gathers}  # fmt: skip
