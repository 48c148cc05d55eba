"""Decoder architectures beyond the dev ones (tests/helpers/arch_scenarios.py): FSDP2 per layer and
stationary and DeepSpeed per layer at 2 ranks with uneven prompts, greedy tokens equal to HF's
(about 15 s on 2 cores)."""

from __future__ import annotations

import arch_scenarios as sc
import pytest

pytestmark = pytest.mark.multirank


@pytest.mark.timeout(600)
def test_decoder_architectures_equal_hf(ds_world2):
    wrong = []
    for arch in sc.ARCHS:
        for backend, gather in [("fsdp2", "per-layer"), ("fsdp2", "stationary"), ("deepspeed", "per-layer")]:
            out = ds_world2.run(sc.arch_equal, arch, backend, gather, timeout=120)
            for r, res in enumerate(out):
                if res["bad"] or res["policy"] != gather:
                    wrong.append((arch, backend, gather, r, res))
    assert wrong == []
