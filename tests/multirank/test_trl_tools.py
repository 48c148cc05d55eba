"""TRL's ``tools=`` loop on shardgen's GRPOTrainer, 2 and 3 gloo ranks, FSDP2 and DeepSpeed ZeRO-3:
ranks take different numbers of tool turns, each turn's prompt is the turn before plus the tool's
reply (TRL concatenates the ids), and the rank's prefix cache serves all of it but the reply.

The model is tests/helpers/tool_model.py's, shipped under tests/helpers/assets/tool-model (checked on
load): it calls ``add`` 0, 1 or 2 times depending on the question, then answers."""

from __future__ import annotations

import importlib.util

import pytest
import tool_model as tm
import trl_tool_scenarios as sc
from world import WorldError, WorldHang

pytestmark = [
    pytest.mark.multirank,
    pytest.mark.skipif(
        importlib.util.find_spec("trl") is None, reason="needs trl (pip install 'shardgen[trl]')"
    ),
]

STEP_S = 300  # one GRPO step, the trainer built and torn down; a few seconds when warm
STOCK_BOUND_S = 120.0  # TRL's stock trainer with uneven tool turns: aborts (gloo) or hangs

UNEVEN = {  # rank r's questions: 0 tool turns on rank 0, 2 on rank 1, 1 on rank 2
    2: [["Say hi.", "Say bye."], ["What is 3 plus 4 plus 5?", "What is 3 plus 4?"]],
    3: [
        ["Say hi.", "Say bye."],
        ["What is 3 plus 4 plus 5?", "What is 3 plus 4?"],
        ["What is 2 plus 5?", "Say hi."],
    ],
}
EVEN = [["What is 3 plus 4 plus 5?", "Say hi."], ["What is 1 plus 2 plus 6?", "What is 2 plus 5?"]]


@pytest.fixture(scope="module")
def model_path() -> str:
    return tm.shipped()


def tool_calls(text: str) -> int:
    return text.count("<tool_call>")


def new_tokens(out: dict) -> int:
    """Prompt tokens a rank must compute at least: each distinct first prompt, and per distinct
    row each later turn's tool reply plus the previous answer's last token (identical rows, the
    overfit model's samples of one question, share their prefills)."""
    rows = {
        (tuple(p), tuple(c), tuple(m))
        for p, c, m in zip(out["prompt_ids"], out["completion_ids"], out["tool_mask"], strict=True)
    }
    first = sum(len(p) for p in {r[0] for r in rows})
    later = 0
    for _, _, mask in rows:
        runs = [len(r) for r in "".join(map(str, mask)).split("1") if r]  # the tool replies
        later += sum(n + 1 for n in runs)
    return first + later


# At 2 ranks in `make fuzz` (about 19 CPU-s for both backends); 3 ranks here.
# At 3 ranks on FSDP2 in `make test` (DeepSpeed's uneven turns: test_environment_factory_uneven_turns);
# the rest in `make fuzz`.
@pytest.mark.parametrize(
    "backend, n",
    [
        ("fsdp2", 3),
        pytest.param("deepspeed", 3, marks=pytest.mark.long),
        pytest.param("fsdp2", 2, marks=pytest.mark.long),
        pytest.param("deepspeed", 2, marks=pytest.mark.long),
    ],
)
def test_tool_loop_uneven_turns_no_reprefill(worlds, model_path, backend, n):
    world = worlds[n]
    cached = world.run(sc.grpo_tool_step, backend, model_path, UNEVEN[n], "cache", timeout=STEP_S)
    plain = world.run(sc.grpo_tool_step, backend, model_path, UNEVEN[n], "nocache", timeout=STEP_S)
    turns = [1 + max(tm.TOOL_TURNS[q] for q in qs) for qs in UNEVEN[n]]
    assert [len(o["calls"]) for o in cached] == turns  # ranks made different numbers of calls
    assert [len(o["calls"]) for o in plain] == turns
    for r, (c, p) in enumerate(zip(cached, plain, strict=True)):
        assert c["steps"] == p["steps"] == 1
        # the rows: each question twice (num_generations=2), its tool turns, then its answer
        questions = [q for q in UNEVEN[n][r] for _ in range(2)]
        assert [tool_calls(t) for t in c["texts"]] == [tm.TOOL_TURNS[q] for q in questions], (r, c["texts"])
        assert [
            t.endswith(tm.ANSWERS[q] + "<|im_end|>") for t, q in zip(c["texts"], questions, strict=True)
        ] == [True] * 4
        # the uncached engine's tokens, masks and prompts, exactly
        assert c["completion_ids"] == p["completion_ids"], r
        assert c["tool_mask"] == p["tool_mask"], r
        assert c["prompt_ids"] == p["prompt_ids"], r
        assert c["reward"] == p["reward"] == 1.0
        assert c["logp_diff"] < 1e-4  # sampling logprobs against training's, over the model's tokens
        # no re-prefill: the cache held every earlier turn; only the replies were computed
        cs, ps = c["stats"], p["stats"]
        assert ps["cached_prompt_tokens"] == 0
        assert cs["prefill_tokens"] == new_tokens(c), (r, cs)
        assert cs["prefill_tokens"] + cs["cached_prompt_tokens"] == ps["prefill_tokens"], (r, cs, ps)
        if turns[r] > 1:
            assert cs["cached_prompt_tokens"] > 0 and cs["prefill_tokens"] < ps["prefill_tokens"], (r, cs, ps)
        # the phase's tool turns are one multi-turn call: under `once` (what `auto` takes for this
        # model) the whole model is gathered once in it, not again after each tool call (each an
        # idle gap of TOOL_S on the rank that made it)
        for st in (cs, ps):
            assert st["gather"] == "once" and st["whole_gathers"] == 1, (r, st)


@pytest.mark.parametrize("backend", ["fsdp2", "deepspeed"])
def test_environment_factory_uneven_turns(worlds, model_path, backend):
    """TRL's ``environment_factory`` (the tool as an environment's method) runs the same loop:
    the same tokens as ``tools=`` and, again, only the replies prefilled."""
    world = worlds[2]
    env = world.run(sc.grpo_tool_step, backend, model_path, UNEVEN[2], "cache", 1.0, True, timeout=STEP_S)
    tools = world.run(sc.grpo_tool_step, backend, model_path, UNEVEN[2], "cache", timeout=STEP_S)
    assert [len(o["calls"]) for o in env] == [1, 3]
    for e, t in zip(env, tools, strict=True):
        assert e["completion_ids"] == t["completion_ids"] and e["tool_mask"] == t["tool_mask"]
        assert e["stats"]["prefill_tokens"] == new_tokens(e), e["stats"]


@pytest.mark.parametrize("backend", ["fsdp2", "deepspeed"])
def test_tool_loop_equals_stock_trl(worlds, model_path, backend):
    """Where TRL's own loop runs (every rank takes the same number of turns), near-greedy
    (temperature 0.05) completions and tool masks equal its own, token for token."""
    world = worlds[2]
    ours = world.run(sc.grpo_tool_step, backend, model_path, EVEN, "cache", 0.05, timeout=STEP_S)
    stock = world.run(sc.grpo_tool_step, backend, model_path, EVEN, "stock", 0.05, timeout=STEP_S)
    assert [len(o["calls"]) for o in ours] == [len(o["calls"]) for o in stock] == [3, 3]
    for o, s in zip(ours, stock, strict=True):
        assert o["completion_ids"] == s["completion_ids"]
        assert o["tool_mask"] == s["tool_mask"]
        assert o["prompt_ids"] == s["prompt_ids"]
        assert o["stats"]["cached_prompt_tokens"] > 0


def test_stock_trl_fails_with_uneven_tool_turns(worlds, model_path):
    """The same uneven step on TRL's own generation (DeepSpeed ZeRO-3): it never finishes."""
    with pytest.raises((WorldError, WorldHang)):
        worlds[2].run(sc.grpo_tool_step, "deepspeed", model_path, UNEVEN[2], "stock", timeout=STOCK_BOUND_S)


@pytest.mark.long
def test_tool_model_rebuilds_as_shipped(tmp_path) -> None:
    """``python tests/helpers/tool_model.py`` still trains the shipped model: the same tokenizer and config,
    and a model that passes the shipped copy's check (``build`` raises when it underfits)."""
    import json

    path = tm.build(tmp_path)
    for name in ("tokenizer.json", "config.json"):
        assert json.loads((tmp_path / name).read_text()) == json.loads((tm.SHIPPED / name).read_text())
    assert path == str(tmp_path)
