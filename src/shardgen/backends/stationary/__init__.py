"""Weight-stationary forwards (gather policy ``stationary``): no big weight moves, activations do.

ZeRO-3 leaves each rank a block of rows of every weight; per linear, the ranks exchange their
input rows, each multiplies them by its own rows, and each gets its own tokens' outputs back
(Pope et al., "Efficiently Scaling Transformer Inference", 2022: weight-stationary layouts).
Modules: ``shards.py`` (where each rank's elements lie, cut rows), ``exchange.py`` (the
collectives), ``layout.py`` (what each module does; the probe), ``runner.py`` (the forward),
``cost.py`` (collectives and bytes per forward, for ``auto``); FSDP2's layout is
``backends/fsdp2/stationary.py``, DeepSpeed's ``backends/deepspeed/stationary.py``.
"""

from __future__ import annotations

from shardgen.backends.stationary.cost import Cost, gathered_cost, link_for, stationary_cost
from shardgen.backends.stationary.layout import Source, Unsupported
from shardgen.backends.stationary.runner import Stationary

__all__ = ["Cost", "Source", "Stationary", "Unsupported", "gathered_cost", "link_for", "stationary_cost"]
