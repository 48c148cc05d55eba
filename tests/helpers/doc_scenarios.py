"""Rank-side harnesses for the docs' python blocks that need ranks (tests/multirank/test_doc_snippets.py runs
them on its 2-rank DeepSpeed-ready World): each runs a block's text as written (``exec``) in a
namespace holding real objects for its free names only, so an undefined name or a wrong call
fails, then checks what the block left.

Every harness is collective in the blocks' own sense: every rank calls ``run_block`` with the same
name and code, and each harness closes the engines it or its block opened in the order they were
opened (``closing``)."""

from __future__ import annotations

import contextlib
import copy
import os
import tempfile
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

import shardgen
from shardgen import toy


def _exec(code: str, name: str, ns: dict[str, Any]) -> dict[str, Any]:
    exec(compile(code, f"<doc block {name}>", "exec"), ns)
    return ns


@contextlib.contextmanager
def closing() -> Iterator[tuple[types.ModuleType, list[Any]]]:
    """``shardgen`` as a block sees it, its ``Engine`` (and ``Engine.from_pretrained``) keeping
    each engine it makes, and that list; on the way out each engine still open is closed, in the
    order made (``close`` is collective and idempotent: every rank, the same order). A summary
    block may rebind ``engine`` to a second one and never close the first."""
    made: list[Any] = []

    class Engine(shardgen.Engine):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    module = types.ModuleType("shardgen")
    module.__dict__.update(vars(shardgen))
    module.Engine = Engine  # type: ignore[attr-defined]
    try:
        yield module, made
    finally:
        for engine in made:
            engine.close()


@contextlib.contextmanager
def in_temp_dir() -> Iterator[str]:
    """A block that names a relative ``output_dir`` writes under a fresh directory, not the repo."""
    here = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="shardgen-doc-") as d:
        os.chdir(d)
        try:
            yield d
        finally:
            os.chdir(here)


def _toy() -> tuple[Any, Any]:
    """The toy model (its weights the same on every rank) and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = toy.toy_model_path()
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def _my_prompts() -> list[str]:
    """Rank r's prompts: r + 1 of them, so ranks hold different row counts."""
    tasks = ["count from 1 to 4 :", "count down from 9 to 6 :", "count from 3 to 7 :"]
    return tasks[: dist.get_rank() + 1]


def _counts(engine: Any, prompt: str = "count from 2 to 5 :") -> None:
    """The engine answers the toy task right (greedy): the block left a working engine."""
    (out,) = engine.generate([prompt], max_new_tokens=16)
    assert toy.check_answer(prompt, out.text), (prompt, out.text)


# ------------------------------------------------------------------ docs/USAGE.md, fsdp2


def api_summary(code: str) -> dict[str, Any]:
    """USAGE "The Python API": both constructors, every call, on the toy model."""
    model, tok = _toy()
    prompts = _my_prompts()
    enc = tok(prompts[:1], return_tensors="pt")
    with closing() as (sg, made):
        ns = _exec(code, "USAGE API", {
            "shardgen": sg, "model": model, "tok": tok, "path": toy.toy_model_path(), "prompts": prompts,
            "prompt": prompts[-1], "input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
            "overrides": {"max_new_tokens": 16},
        })  # fmt: skip
        assert len(made) == 2 and made[1] is ns["engine"], made  # the block's two engines
    assert all(toy.check_answer(p, o.text) for p, o in zip(prompts, ns["outs"], strict=True)), ns["outs"]
    assert ns["ids"].shape[0] == 1 and toy.check_answer(prompts[-1], ns["fut"].result().text)
    assert len(ns["batch"]) == len(prompts)
    return {"engines": len(made)}


def ref_kl(code: str) -> dict[str, Any]:
    """USAGE's GRPO step with a KL to a frozen reference, README's ``my_logprobs``, ranks holding
    different row counts; the reference starts as the policy, so the KL is ~0."""
    from doc_blocks import readme_function

    torch.manual_seed(0)
    model, tok = _toy()
    ref_model = copy.deepcopy(model)
    my_prompts = _my_prompts()
    helpers = _exec(readme_function("rl.py", "my_logprobs"), "README my_logprobs", {"torch": torch})
    with closing() as (sg, made):
        engine = sg.Engine(model, tok, backend="fsdp2")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        ns = _exec(code, "USAGE ref KL", {
            "shardgen": sg, "torch": torch, "engine": engine, "model": model, "ref_model": ref_model,
            "my_prompts": my_prompts, "T": 1.0, "step": 0, "my_logprobs": helpers["my_logprobs"],
            "adv": torch.randn(4 * len(my_prompts)), "beta": 0.04, "world": dist.get_world_size(),
            "all_ranks_tokens": 64.0, "opt": opt,
        })  # fmt: skip
        assert len(made) == 2, made
    kl, m = ns["kl"], ns["m"]
    assert kl.shape == m.shape == (4 * len(my_prompts), m.shape[1]), (kl.shape, m.shape)
    assert float((kl * m).detach().abs().max()) < 1e-4, kl  # the reference's score is the policy's own
    return {"rows": int(m.shape[0])}


def hsdp(code: str) -> dict[str, Any]:
    """USAGE's HSDP block on 2 ranks as 2 nodes of 1 rank (a (2, 1) mesh: an engine per rank)
    and as 1 node of 2 (a (1, 2) mesh: one engine over both); ``LOCAL_WORLD_SIZE`` is torchrun's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    groups = []
    saved = os.environ["LOCAL_WORLD_SIZE"]
    try:
        for per_node in (1, world):
            os.environ["LOCAL_WORLD_SIZE"] = str(per_node)
            model, tok = _toy()
            with closing() as (sg, made):
                ns = _exec(code, "USAGE HSDP", {
                    "os": os, "torch": torch, "init_device_mesh": init_device_mesh,
                    "fully_shard": fully_shard, "shardgen": sg, "model": model, "tok": tok, "world": world,
                })  # fmt: skip
                engine = ns["engine"]
                assert ns["mesh"].shape == (world // per_node, per_node), ns["mesh"]
                _counts(engine)
                groups.append(list(engine.ranks))
    finally:
        os.environ["LOCAL_WORLD_SIZE"] = saved
    assert groups == [[rank], list(range(world))], groups
    return {"groups": groups}


# ------------------------------------------------------------------ docs/USAGE.md, DeepSpeed


def ds_engines(code: str) -> dict[str, Any]:
    """USAGE's two ways to a DeepSpeed engine (the block's "# or" line parts them), each on a fresh
    copy of the toy model: shardgen partitions it, or ``deepspeed.initialize`` did."""
    import deepspeed

    first, sep, second = code.partition("# or you partitioned it:\n")
    assert sep, "the block's second way starts '# or you partitioned it:'"
    stage3 = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    for part in (first, second):
        model, tok = _toy()
        with closing() as (sg, made):
            ns = _exec(part, "USAGE DeepSpeed", {
                "shardgen": sg, "deepspeed": deepspeed, "model": model, "tok": tok,
                "my_stage3_config": stage3,
            })  # fmt: skip
            assert made == [ns["engine"]], made
            _counts(ns["engine"])
    return {"ways": 2}


def ds_rollout(code: str) -> dict[str, Any]:
    """USAGE's ``ShardgenRollout`` loop on the toy model: 2 steps, rank r holding r + 1 prompts."""
    import deepspeed

    model, tok = _toy()
    tok.padding_side = "left"
    loader = []
    for step in range(2):
        prompts = [f"count from {step + 1} to {step + 4} :"] * (dist.get_rank() + 1)
        enc = tok(prompts, return_tensors="pt", padding=True)
        loader.append((enc["input_ids"], enc["attention_mask"]))
    losses: list[float] = []

    def my_loss(logits: torch.Tensor, targets: Any) -> torch.Tensor:
        """Mean negative log-likelihood of the response tokens."""
        logp = targets.select_causal_logits(logits).float().log_softmax(-1)
        logp = logp.gather(-1, targets.target_ids[..., None]).squeeze(-1)
        loss = -(logp * targets.response_mask).sum() / targets.response_mask.sum().clamp(min=1)
        losses.append(float(loss.detach()))
        return loss

    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": 3},
    }
    ns = _exec(code, "USAGE ShardgenRollout", {
        "deepspeed": deepspeed, "model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.01),
        "zero3_config": config, "tokenizer": tok, "loader": loader, "my_loss": my_loss,
    })  # fmt: skip
    assert ns["rollout"].shardgen_engine._shared.closed  # the block's shutdown() closed its engine
    assert len(losses) == 2 and all(x == x and x > 0 for x in losses), losses
    assert ns["batch"].input_ids.shape[0] == dist.get_rank() + 1, ns["batch"].input_ids.shape
    return {"losses": losses}


# ------------------------------------------------------------------ TRL (README and USAGE)


def _grpo(code: str, name: str, backend: str, path: str, rows: list, reward: Callable, length: int) -> Any:
    """Run a TRL block (``args = GRPOConfig(output_dir=..., **my_settings)``) for one GRPO step on
    ``backend``, the model from ``path``, completions of up to ``length`` tokens; returns the trainer."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl_scenarios import clear_trainer_state, trainer_model

    tok = AutoTokenizer.from_pretrained(path)
    model, ds_config = trainer_model(backend, path)
    settings = dict(
        per_device_train_batch_size=2, num_generations=2, max_completion_length=length, max_steps=1, beta=0.0,
        logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, seed=0, deepspeed=ds_config,
        bf16=False, gradient_checkpointing=False, use_cpu=True,  # what the docs say CPUs need
    )  # fmt: skip
    try:
        with in_temp_dir():
            ns = _exec(code, name, {
                "shardgen": shardgen, "model": model, "reward": reward, "tok": tok, "my_settings": settings,
                "ds": Dataset.from_list([{"prompt": p} for p in rows]),
            })  # fmt: skip
    finally:
        clear_trainer_state()
    trainer = ns["trainer"]
    assert trainer.state.global_step == 1 and trainer.shardgen_engine is None, trainer.state
    assert any("reward" in h for h in trainer.state.log_history), trainer.state.log_history
    return trainer


def trl_tools(code: str) -> dict[str, Any]:
    """README's TRL tool loop (its own ``add``) on the tool model, FSDP2; questions that call the
    tool on one rank only, so ranks take different numbers of turns."""
    import tool_model as tm
    import trl_tool_scenarios as tsc

    questions = ["Say hi.", "What is 3 plus 4 plus 5?"]  # rank r's row: questions[r] (in order)
    rows = [tm.prompt(q) for q in questions]
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    trainer = _grpo(code, "README TRL tools", "fsdp2", tm.shipped(), rows, tsc.reward, 160)
    metric = "tools/call_frequency"
    (frequency,) = [h[metric] for h in trainer.state.log_history if metric in h]
    assert frequency > 0, trainer.state.log_history  # the block's own add() was called
    return {"tool_calls": frequency}


def trl(code: str) -> dict[str, Any]:
    """USAGE's TRL block on the toy model, DeepSpeed ZeRO-3 (``GRPOConfig(deepspeed=...)``)."""
    from trl_scenarios import reward

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    rows = ["count from 1 to 4 :", "count down from 8 to 5 :"]
    trainer = _grpo(code, "USAGE TRL", "deepspeed", toy.toy_model_path(), rows, reward, 12)
    return {"steps": trainer.state.global_step}


def partial_loop(code: str) -> dict[str, Any]:
    """README's partial-rollout loop: 3 steps of a quota of 2 groups on ranks asking 3 and 4
    prompts a step (so held groups pile up unevenly), README's ``my_logprobs``; every group
    served whole, and some held across a step (versions of two kinds in the served tokens)."""
    from doc_blocks import readme_function

    torch.manual_seed(0)
    model, tok = _toy()
    tasks = ["count from 1 to 9 :", "count down from 9 to 1 :", "count from 3 to 12 :", "count from 2 to 4 :"]
    my_prompts = tasks[: 3 + dist.get_rank()]
    helpers = _exec(readme_function("rl.py", "my_logprobs"), "README my_logprobs", {"torch": torch})
    served: list[Any] = []

    def advantages(batch: Any) -> torch.Tensor:
        served.append(batch)
        r = torch.tensor([float(len(t)) for t in batch.texts])
        return (r - r.mean()) / (r.std() + 1e-6) if len(r) > 1 else r * 0

    with closing() as (sg, made):
        engine = sg.Engine(model, tok, backend="fsdp2")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        _exec(code, "README partial rollouts", {
            "engine": engine, "model": model, "opt": opt, "my_prompts": my_prompts, "steps": 3,
            "advantages": advantages, "my_logprobs": helpers["my_logprobs"], "torch": torch,
        })  # fmt: skip
    assert [len(b) for b in served] == [8, 8, 8], [len(b) for b in served]  # 2 whole groups of 4
    versions = {int(v) for b in served for v in b.versions[b.response_mask.bool()]}
    return {"versions": sorted(versions)}


HARNESSES: dict[str, Callable[[str], dict[str, Any]]] = {
    f.__name__: f for f in (api_summary, ref_kl, hsdp, ds_engines, ds_rollout, trl_tools, trl, partial_loop)
}


def run_block(harness: str, code: str) -> dict[str, Any]:
    """Run ``code`` in ``HARNESSES[harness]``; every rank calls it with the same arguments."""
    return HARNESSES[harness](code)


def planted(harness: str, code: str, name: str) -> str:
    """Run ``code`` (a block with ``name`` planted in it, undefined) in the harness: the
    ``NameError`` naming it, as text; any other outcome fails."""
    try:
        HARNESSES[harness](code)
    except NameError as e:
        assert name in str(e), e
        return str(e)
    raise AssertionError(f"{harness}: the block ran with {name} undefined")
