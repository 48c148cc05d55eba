"""TRL's ``GRPOTrainer`` with its generation on a shardgen ``Engine``: a drop-in subclass.

    from shardgen.integrations.trl import GRPOTrainer     # instead of: from trl import GRPOTrainer
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(...), train_dataset=ds,
                          shardgen_config=shardgen.EngineConfig(max_batch_size=32))   # optional
    trainer.train()

Install: ``pip install 'shardgen[trl]'`` (TRL 1.16, Python >= 3.11). Same constructor as TRL's,
plus ``shardgen_config``, and ``max_staleness``/``groups_ahead``
(partial rollouts: ``trl_partial.py``). Works where TRL's own generation hangs or aborts: ranks that finish at
different steps, and multi-turn tool loops where ranks make different numbers of generation
calls (each rank's engine keeps serving its peers with shadow forwards).

How it fits TRL 1.16 (``trl/trainer/grpo_trainer.py``):

- ``_generate_single_turn`` (the one place TRL generates: HF ``generate()`` inside
  ``unwrap_model_for_generation``, or vLLM) submits the rows to the engine instead (NOT
  collective) and returns the completions with their sampling logprobs, as TRL's vLLM path does.
- ``tools=`` / ``environment_factory=``: TRL's ``_tool_call_loop`` calls it once more per tool
  turn, for the rows that called a tool, on ``prompt_ids + completion_ids + tool reply ids``
  (concatenated, never re-tokenized), and issues no collective until the loop ends: ranks may
  take any number of turns, and the rank's prefix cache serves each turn all but the reply.
- TRL applies its importance-sampling correction (``vllm_importance_sampling_*``: training-side
  logprobs against sampling logprobs) only on its vLLM path, so the trainer takes that path:
  ``use_vllm`` is set on the instance after construction and ``vllm_generation`` is a stand-in
  whose weight sync is a no-op (the engine generates with the training weights themselves).
- The engine is created at the first generation (collective: every rank's first generation
  call), on the model TRL trains (``model_wrapped``: a ``fully_shard`` model, or accelerate's
  DeepSpeed ZeRO-3 engine). Training never overlaps generation: when ``_generate`` returns, the
  rank enters ``engine.paused()`` (collective) and stays there, through the loss, backward and
  optimizer step, until its next ``_generate``. ``train()`` closes the engine at the end.

Logged per step beside TRL's metrics: ``shardgen/generate_seconds`` (the generation phase's wall
time on its slowest rank, tool turns included) and, all ranks summed,
``shardgen/prompt_tokens_computed`` and ``shardgen/prompt_tokens_cached``; with speculation on
(``shardgen_config={"speculate": K}``, or unset with ``"numerics": "invariant"``) also
``shardgen/drafted``, ``shardgen/accepted`` (draft tokens fed and kept) and
``shardgen/tokens_per_forward`` (a live row's tokens per decode forward).

Sampling: ``temperature``, ``top_k``, ``top_p``, ``max_completion_length`` and the EOS ids TRL
resolved; logprobs under ``softmax(logits / temperature)``, what TRL recomputes. TRL settings
shardgen does not implement raise ``ValueError`` at construction (``UNSUPPORTED``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any

from shardgen.config import EngineConfig
from shardgen.generation.rollout import sample_seed
from shardgen.integrations.trl_partial import PartialRollouts
from shardgen.log import get_logger
from shardgen.numerics import invariant_numerics

log = get_logger()

TRL_VERSION = "1.16"


def _import_trl() -> Any:
    try:
        import trl
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("shardgen.integrations.trl needs TRL 1.16: pip install 'shardgen[trl]'") from e
    if not str(trl.__version__).startswith(TRL_VERSION + "."):
        log.warning("shardgen.integrations.trl is built for TRL %s.*, found %s", TRL_VERSION, trl.__version__)
    return trl


_trl = _import_trl()


def unsupported(args: Any) -> list[str]:
    """The TRL settings of ``args`` (a ``GRPOConfig``) that shardgen's generation cannot honour."""
    problems = []
    if getattr(args, "use_vllm", False):
        problems.append("use_vllm=True (generation runs on shardgen; set use_vllm=False)")
    if getattr(args, "use_transformers_continuous_batching", False):
        problems.append("use_transformers_continuous_batching=True")
    if getattr(args, "min_p", None) is not None:
        problems.append(f"min_p={args.min_p}")
    if getattr(args, "repetition_penalty", 1.0) != 1.0:
        problems.append(f"repetition_penalty={args.repetition_penalty}")
    if getattr(args, "generation_kwargs", None):
        problems.append(f"generation_kwargs={args.generation_kwargs}")
    if getattr(args, "cache_implementation", None) is not None:
        problems.append(f"cache_implementation={args.cache_implementation!r}")
    return problems


def _check(args: Any) -> None:
    problems = unsupported(args)
    if problems:
        raise ValueError("shardgen's GRPOTrainer does not support these TRL settings: " + "; ".join(problems))


class _SharedWeights:
    """Stands in for TRL's vLLM client: the engine generates with the training weights, no copy."""

    def sync_weights(self) -> None:
        pass


class GRPOTrainer(PartialRollouts, _trl.GRPOTrainer):
    """TRL's ``GRPOTrainer``, generating on a shardgen ``Engine`` (see the module docstring)."""

    def __init__(self, *args: Any, shardgen_config: EngineConfig | dict | None = None, **kwargs: Any) -> None:
        given = kwargs.get("args", args[2] if len(args) > 2 else None)
        if given is not None:
            _check(given)  # before TRL loads anything
        super().__init__(*args, **kwargs)
        _check(self.args)
        if self._is_vlm:
            raise ValueError(
                "shardgen's GRPOTrainer generates for text-only models; got a vision-language model"
            )
        if isinstance(shardgen_config, dict):
            shardgen_config = EngineConfig(**shardgen_config)
        self.shardgen_config = shardgen_config or EngineConfig()
        self.shardgen_engine: Any = None
        self._shardgen_pause = contextlib.ExitStack()
        self._shardgen_calls = 0
        self._shardgen_phase = False  # inside _generate: the model stays in eval mode until its end
        # Inside _generate too: the phase's tool turns are one multi-turn call to the engine (under
        # ``once``, the whole weights stay gathered between them: ``Shared.turns``), entered at
        # the phase's first generation call (the engine may not exist before it).
        self._shardgen_turns = contextlib.ExitStack()
        self._shardgen_in_turns = False
        # TRL runs its importance-sampling correction only on its vLLM path (module docstring).
        self.use_vllm = True
        self.vllm_mode = "shardgen"
        self.vllm_generation = _SharedWeights()

    def _get_per_token_logps_and_entropies(self, *args: Any, **kwargs: Any) -> Any:
        """TRL's forward over a batch's tokens (old, reference and current logprobs), under the
        engine's numerics: with ``numerics="invariant"`` its logits are the bits the engine
        sampled from (``shardgen.numerics``), whatever the batch they come in."""
        with invariant_numerics(self.shardgen_config.numerics == "invariant"):
            return super()._get_per_token_logps_and_entropies(*args, **kwargs)

    # ------------------------------------------------------------------ engine lifecycle
    def _shardgen_open(self) -> Any:
        """The engine, created on first use. Collective: every rank's first generation call."""
        if self.shardgen_engine is None:
            import shardgen

            cfg = self.shardgen_config
            backend = "deepspeed" if self.is_deepspeed_enabled else cfg.backend
            cfg = dataclasses.replace(cfg, backend=backend)
            self.shardgen_engine = shardgen.Engine(self.model_wrapped, self._tokenizer, config=cfg)
        return self.shardgen_engine

    def shardgen_close(self) -> None:
        """Close the engine (collective, like ``Engine.close``); ``train()`` calls it at the end."""
        self._shardgen_pause.close()
        if self.shardgen_engine is not None:
            engine, self.shardgen_engine = self.shardgen_engine, None
            engine.close()

    def train(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().train(*args, **kwargs)
        finally:
            self.shardgen_close()

    # ------------------------------------------------------------------ TRL hooks
    def _generate(self, prompts: list) -> Any:
        """One generation phase, TRL's tool turns included, between two pauses of the engine.

        The model stays in eval mode from the phase's first generation call to its end: a
        ``train()``/``eval()`` switch drops the engine's prefix cache, and each tool turn's prompt
        extends the turn before it (TRL concatenates the ids), which the cache holds. Ends with one
        ``gather`` (collective on the default group, every rank once per phase, before the pause),
        of the phase's counters for TRL's logs (``_shardgen_log``).
        """
        self._shardgen_pause.close()  # resume: the engine generates again
        mode = "train" if self.model.training else "eval"  # as TRL's _generate reads it
        training, self._shardgen_phase = self.model.training, True
        before, t0 = self._shardgen_counts(), time.perf_counter()
        try:
            out = super()._generate(prompts)
            self._shardgen_log(mode, before, time.perf_counter() - t0)
            return out
        finally:
            self._shardgen_turns.close()
            self._shardgen_phase = self._shardgen_in_turns = False
            self.model.train(training)
            if self.shardgen_engine is not None:
                # Collective: every rank enters once its own generation is done; peers still
                # generating are served meanwhile. Held through the loss, backward and step.
                self._shardgen_pause.enter_context(self.shardgen_engine.paused())

    #: ``engine.stats()`` counters logged per phase, all ranks summed (the last four with
    #: ``speculate`` only): prompt tokens computed and cached, draft tokens fed and kept, and the
    #: live rows' decode forwards and tokens (their ratio: tokens per forward).
    COUNTERS = (
        "prefill_tokens", "cached_prompt_tokens", "drafted", "accepted", "decode_row_steps", "decode_tokens",
    )  # fmt: skip

    def _shardgen_counts(self) -> list[int]:
        """This rank's ``COUNTERS`` so far."""
        if self.shardgen_engine is None:
            return [0] * len(self.COUNTERS)
        stats = self.shardgen_engine.stats()
        return [int(stats[k]) for k in self.COUNTERS]

    def _shardgen_log(self, mode: str, before: list[int], seconds: float) -> None:
        """Log the phase's ``seconds`` on its slowest rank and its prompt tokens (and with
        ``speculate``: ``drafted``, ``accepted``, ``tokens_per_forward``), all ranks summed.
        Collective (``gather`` on the default group): every rank, once per phase, after TRL's own
        gathers and before the pause."""
        import torch

        now = self._shardgen_counts()
        delta = [a - b for a, b in zip(now, before, strict=True)]
        # float64: the counts stay exact (below 2**53) beside the seconds
        local = torch.tensor([*delta, seconds], dtype=torch.float64, device=self.accelerator.device)
        rows = self.accelerator.gather(local).view(-1, len(self.COUNTERS) + 1)
        total = [int(x) for x in rows[:, :-1].sum(0).tolist()]
        c = dict(zip(self.COUNTERS, total, strict=True))
        metrics = self._metrics[mode]
        metrics["shardgen/generate_seconds"].append(float(rows[:, -1].max()))
        metrics["shardgen/prompt_tokens_computed"].append(float(c["prefill_tokens"]))
        metrics["shardgen/prompt_tokens_cached"].append(float(c["cached_prompt_tokens"]))
        engine = self.shardgen_engine  # its config's: unset, speculation is on under invariant numerics
        if engine is not None and engine.config.speculate:
            metrics["shardgen/drafted"].append(float(c["drafted"]))
            metrics["shardgen/accepted"].append(float(c["accepted"]))
            rows = c["decode_row_steps"]
            metrics["shardgen/tokens_per_forward"].append(c["decode_tokens"] / rows if rows else 0.0)

    def _generate_single_turn(
        self,
        prompt_ids: list[list[int]],
        images: Any,
        multimodal_fields: dict,
        num_generations: int,
        has_tool_images: bool = False,
    ) -> tuple[list[list[int]], list[list[float]]]:
        """One generation call (NOT collective: a rank may make any number, zero rows included).

        TRL calls it once per phase, then once per tool turn for the rows that called a tool,
        with ``prompt + completion + tool reply`` ids: the rank's prefix cache holds the KV of the
        turn before, so the turn prefills only the reply and the previous answer's last token.
        Rows are independent samples (TRL repeats each prompt ``num_generations`` times itself).
        Returns the completions (the first EOS kept, nothing after it) and their logprobs.
        """
        if (images is not None and any(images)) or multimodal_fields or has_tool_images:
            raise ValueError("shardgen's GRPOTrainer generates for text-only prompts")
        served = self._shardgen_take_served(prompt_ids)  # a partial rollout's, already done
        if served is not None:
            return served
        model = self.model
        was_training = model.training
        model.eval()  # no dropout while sampling
        try:
            engine = self._shardgen_open()
            if self._shardgen_phase and not self._shardgen_in_turns:
                self._shardgen_turns.enter_context(engine._shared.turns())  # the phase's tool turns
                self._shardgen_in_turns = True
            done = self._shardgen_generate(engine, [list(map(int, p)) for p in prompt_ids])
        finally:
            if not self._shardgen_phase:  # inside _generate, the phase restores the mode at its end
                model.train(was_training)
        return [c.token_ids for c in done], [list(c.logprobs or []) for c in done]

    def _shardgen_generate(self, engine: Any, rows: list[list[int]]) -> list[Any]:
        if not rows:
            return []
        self._shardgen_calls += 1
        step = int(self.state.global_step)
        base = sample_seed(
            int(self.args.seed), self._shardgen_calls, f"{step}:{self.accelerator.process_index}"
        )
        seeds = [sample_seed(base, i, row) for i, row in enumerate(rows)]
        return engine.generate(rows, seed=seeds, logprobs=True, **self._shardgen_sampling())

    def _shardgen_sampling(self) -> dict[str, Any]:
        """The engine's sampling settings from TRL's: its generations and the partial rollouts'
        (``trl_partial.py``) draw alike."""
        return dict(
            max_new_tokens=int(self.max_completion_length),
            do_sample=True,
            temperature=float(self.temperature),
            top_k=int(self.top_k or 0),
            top_p=float(self.top_p if self.top_p is not None else 1.0),
            eos_token_id=list(self.eos_token_ids) or None,
            pad_token_id=self._tokenizer.pad_token_id,
        )
