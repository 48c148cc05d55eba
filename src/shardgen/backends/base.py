"""The backend interface: how the engine runs forwards on a (possibly sharded) model.

A backend owns the model after the engine hands it over. The driver thread is the
only caller of every method below, and it calls them in the same order on every
rank (the tick protocol guarantees it), so any collective a backend issues is
matched on every rank of its parameter group.

Collective contract, per method (all ranks of the parameter group, same order):
- ``forward(plan, inputs)``: one forward of the model's ``inputs`` (HF's keyword arguments) as
  the tick's agreed ``plan`` (``generation/plan.py: ForwardPlan``) says, and nothing else: its
  ``access`` ``PER_LAYER``: the sharded gathers of one forward pass; ``STATIONARY``: the
  exchanges of ``backends/stationary`` (no big weight moves), sized from ``shapes``, every
  rank's agreed ``(tokens, head_rows)`` this tick; ``REPLICA``: none (weights whole here).
  The backend keeps no state that could choose otherwise.
- ``shadow_forward(plan)``: exactly the collectives ``forward`` issues with the same plan,
  without real work.
- the plan's ``run_towers``: the agreed set of the model's towers (``backends/towers.py``, a bit
  each) this forward runs on every rank: a tower the forward's own inputs do not run goes on
  its shadow input.
- ``gather_all()`` / ``release_all()``: one full gather / release of every unit.
- ``enter_pause()`` / ``exit_pause()``: no collective (attribute changes, local releases).
- ``close()``: no collective; frees what the backend made.
"""

from __future__ import annotations

from typing import Any

import torch

from shardgen.backends.seq2seq_inputs import decoder_positions, shadow_inputs
from shardgen.backends.towers import shadow_towers, tower_mask, towers_of
from shardgen.generation.plan import Access, ForwardPlan, Shapes


class Backend:
    """One way to hold a model and run forwards on it.

    ``module`` is the callable HF model (after sharding); ``hf_model`` is the
    ``PreTrainedModel`` whose ``config``, ``generation_config`` and
    ``prepare_inputs_for_generation`` the decoder uses (often the same object).
    """

    name: str = "base"
    #: True when a forward issues collectives on the parameter group, so every
    #: rank must forward in lockstep (per-layer gathers). False once weights are
    #: local (the ``local`` backend, or after ``gather_all``). A fact for the driver, which
    #: puts it into each plan (``Access.REPLICA``); no forward reads it.
    lockstep: bool = True
    #: A plain unsharded twin holding the gathered weights (gather policy ``once``), or None;
    #: while it is live, the driver's plans say ``REPLICA`` and forwards run on it (no sharding
    #: hooks in the path).
    replica: Any = None

    #: The weight-stationary mode (``backends/stationary``) once :meth:`enable_stationary` built it.
    stationary: Any = None

    def __init__(self, hf_model: torch.nn.Module, module: torch.nn.Module, device: torch.device) -> None:
        self.hf_model = hf_model
        self.module = module
        self.device = device
        self.towers = towers_of(hf_model)  # the model kind's towers (backends/towers.py)

    def tower_mask(self, inputs: dict[str, Any] | None) -> int:
        """The towers (a bit each) that one request's ``inputs`` run. Local."""
        return tower_mask(self.towers, inputs)

    def enable_stationary(self) -> str | None:
        """Build the stationary mode (``self.stationary``); None when built, else why not (forwards
        then gather per layer). Local: classifies and probes the model, no collective."""
        return f"backend {self.name!r} has no weight-stationary mode"

    def drop_stationary(self) -> None:
        """Free the stationary mode :meth:`enable_stationary` built (a peer could not build its
        own: the engine gathers per layer). Local."""
        self.stationary = None

    def stationary_forward(self, inputs: dict[str, Any], shapes: Shapes | None, towers: int = 0) -> Any:
        """One forward in the stationary mode with the agreed ``shapes`` and ``towers``. Collective
        on the parameter group (``backends/stationary/runner.py``): every rank, same tick."""
        assert self.stationary is not None and shapes is not None, "a stationary forward needs shapes"
        return self.stationary.forward(list(shapes), lambda: self.module(**inputs), towers)

    def per_layer_cost(self) -> Any:
        """The collectives of one per-layer forward (``stationary.cost.Cost``), for ``auto``."""
        from shardgen.backends.stationary.cost import gathered_cost

        return gathered_cost(len(self.units()), self.full_param_bytes(), 1)

    def forward(self, plan: ForwardPlan, inputs: dict[str, Any]) -> Any:
        """Run one forward of the model's ``inputs`` as the agreed ``plan`` says (the module
        docstring): its ``access``, ``shapes`` and ``run_towers``, nothing of the backend's own.
        Collective on the parameter group unless the access is ``REPLICA``: every rank, the same
        tick, with the same plan's access."""
        access = plan.access
        assert access is not None, f"a {plan.kind} forward the tick has not agreed"
        inputs = dict(inputs)  # the caller's stay as they were
        positions = inputs.pop("decoder_position_ids", None)  # an encoder-decoder's rows' own
        if access is Access.REPLICA:
            return self._replica_forward(inputs, positions)
        own = tower_mask(self.towers, inputs)
        with (
            shadow_towers(self.hf_model, self.towers, plan.run_towers, own, self.device),
            decoder_positions(self.hf_model, positions),
        ):
            if access is Access.STATIONARY:
                return self.stationary_forward(inputs, plan.shapes, plan.run_towers)
            return self._per_layer_forward(**inputs)

    def _replica_forward(self, inputs: dict[str, Any], positions: Any) -> Any:
        """A forward on the whole weights of the live replica (``once``). Local."""
        assert self.replica is not None, "a replica forward with no replica gathered"
        if positions is None:
            return self.replica(**inputs)  # asserts it is live
        with decoder_positions(self.replica.module, positions):
            return self.replica(**inputs)

    def _per_layer_forward(self, **inputs: Any) -> Any:
        """The backend's own per-layer forward (its units' gathers, or none)."""
        return self.module(**inputs)

    def gathered_bytes(self) -> int:
        """Bytes of full weights this backend holds beyond its shards (the live replica)."""
        return self.replica.nbytes() if self.replica is not None else 0

    def shadow_forward(self, plan: ForwardPlan) -> None:
        """Issue the same parameter collectives as ``forward(plan, ...)``, on a 1x1 dummy input
        (with ``STATIONARY`` access it contributes zero rows: the plan's ``shapes`` say so).

        Called by a rank with nothing to compute while a peer computes. A dummy
        forward walks every sharded unit in module order, so the gathers match a
        real forward of any batch size and length; the agreed towers run on their shadow inputs.
        """
        self.forward(plan, shadow_inputs(self.hf_model, self.device))

    def gather_all(self) -> None:
        """Materialize full weights on every rank (gather policy ``once``). Collective."""
        raise NotImplementedError(f"backend {self.name!r} cannot gather the whole model")

    #: ``backends/whole.py``'s chunks for ``gather_all`` (None: not planned yet; False: the
    #: backend's own gathers, for a layout the chunks do not cover).
    _whole: Any = None
    #: Bytes a chunk of ``gather_all`` gathers at most.
    WHOLE_CHUNK_BYTES = 64 << 20

    def _fill_whole(self, source: Any, budget: int) -> bool:
        """Fill ``self.replica`` from chunks of many parameters' shards (``backends/whole.py``),
        planned once from ``source()`` (a stationary ``Source``); False, nothing gathered, when a
        parameter is not covered. Collective on the param group when it returns True: the
        chunks' gathers, every rank in the same tick."""
        from shardgen.backends import whole
        from shardgen.backends.stationary import Unsupported

        if self._whole is None:
            self._whole = whole.layout(self.module, source().shard, Unsupported, budget) or False
        if not self._whole:
            return False
        whole.fill(self.replica, self._whole, self.param_group, self.device)
        return True

    def release_all(self) -> None:
        """Undo ``gather_all``: free the replica; forwards gather per unit again. Local (no
        collective): the shards were never changed."""
        if self.replica is not None:
            self.replica.free()
        if self.stationary is not None:
            self.stationary.invalidate()  # its kept parameters and cut rows
        self.lockstep = True

    def full_param_bytes(self) -> int:
        """Bytes of the unsharded weights (for the ``auto`` gather policy)."""
        return sum(p.numel() * p.element_size() for p in self.hf_model.parameters())

    def describe(self) -> dict[str, str]:
        """What this backend runs with (logs, tests). The cross-rank check at construction uses
        ``describe_model`` on the model before sharding, since sharding itself is collective."""
        return {"backend": self.name, **describe_model(self.hf_model)}

    def units(self) -> list[torch.nn.Module]:
        """The sharded units whose gathers a forward issues, in module order (for debug checks)."""
        return []

    def instrument(self) -> None:
        """Record which units each forward gathers (``debug_collectives``)."""
        self._gathered: list[int] = []
        self._instrument_hooks = [
            unit.register_forward_pre_hook(lambda _m, _a, i=i: self._gathered.append(i))
            for i, unit in enumerate(self.units())
        ]

    def uninstrument(self) -> None:
        """Remove :meth:`instrument`'s hooks (at close: a user's model outlives the engine). Local."""
        for h in getattr(self, "_instrument_hooks", ()):
            h.remove()
        self._instrument_hooks = []

    def collective_signature(self) -> tuple[int, ...]:
        """The units gathered since the last call, in order; resets the record."""
        seen = tuple(getattr(self, "_gathered", ()))
        self._gathered = []
        return seen

    def enter_pause(self) -> None:
        """Hand the model back as the user set it up, for a training step inside ``paused()``.

        Called by the driver once every rank agreed to pause (no forward in flight, weights
        released): restore what shardgen changed for generation (communicators, prefetch,
        persistence, reshard-after-forward), so training is neither slower nor different.
        Not collective.
        """

    def exit_pause(self) -> None:
        """Undo ``enter_pause``: back to the generation settings. Called by the driver after this
        rank's ``paused()`` block exits, before the next tick. Not collective."""

    def close(self) -> None:
        """Release backend resources. Not collective."""


def describe_model(model: Any) -> dict[str, str]:
    """Architecture and dtype of an (unsharded or sharded) HF model, for cross-rank checks."""
    cfg = model.config
    dtype = getattr(model, "dtype", None)
    if dtype is None:
        dtype = next(iter(model.parameters())).dtype
    return {
        "model_type": str(getattr(cfg, "model_type", "?")),
        "model_config": _config_digest(cfg),
        "dtype": str(dtype),
    }


def _config_digest(cfg: Any) -> str:
    import hashlib
    import json

    d = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(vars(cfg))
    for k in ("_name_or_path", "transformers_version", "_commit_hash", "torch_dtype", "dtype"):
        d.pop(k, None)
    blob = json.dumps(d, sort_keys=True, default=str).encode()
    return hashlib.sha1(blob).hexdigest()[:12]
