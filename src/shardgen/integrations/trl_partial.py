"""Partial rollouts for shardgen's TRL ``GRPOTrainer`` (``max_staleness=``, ``groups_ahead=``).

    trainer = GRPOTrainer(model=..., args=GRPOConfig(num_generations=4, ...), ...,
                          max_staleness=1, groups_ahead=2)

``max_staleness`` has the meaning of TRL 1.16's ``AsyncGRPOConfig.max_staleness``: a sample more
than that many optimizer steps behind the weights is discarded (``stale="drop"``). With it, each
training step's generation is a partial rollout (``engine.rollout(groups=K)``,
``generation/partial.py``): it returns once K whole groups are done, held groups of earlier steps
first, and the groups still decoding are held by the engine (parked while TRL steps, resumed under
the new weights). K is the rank's share of TRL's generation batch (``per_device_train_batch_size
* steps_per_generation / num_generations`` prompts): TRL's batch keeps its shape, and each rank
trains on whole groups (TRL's advantages are per group).

TRL's dataloader gives each step K new prompts, and a step trains on K groups: for groups to be
in flight beyond the step's, some step must train on fewer than it was given. ``groups_ahead=H``
(default 1) does it at the first step, which trains on K - H groups; every later step submits its
K prompts to the H held and serves K (as slime's APRIL over-provisions). A held group dropped as
stale is not replaced: the surplus shrinks by one.

What TRL pairs with the completions is replaced by the served groups' own rows of the dataset
(``inputs``: prompt, answer columns for the reward functions). The behaviour logprobs (each
token's under the weights that sampled it) are the completions' sampling logprobs: TRL's
``sampling_per_token_logps``, against which its importance-sampling correction
(``vllm_importance_sampling_*``) weighs ``old_per_token_logps`` (recomputed under the current
weights), the decoupled objective's behaviour and proximal policies.

Refused by name: a per-rank generation batch that ``num_generations`` does not divide, ``H >= K``,
and ``tools=``, ``environment_factory=``, ``rollout_func=``, each with its reason: TRL 1.16 runs
its tool loop inside the step's generation on the step's own rows (a held conversation would be
cut mid-loop, and the engine's ``rollout(env=)`` could take it only by re-implementing that loop
outside TRL), resets its environments for the next step's rows, and a ``rollout_func`` generates
the step itself.
"""

from __future__ import annotations

import inspect
from typing import Any

from shardgen.generation.partial import Quota
from shardgen.generation.rollout import sample_seed


class PartialRollouts:
    """The ``max_staleness`` / ``groups_ahead`` options of ``GRPOTrainer`` (module docstring)."""

    def __init__(
        self, *args: Any, max_staleness: int | None = None, groups_ahead: int = 1, **kwargs: Any
    ) -> None:
        if max_staleness is not None:
            Quota.of(0, max_staleness, "drop", None)  # ValueError with the value
            if isinstance(groups_ahead, bool) or not isinstance(groups_ahead, int) or groups_ahead < 0:
                raise ValueError(f"groups_ahead must be an integer >= 0, got {groups_ahead!r}")
            given = inspect.signature(super().__init__).bind_partial(*args, **kwargs).arguments
            self._shardgen_refuse_generators(given)
        super().__init__(*args, **kwargs)
        self.shardgen_max_staleness, self.shardgen_groups_ahead = max_staleness, groups_ahead
        self._shardgen_served: tuple[list[list[int]], list[list[int]], list[list[float]]] | None = None
        self._shardgen_rows: dict[int, tuple[list[int], list[Any]]] = {}  # id(prompt ids) -> (them, rows)
        self._shardgen_partial_steps = 0
        if max_staleness is not None:
            self._shardgen_check_partial()

    def _shardgen_check_partial(self) -> None:
        """``ValueError`` naming the settings partial rollouts cannot honour."""
        args, n = self.args, self.num_generations
        per_rank = args.per_device_train_batch_size * args.steps_per_generation
        k, h = per_rank // n, self.shardgen_groups_ahead
        if per_rank % n:
            raise ValueError(
                f"max_staleness= serves whole groups: num_generations={n} must divide the per-rank "
                f"generation batch per_device_train_batch_size * steps_per_generation = "
                f"{args.per_device_train_batch_size} * {args.steps_per_generation} = {per_rank}"
            )
        if h >= k or ((k - h) * n) % args.steps_per_generation:
            raise ValueError(
                f"groups_ahead={h}: the first step trains on {k} - {h} groups of {n} per rank, which must be "
                f">= 1 and split into steps_per_generation={args.steps_per_generation} equal parts"
            )

    @staticmethod
    def _shardgen_refuse_generators(given: dict[str, Any]) -> None:
        """``ValueError`` for the generators of TRL's own that partial rollouts cannot hold, each
        with its reason. Before TRL's constructor, whose own checks (a chat template that renders
        tool calls) would otherwise speak first and not of the staleness."""
        why = []
        if given.get("tools"):
            why.append(
                "tools=: TRL's tool loop (_tool_call_loop) runs every tool turn inside the step's own "
                "generation, on that step's rows (their messages, tool_mask and tool dicts live until the "
                "step scores them), so a conversation held past the step would be cut mid-loop; serving it "
                "with the engine's rollout(env=) would mean re-implementing that loop (tool-call parsing, "
                "sync and async tools, tool_mask, max_tool_calling_iterations) outside TRL"
            )
        if given.get("environment_factory") is not None:
            why.append(
                "environment_factory=: TRL hands each step's rows instances from a pool and reset()s them "
                "for the next step's rows, and gives them to the reward functions in that step's order, so "
                "a held conversation's environment would be reset under it"
            )
        if given.get("rollout_func") is not None:
            why.append("rollout_func=: it generates the step itself, leaving the engine no rows to hold")
        if why:
            raise ValueError("max_staleness= (partial rollouts) does not take " + "; ".join(why))

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        """TRL's, on the groups a partial rollout served in place of ``inputs`` (training only)."""
        if self.shardgen_max_staleness is None or not self.model.training:
            return super()._generate_and_score_completions(inputs)  # type: ignore[misc]
        served = self._shardgen_partial(inputs)
        return super()._generate_and_score_completions(served)  # type: ignore[misc]

    def _shardgen_partial(self, inputs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Submit ``inputs``' groups, wait for a quota of whole groups (held ones first); their rows
        of the dataset, in order, and their completions kept for ``_generate_single_turn``. Not
        collective, except the engine's creation on the first call (every rank's first step)."""
        n = self.num_generations
        if len(inputs) % n:
            raise ValueError(f"got {len(inputs)} rows for num_generations={n}: a rank needs whole groups")
        rows = [inputs[i : i + n] for i in range(0, len(inputs), n)]
        assert all(r["prompt"] == g[0]["prompt"] for g in rows for r in g), "TRL's sampler repeats each"
        prompt_ids, _, _ = self._tokenize_prompts([g[0]["prompt"] for g in rows])
        keys = [[int(t) for t in p] for p in prompt_ids]  # each its own list: the group's identity
        for key, group in zip(keys, rows, strict=True):
            self._shardgen_rows[id(key)] = (key, group)
        quota = len(rows) - (self.shardgen_groups_ahead if self._shardgen_partial_steps == 0 else 0)
        self._shardgen_partial_steps += 1
        self._shardgen_calls += 1
        base = sample_seed(int(self.args.seed), self._shardgen_calls, f"{self.state.global_step}:"
                           f"{self.accelerator.process_index}")  # fmt: skip
        was_training = self.model.training
        self._shardgen_pause.close()  # out of the pause (local): the engine generates
        self.model.eval()
        try:
            engine = self._shardgen_open()
            batch = engine.rollout(
                keys, n=n, groups=quota, max_staleness=self.shardgen_max_staleness, stale="drop",
                seed=[sample_seed(base, i, k) for i, k in enumerate(keys)], **self._shardgen_sampling(),
            )  # fmt: skip
        finally:
            self.model.train(was_training)
        served, ids, logps = [], [], []
        mask = batch.response_mask.bool()
        for j, key in enumerate(batch.prompts):
            served += self._shardgen_rows.pop(id(key))[1]
            for r in range(j * n, (j + 1) * n):
                ids.append(batch.response_ids[r][mask[r]].tolist())
                logps.append(batch.logprobs[r][mask[r]].tolist())
        held = {id(g.call.given[g.index]) for g in engine._held.groups()}
        for k in [k for k in self._shardgen_rows if k not in held]:  # dropped as stale
            del self._shardgen_rows[k]
        self._shardgen_served = ([list(p) for g in batch.prompts for p in [g] * n], ids, logps)
        return served

    def _shardgen_take_served(self, prompt_ids: list[list[int]]) -> tuple[list, list] | None:
        """The served completions for ``prompt_ids`` (TRL's generation call of this step), once."""
        if self._shardgen_served is None:
            return None
        prompts, ids, logps = self._shardgen_served
        self._shardgen_served = None
        assert [list(map(int, p)) for p in prompt_ids] == prompts, "TRL tokenized the served prompts anew"
        return ids, logps
