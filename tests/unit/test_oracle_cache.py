"""The HF oracle's cache (tests/helpers/models.py): an answer is kept under everything it depends
on, so a changed weight, input, keyword or numerics switch computes afresh."""

from __future__ import annotations

import pytest
import rounding
import torch
from models import ORACLE_DIR, batch, hf_generate, tiny_model
from transformers import LogitsProcessorList, MinLengthLogitsProcessor


def test_same_call_is_kept_and_anything_that_changes_the_answer_is_a_new_entry(tmp_path, monkeypatch):
    monkeypatch.setenv(ORACLE_DIR, str(tmp_path))
    model = tiny_model("llama", seed=3)
    ids, mask = batch([4, 2], seed=5)
    first = hf_generate(model, ids, mask, max_new_tokens=4)
    assert len(list(tmp_path.iterdir())) == 1
    assert torch.equal(hf_generate(model, ids, mask, max_new_tokens=4), first)
    assert len(list(tmp_path.iterdir())) == 1  # read back, not computed again

    hf_generate(model, ids, mask, max_new_tokens=5)  # a keyword
    ids2 = ids.clone()
    ids2[0, -1] += 1
    hf_generate(model, ids2, mask, max_new_tokens=4)  # an input
    model.generation_config.eos_token_id = None
    hf_generate(model, ids, mask, max_new_tokens=4)  # the generation config
    with torch.no_grad():
        model.lm_head.weight[0, 0] += 1.0
    hf_generate(model, ids, mask, max_new_tokens=4)  # a weight
    was = rounding.installed()
    try:
        rounding.uninstall() if was else rounding.install()
        hf_generate(model, ids, mask, max_new_tokens=4)  # the small-row switch
    finally:
        rounding.install() if was else rounding.uninstall()
    assert len(list(tmp_path.iterdir())) == 6


@pytest.mark.parametrize("folder", [None, ""])
def test_a_keyword_that_is_not_a_plain_value_or_no_folder_is_computed_not_kept(tmp_path, monkeypatch, folder):
    monkeypatch.setenv(ORACLE_DIR, str(tmp_path) if folder is None else folder)
    model = tiny_model("llama", seed=3)
    ids, mask = batch([3], seed=1)
    processors = LogitsProcessorList([MinLengthLogitsProcessor(1, eos_token_id=2)])
    hf_generate(model, ids, mask, max_new_tokens=2, logits_processor=processors)
    assert not list(tmp_path.iterdir())
