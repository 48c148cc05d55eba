"""A plain replica of a sharded HF model, for gather policy ``once`` at the unsharded floor.

Once the weights are gathered, a forward should cost what an unsharded model's forward
costs: no per-module sharding hooks, no DTensor dispatch. So instead of keeping the sharded
model gathered, ``gather_all`` fills a replica: the same class, built once on the meta device
from the model's config, whose parameters receive full copies of the gathered weights chunk
by chunk (peak: the replica plus one chunk), and whose buffers are the model's own (shared,
not copied). Tied weights stay tied: one tensor per distinct source parameter, set at every
name the source uses for it. ``free`` puts meta tensors back, releasing the storage; the
skeleton is kept for the next gather.

Nothing here is collective; the backends gather and call ``load`` for each chunk.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def _place(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    prefix, _, leaf = name.rpartition(".")
    return root.get_submodule(prefix), leaf


def _set_buffer(root: nn.Module, name: str, value: torch.Tensor | None) -> None:
    prefix, _, leaf = name.rpartition(".")
    root.get_submodule(prefix)._buffers[leaf] = value


class Replica:
    """An unsharded twin of ``model`` (an HF ``PreTrainedModel``, possibly sharded)."""

    def __init__(self, model: nn.Module, cls: type, device: torch.device) -> None:
        self.device = device
        self._source = model
        # Names per distinct source parameter (tied weights share one entry).
        groups: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            groups.setdefault(id(p), []).append(name)
        self.groups = list(groups.values())
        self._group_of = {n: i for i, names in enumerate(self.groups) for n in names}
        with torch.device("meta"):
            self.module = cls(model.config)
        self.module.train(model.training)
        self.module.requires_grad_(False)
        mine = {n for n, _ in self.module.named_parameters(remove_duplicate=False)}
        theirs = set(self._group_of)
        if mine != theirs:
            raise ValueError(
                f"a {cls.__name__} built from the config has other parameters than the model "
                f"(only theirs: {sorted(theirs - mine)[:4]}, only the replica's: {sorted(mine - theirs)[:4]})"
            )
        self._meta = {n: p for n, p in self.module.named_parameters(remove_duplicate=False)}
        # Where each name is set: resolved once (a gather sets every parameter, at every gather).
        self._places = {n: _place(self.module, n) for n in self._meta}
        self._loaded: set[int] = set()
        self.live = False
        self.forwards = 0  # forwards run on the replica (tests, stats)

    def has(self, name: str) -> bool:
        """Whether source parameter ``name`` (or one tied to it) is loaded already."""
        return self._group_of[name] in self._loaded

    def load(self, name: str, full: torch.Tensor) -> None:
        """Copy the full value of source parameter ``name`` (and of every name tied to it)."""
        if self._group_of[name] in self._loaded:
            return
        t = torch.empty(full.shape, dtype=full.dtype, device=self.device)
        t.copy_(full)
        self.put(name, t)

    def put(self, name: str, value: torch.Tensor) -> None:
        """Take ``value`` (this replica's own tensor, not copied) as source parameter ``name``
        and every name tied to it."""
        g = self._group_of[name]
        param = nn.Parameter(value, requires_grad=False)
        for n in self.groups[g]:
            module, leaf = self._places[n]
            module._parameters[leaf] = param
        self._loaded.add(g)

    def finish(self) -> None:
        """After every ``load``: share the source's buffers; the replica is ready."""
        missing = [self.groups[g][0] for g in range(len(self.groups)) if g not in self._loaded]
        assert not missing, f"replica parameters never loaded: {missing[:4]}"
        for name, buf in self._source.named_buffers(remove_duplicate=False):
            _set_buffer(self.module, name, buf)
        self.live = True

    def nbytes(self) -> int:
        """Bytes the replica's parameters hold now (0 when freed)."""
        seen: set[int] = set()
        total = 0
        for p in self.module.parameters():
            if p.device.type != "meta" and id(p) not in seen:
                seen.add(id(p))
                total += p.numel() * p.element_size()
        return total

    def free(self) -> None:
        """Release the full copies (meta tensors back in place). Not collective."""
        for n, p in self._meta.items():
            module, leaf = self._places[n]
            module._parameters[leaf] = p
        self._loaded.clear()
        self.live = False

    def __call__(self, **inputs: Any) -> Any:
        assert self.live, "forward on a freed replica"
        self.forwards += 1
        with torch.no_grad():
            return self.module(**inputs)
