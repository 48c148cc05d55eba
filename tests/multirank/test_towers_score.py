"""``engine.score(prompts, responses, inputs=...)`` on models with towers (a VLM's images per row):
the local backend against single-process HF teacher forcing (Qwen2-VL and LLaVA), the mistakes at
the door, and 2 ranks on FSDP2 and DeepSpeed with rank 0 scoring image rows and rank 1 text rows
only (its forward runs the vision tower on a shadow image, so the gathers match; with the tick's
tower agreement off they part)."""

from __future__ import annotations

import pytest
import torch
import tower_scenarios as sc
from vlm import hf_scores, images, prompt, tiny_llava, tiny_qwen2_vl

import shardgen

TOL = 2e-5  # as tests/unit/test_score.py: padded rows of a batch against one unpadded row each


@pytest.mark.parametrize("llava", [False, True])
def test_score_with_images_matches_hf_teacher_forcing(llava):
    """Image rows of different sizes (two images in one prompt) beside a text row, top-k and
    logits too; a single image row bit for bit (the same shapes as HF's forward)."""
    torch.set_num_threads(1)
    model = (tiny_llava if llava else tiny_qwen2_vl)(0)
    ps, rs, xs = sc.score_rows(0, llava)
    with shardgen.Engine(model, backend="local", max_prefill_tokens=4) as eng:  # a budget: not for image runs
        sb = eng.score(ps, rs, inputs=xs, top_k=3, logits=True)
        one = eng.score(ps[:1], rs[:1], inputs=xs[:1])
        assert eng.stats()["prefill_forwards"] == 2  # each run one forward, whole
    for i, (p, r, x) in enumerate(zip(ps, rs, xs, strict=True)):
        want = hf_scores(model, p, r, x)
        assert sb.mask[i].tolist()[: len(r)] == [1] * len(r)
        assert (sb.logprobs[i, : len(r)] - want).abs().max() < TOL, i
        assert (sb.top_logprobs[i, : len(r), 0] >= sb.logprobs[i, : len(r)] - TOL).all()
        assert sb.logits.shape[-1] == 128
    assert torch.equal(one.logprobs[0], hf_scores(model, ps[0], rs[0], xs[0]))
    with shardgen.Engine(model, backend="local") as eng:
        plain = eng.score(ps[1:2], rs[1:2])  # the text row alone, no inputs: its scores as beside images
        moved = dict(xs[0], pixel_values=xs[0]["pixel_values"] + 1)  # other pixels, the same grid
        other = eng.score(ps[:1], rs[:1], inputs=[moved])
    assert (plain.logprobs[0] - sb.logprobs[1, : len(rs[1])]).abs().max() < TOL
    assert (other.logprobs[0] - one.logprobs[0]).abs().max() > 1e-4  # the images are used


def test_score_inputs_that_do_not_fit_are_value_errors():
    model = tiny_qwen2_vl(0)
    x = images((4, 6), seed=1)
    p = prompt([5, 6], x)
    with shardgen.Engine(model, backend="local") as eng:
        with pytest.raises(ValueError, match="row 0: the prompt has 0 image tokens"):
            eng.score([[5, 6, 7]], [[8]], inputs=[x])
        with pytest.raises(ValueError, match="row 1: pixel_values has 4 patches"):
            bad = {"pixel_values": x["pixel_values"][:4], "image_grid_thw": x["image_grid_thw"]}
            eng.score([[5], p], [[8], [8]], inputs=[None, bad])
        with pytest.raises(ValueError, match="one dict .* per row: got 2 for 1 rows"):
            eng.score([p], [[8]], inputs=[x, x])
        with pytest.raises(ValueError, match="must be tensors"):
            eng.score([p], [[8]], inputs=[{"pixel_values": [1.0]}])
        assert eng.score([p], [[8]], inputs=[x]).logprobs.shape == (1, 1)  # the engine still serves


@pytest.mark.multirank
@pytest.mark.parametrize(
    "backend, gather, bucket_mb",
    [
        ("fsdp2", "per-layer", None), ("deepspeed", "per-layer", 0.001), ("fsdp2", "once", None),
        ("fsdp2", "stationary", None),
    ],
)  # fmt: skip
def test_score_two_ranks_one_with_text_only(ds_world2, backend, gather, bucket_mb):
    """Rank 0 scores image rows, rank 1 text rows only: each equals HF per row, and rank 1's
    forward ran the vision tower (on its shadow image) when gathered per layer or stationary."""
    out = ds_world2.run(sc.score_equal, backend, gather, bucket_mb, timeout=180)
    for r, res in enumerate(out):
        assert res["diff"] < TOL, f"rank {r}: {res['diff']}"
        assert res["policy"] == gather
    if gather != "once":  # (once: the forwards run on the gathered replica, not these modules)
        assert out[0]["tower_runs"] >= 1
        assert out[1]["tower_runs"] >= 1  # the shadow: rank 1 holds no image


@pytest.mark.multirank
def test_llava_score_two_ranks(ds_world2):
    out = ds_world2.run(sc.score_equal, "fsdp2", "per-layer", None, True, timeout=180)
    assert [res["diff"] < TOL for res in out] == [True, True], out
    assert out[1]["tower_runs"] >= 1


@pytest.mark.multirank
def test_score_without_the_tower_agreement_the_ranks_part(ds_world2):
    """The FSDP2 run above with the tick's tower agreement off fails: rank 0's vision tower
    gathers meet rank 1's decoder gathers (an error or a hang, killed). Last in the module: the
    World does not survive it."""
    from world import WorldError, WorldHang

    with pytest.raises((WorldError, WorldHang)):
        ds_world2.run(sc.score_without_agreement, "fsdp2", timeout=30)
