"""Scenarios for tests/multirank/test_trl_tools.py: one GRPO step of TRL's ``tools=`` loop (shardgen's
subclass, cache on or off, or TRL's stock trainer) on the tool model of tests/helpers/tool_model.py,
inside the gloo ranks of a World. Each rank is given its own questions, so ranks take different
numbers of tool turns."""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

import torch.distributed as dist

MODES = ("cache", "nocache", "stock")


def reward(prompts, completions, **_):
    """1 when the last assistant message is the question's answer."""
    import tool_model as tm

    out = []
    for p, c in zip(prompts, completions, strict=True):
        said = [m for m in c if m["role"] == "assistant"]
        out.append(float(bool(said) and said[-1].get("content", "").strip() == tm.ANSWERS[p[-1]["content"]]))
    return out


def recording(cls: type) -> type:
    """``cls`` keeping what each ``_generate`` returned, each generation call's prompt lengths and
    the engine's counters (when there is one) right after the generation phase."""

    class Recording(cls):
        def _generate(self, prompts):
            start = time.perf_counter()
            out = super()._generate(prompts)
            self.rec_generate_s = time.perf_counter() - start
            self.rec_out = {"prompt_ids": out[0], "completion_ids": out[1], "tool_mask": out[2]}
            engine = getattr(self, "shardgen_engine", None)
            self.rec_stats = engine.stats() if engine is not None else None
            if engine is not None:
                self.rec_stats["gather"] = engine.gather_policy
            return out

        def _generate_single_turn(self, prompt_ids, *args, **kwargs):
            self.__dict__.setdefault("rec_calls", []).append([len(p) for p in prompt_ids])
            return super()._generate_single_turn(prompt_ids, *args, **kwargs)

    return Recording


def grpo_tool_step(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """``_grpo_tool_step``, then ``trl_scenarios.clear_trainer_state``."""
    from trl_scenarios import clear_trainer_state

    try:
        return _grpo_tool_step(*args, **kwargs)
    finally:
        clear_trainer_state()


def _grpo_tool_step(
    backend: str,
    model_path: str,
    questions: list[list[str]],
    mode: str,
    temperature: float = 1.0,
    environment: bool = False,
) -> dict[str, Any]:
    """One GRPO step with ``tools=[add]`` (``environment``: ``environment_factory=AddEnv``, the
    same tool as an environment's method); rank r's batch holds ``questions[r]`` (each asked
    ``num_generations=2`` times). Returns this rank's generation outputs and counters."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import tool_model as tm
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig
    from trl import GRPOTrainer as StockGRPOTrainer

    import shardgen
    from shardgen.integrations.trl import GRPOTrainer

    assert mode in MODES, mode
    world, rank = dist.get_world_size(), dist.get_rank()
    assert len(questions) == world and len({len(q) for q in questions}) == 1, questions
    per_rank = len(questions[0])
    tok = AutoTokenizer.from_pretrained(model_path)
    from trl_scenarios import trainer_model

    model, ds_config = trainer_model(backend, model_path)
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="shardgen-trl-tools-"),
        per_device_train_batch_size=2 * per_rank,
        num_generations=2,
        max_completion_length=160,
        temperature=temperature,
        max_steps=1,
        beta=0.0,
        shuffle_dataset=False,  # rank r's rows are questions[r], in order (TRL's RepeatSampler)
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        bf16=False,
        gradient_checkpointing=False,
        deepspeed=ds_config,
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    kwargs: dict[str, Any] = {}
    if mode != "stock":
        cache = None if mode == "cache" else 0
        kwargs["shardgen_config"] = shardgen.EngineConfig(max_batch_size=8, prefix_cache_tokens=cache)
    cls = recording(StockGRPOTrainer if mode == "stock" else GRPOTrainer)
    rows = [{"prompt": tm.prompt(q)} for qs in questions for q in qs]
    trainer = cls(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=tok,
        **({"environment_factory": tm.AddEnv} if environment else {"tools": [tm.add]}),
        **kwargs,
    )
    dist.barrier()
    start = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - start
    out = trainer.rec_out
    logs = [h for h in trainer.state.log_history if "reward" in h]
    return {
        "rank": rank,
        "steps": int(trainer.state.global_step),
        "prompts": [tok.decode(p) for p in out["prompt_ids"]],
        "prompt_ids": [list(map(int, p)) for p in out["prompt_ids"]],
        "completion_ids": [list(map(int, c)) for c in out["completion_ids"]],
        "tool_mask": [list(map(int, m)) for m in out["tool_mask"]],
        "texts": [tok.decode(c) for c in out["completion_ids"]],
        "calls": trainer.rec_calls,
        "stats": trainer.rec_stats,
        "reward": logs[0]["reward"] if logs else None,
        "logp_diff": logs[0].get("sampling/sampling_logp_difference/max") if logs else None,
        "generate_s": trainer.rec_generate_s,
        "train_s": train_s,
    }
