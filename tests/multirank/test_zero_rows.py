"""Zero rows through every public result type: each field empty (a list ``[]``, a tensor of zero
rows in the dtype and trailing shape that R rows have), never None, so a rank with no prompts runs
the same code as its peers (``zip(prompts, batch.texts)``, ``torch.cat``, indexing) and reaches
their ``paused()``. On ``backend="local"``, and at 2 FSDP2 ranks, one with no rows.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from world import rank

import shardgen
from shardgen.rollout import RolloutBatch, concat
from shardgen.toy import toy_model_path

PROMPTS = ["count from 1 to 3 :", "count from 4 to 6 :"]
SCORE_VARIANTS: list[dict[str, Any]] = [
    {},
    {"entropy": False},
    {"top_k": 3},
    {"logits": True},
    {"top_k": 2, "logits": True, "temperature": 0.7},
]


def _like(empty: Any, full: Any, what: str) -> list[str]:
    """Every field of ``empty`` (zero rows) set as ``full``'s (rows) is: not None where ``full``'s
    is not, an empty list for a list, a tensor of 0 rows in ``full``'s dtype with its trailing
    dims (the response width aside: G is 0 at zero rows)."""
    bad = []
    for f in dataclasses.fields(empty):
        e, x = getattr(empty, f.name), getattr(full, f.name)
        where = f"{what}.{f.name}"
        if x is None:  # not asked for (ScoreBatch's top_k=0, logits=False): None at any row count
            if e is not None:
                bad.append(f"{where}: {type(e).__name__} where rows have None")
        elif e is None:
            bad.append(f"{where} is None at zero rows")
        elif isinstance(x, torch.Tensor):
            if not isinstance(e, torch.Tensor) or e.dtype != x.dtype or e.dim() != x.dim():
                bad.append(f"{where}: {e!r} at zero rows, rows have {x.dtype} of {x.dim()} dims")
            elif e.shape[0] != 0 or tuple(e.shape[2:]) != tuple(x.shape[2:]):
                bad.append(f"{where}: shape {tuple(e.shape)} at zero rows, rows {tuple(x.shape)}")
        elif isinstance(x, list) and e != []:
            bad.append(f"{where}: {e!r} at zero rows, not []")
    return bad


def _usable(b: RolloutBatch) -> list[str]:
    """What a trainer does with a batch, at zero rows: zip, slice, cat, mask arithmetic."""
    bad = []
    if list(zip([], b.texts, strict=True)) != []:
        bad.append("zip(prompts, texts)")
    if b.prompt_width != 0 or b.response_ids.shape != (0, 0) or b.response_lengths.shape != (0,):
        bad.append(f"widths: P {b.prompt_width}, response ids {tuple(b.response_ids.shape)}")
    if float((b.logprobs * b.response_mask).sum()) != 0.0 or torch.cat([b.logprobs, b.logprobs]).shape[0]:
        bad.append("logprobs * response_mask")
    return bad


def zero_row_problems(engine: Any, prompts: list[str]) -> list[str]:
    """Every public call returning rows, with no prompts, against the same call with ``prompts``
    (which a peer may be making at the same time: the engine's calls are not collective)."""
    bad: list[str] = []
    env = lambda row, completion: None  # noqa: E731  ends every row after its first turn
    kw: dict[str, Any] = {"max_new_tokens": 6, "seed": 3}
    full = engine.rollout(prompts, n=2, **kw)
    for what, empty in [
        ("rollout([])", engine.rollout([], n=2, **kw)),
        ("rollout([], env=)", engine.rollout([], n=2, env=env, max_turns=2, **kw)),
        ("concat([])", concat([])),
        ("concat([rollout([])])", concat([engine.rollout([], n=2, **kw)])),
    ]:
        bad += _like(empty, full, what) + _usable(empty)
    multi = engine.rollout(prompts, n=2, env=env, max_turns=2, **kw)
    bad += _like(engine.rollout([], n=2, env=env, max_turns=2, **kw), multi, "rollout([], env=) vs env rows")
    if multi.turns != [1] * len(multi) or full.turns != [1] * len(full):
        bad.append(f"turns per row: {multi.turns}, {full.turns}")
    if list(engine.rollout_iter([], n=2, **kw)) != [] or list(engine.rollout_iter([], env=env, **kw)) != []:
        bad.append("rollout_iter([]) yields groups")
    joined = concat([engine.rollout([], n=2, **kw), full])  # an empty group beside others
    if joined.input_ids.tolist() != full.input_ids.tolist() or joined.texts != full.texts:
        bad.append("concat of an empty group and a full one differs from the full one")
    empty_batch = engine.rollout([], n=2, **kw)
    for opts in SCORE_VARIANTS:
        rows = engine.score(full, **opts)
        bad += _like(engine.score([], [], **opts), rows, f"score([], [], {opts})")
        bad += _like(engine.score(empty_batch, **opts), rows, f"score(empty batch, {opts})")
    if engine.generate([]) != [] or engine.submit_many([]) != []:
        bad.append("generate([]) / submit_many([]) not []")
    for given in ([], torch.zeros((0, 0), dtype=torch.long)):
        out = engine.generate_ids(given)
        if out.shape != (0, 0) or out.dtype != torch.long:
            bad.append(f"generate_ids({given!r}): {tuple(out.shape)} {out.dtype}")
    out = engine.generate_ids(torch.zeros((0, 5), dtype=torch.long), torch.zeros((0, 5), dtype=torch.long))
    if out.shape != (0, 5):
        bad.append(f"generate_ids of [0, 5]: {tuple(out.shape)}")
    return bad


def test_zero_rows_local():
    with shardgen.Engine.from_pretrained(toy_model_path(), backend="local") as engine:
        assert zero_row_problems(engine, PROMPTS) == []


def test_the_check_sees_a_none_field():
    """The check itself: a None where rows have a value, or a wrong dtype, is named."""
    full = RolloutBatch(*(torch.zeros((1, 2), dtype=torch.long),) * 3, torch.zeros((1, 2)),
                        torch.ones(1, dtype=torch.long), ["eos"], [1], texts=["a"], turns=[1])  # fmt: skip
    empty = dataclasses.replace(full, input_ids=torch.zeros((0, 0)), texts=None, finish_reasons=[], seeds=[],
                                turns=[], attention_mask=full.attention_mask[:0, :0],
                                response_mask=full.response_mask[:0, :0], logprobs=full.logprobs[:0, :0],
                                prompt_lengths=full.prompt_lengths[:0])  # fmt: skip
    assert _like(empty, full, "b") == [
        "b.input_ids: tensor([], size=(0, 0)) at zero rows, rows have torch.int64 of 2 dims",
        "b.texts is None at zero rows",
    ]


# ----------------------------------------------------------------- 2 ranks, one with no rows
def scenario_zero_rows_fsdp2() -> dict[str, Any]:
    """Rank 0 has no prompts, rank 1 two: each makes every call with what it has, then both train
    as the README's loop does (a rank with no rows: one dummy forward and backward, zero loss)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(toy_model_path())
    model = AutoModelForCausalLM.from_pretrained(toy_model_path())
    prompts = PROMPTS[: 2 * rank()]
    with shardgen.Engine(model, tok, backend="fsdp2") as engine:
        bad = zero_row_problems(engine, PROMPTS) if rank() == 0 else []
        batch = engine.rollout(prompts, n=2, max_new_tokens=6, seed=1)
        pairs = list(zip([p for p in prompts for _ in range(2)], batch.texts, strict=True))
        with engine.paused():  # collective: rank 0 gets here too
            if len(batch):
                logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
                loss = logits[:, batch.prompt_width - 1 : -1].float().logsumexp(-1).mean()
            else:
                loss = model(input_ids=torch.zeros((1, 1), dtype=torch.long)).logits.sum() * 0.0
            loss.backward()
            model.zero_grad()
    return {"bad": bad, "rows": len(batch), "pairs": len(pairs)}


@pytest.mark.multirank
def test_zero_rows_fsdp2_one_rank_empty(world2):
    out = world2.run(scenario_zero_rows_fsdp2, timeout=240)
    assert out[0]["bad"] == [], out[0]["bad"]
    assert [(o["rows"], o["pairs"]) for o in out] == [(0, 0), (4, 4)]
