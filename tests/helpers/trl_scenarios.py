"""Scenarios for tests/multirank/test_trl.py: TRL's GRPOTrainer (stock, or shardgen's subclass) on the toy
task, inside the gloo ranks of a World. Test-only patches live here, nowhere else."""

from __future__ import annotations

import os
import random
import tempfile

import torch.distributed as dist


def reward(prompts, completions, **_):
    from shardgen import toy

    return [float(toy.check_answer(p, c)) for p, c in zip(prompts, completions, strict=True)]


def uneven_calls(cls):
    """``cls`` whose rank 1 makes 2 extra generation calls per step, as TRL's tool loop does when
    only that rank's completions call a tool (the tool loop itself needs a chat model)."""

    class Uneven(cls):
        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, **kw):
            out = super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, **kw)
            self.completions = [*getattr(self, "completions", []), [list(map(int, c)) for c in out[0]]]
            if dist.get_rank() == 1:
                follow_up = [list(prompt_ids[0]) + list(out[0][0])]
                for _ in range(2):
                    super()._generate_single_turn(follow_up, None, {}, 1)
            return out

    return Uneven


def clear_trainer_state() -> None:
    """Leave no DeepSpeed or accelerate state behind for the World's next scenario (transformers
    keeps the ZeRO-3 config process-wide, accelerate its state and an environment variable)."""
    import gc

    from accelerate.state import AcceleratorState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    AcceleratorState._reset_state()
    os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)  # set by accelerate for a DeepSpeed plugin
    gc.collect()


def trainer_model(backend: str, path: str) -> tuple[object, dict | None]:
    """The model a trainer is given and its DeepSpeed config: for ``deepspeed`` a plain model and
    a ZeRO-3 config (the trainer's accelerator shards it); for ``fsdp2`` the model sharded by
    transformers over the default group."""
    from transformers import AutoModelForCausalLM

    if backend == "deepspeed":
        ds_config = {
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "zero_optimization": {"stage": 3},
        }
        return AutoModelForCausalLM.from_pretrained(path), ds_config
    from transformers.distributed import DistributedConfig

    world = dist.get_world_size()
    return AutoModelForCausalLM.from_pretrained(
        path, distributed_config=DistributedConfig(fsdp_size=world)
    ), None


def grpo_two_steps(
    backend: str, stock: bool = False, numerics: str = "fast", speculate: int = 0, partial: bool = False
) -> dict:
    """``_grpo_two_steps``, then ``clear_trainer_state``."""
    try:
        return _grpo_two_steps(backend, stock, numerics, speculate, partial)
    finally:
        clear_trainer_state()


def recording(cls):
    """``cls`` recording, per step, the prompts it was given and those its partial rollout served
    (each row's), and the groups held after it."""
    from shardgen.generation.partial import held_groups

    class Recording(cls):
        given, served, held = [], [], []

        def _shardgen_partial(self, inputs):
            out = super()._shardgen_partial(inputs)
            self.given.append([x["prompt"] for x in inputs])
            self.served.append([x["prompt"] for x in out])
            self.held.append(held_groups(self.shardgen_engine))
            return out

    return Recording


def _grpo_two_steps(
    backend: str, stock: bool = False, numerics: str = "fast", speculate: int = 0, partial: bool = False
) -> dict:
    """Two GRPO steps on 2 ranks with uneven generation calls (with ``partial``: partial rollouts
    instead, ``max_staleness=1``, ``groups_ahead=1``); returns rank 0's logged rewards, the
    shardgen metrics logged, and this rank's completions (token ids) per generation call. With
    ``speculate``, a verify forward's columns are priced as before any is measured (nearly free),
    so that drafts run whatever this machine's timings (the rows never depend on them)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig
    from trl import GRPOTrainer as StockGRPOTrainer

    from shardgen import toy
    from shardgen.integrations.trl import GRPOTrainer

    path = toy.toy_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    rng = random.Random(0)
    prompts = [toy.format_prompt(*toy.sample_task(rng, rng.randint(2, 5))) for _ in range(16)]
    model, ds_config = trainer_model(backend, path)
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="shardgen-trl-"),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=8,
        temperature=1.5,
        max_steps=2,
        beta=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        bf16=False,  # TRL's defaults: bf16 and gradient checkpointing, not for these CPU ranks
        gradient_checkpointing=False,
        deepspeed=ds_config,
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    cls = recording(GRPOTrainer) if partial else uneven_calls(StockGRPOTrainer if stock else GRPOTrainer)
    mine = {} if stock else {"shardgen_config": {"numerics": numerics, "speculate": speculate}}
    if partial:
        mine.update(max_staleness=1, groups_ahead=1)
    trainer = cls(
        **mine,
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]),
        processing_class=tok,
    )
    from shardgen.generation import drafts

    cost = drafts.Pacer.cost
    if speculate:
        drafts.Pacer.cost = lambda self, width, rows=None: 1.0 + drafts.UNMEASURED_COLUMN_COST * (width - 1)  # type: ignore[method-assign]
    try:
        trainer.train()
    finally:
        drafts.Pacer.cost = cost  # type: ignore[method-assign]
    logs = trainer.state.log_history
    return {
        "steps": int(trainer.state.global_step),
        "rewards": [h["reward"] for h in logs if "reward" in h],
        "logp_diff": [h["sampling/sampling_logp_difference/max"] for h in logs if "reward" in h],
        "calls": getattr(trainer, "_shardgen_calls", None),
        **({"given": trainer.given, "served": trainer.served, "held": trainer.held} if partial else {}),
        "shardgen": [
            {k: v for k, v in h.items() if k.startswith("shardgen/")} for h in logs if "reward" in h
        ],
        "completions": getattr(trainer, "completions", []),
    }


UNSUPPORTED_KNOBS = (  # each with the text its ValueError must name
    {"min_p": 0.1},
    {"repetition_penalty": 1.2},
    {"use_vllm": True},
    {"use_transformers_continuous_batching": True},
    {"generation_kwargs": {"no_repeat_ngram_size": 2}},
    {"cache_implementation": "static"},
    {"min_p": 0.2, "cache_implementation": "static"},  # every setting at fault, in one message
)


def add(a: int, b: int) -> int:
    """Add two integers (a tool for TRL's tool loop).

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def partial_refusals() -> list[str]:
    """The ValueError messages for settings partial rollouts refuse (no ranks needed)."""
    from datasets import Dataset
    from trl import GRPOConfig

    from shardgen.integrations.trl import GRPOTrainer
    from shardgen.toy import toy_model_path

    out, data = [], Dataset.from_list([{"prompt": "1 2"}])
    cases = (
        ({"groups_ahead": 2}, {}),  # 2 groups a rank: the first step would train on none
        ({"groups_ahead": 1}, {"rollout_func": reward}),
        ({}, {"max_staleness": -1}),
        ({"groups_ahead": 1}, {"tools": [add]}),
    )
    for kw, extra in cases:
        cfg = GRPOConfig(output_dir=tempfile.mkdtemp(), bf16=False, report_to=[], use_cpu=True,
                         per_device_train_batch_size=4, num_generations=2)  # fmt: skip
        try:
            GRPOTrainer(model=toy_model_path(), reward_funcs=reward, args=cfg, train_dataset=data,
                        **{"max_staleness": 1, **kw, **extra})  # fmt: skip
        except ValueError as e:
            out.append(str(e))
    return out


def unsupported_knobs() -> list[str]:
    """The ValueError messages for TRL settings shardgen does not implement (no ranks needed)."""
    from trl import GRPOConfig

    from shardgen.integrations.trl import GRPOTrainer

    out = []
    for bad in UNSUPPORTED_KNOBS:
        cfg = GRPOConfig(output_dir=tempfile.mkdtemp(), bf16=False, report_to=[], **bad)
        try:
            GRPOTrainer(model="unused", reward_funcs=reward, args=cfg)
        except ValueError as e:
            out.append(str(e))
    return out
