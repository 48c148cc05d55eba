"""Fixtures shared by the one-process tests."""

from __future__ import annotations

import copy

import pytest
import torch
from models import tiny_model

import shardgen


@pytest.fixture()
def engine():
    """A local engine on a tiny Llama (seed 11), its model, and a copy of the model's weights as
    they were (the partial-rollout tests train the model between calls)."""
    torch.set_num_threads(1)
    model = tiny_model("llama", seed=11)
    ref = copy.deepcopy(model)
    with shardgen.Engine(model, backend="local", max_batch_size=8) as eng:
        yield eng, model, ref
