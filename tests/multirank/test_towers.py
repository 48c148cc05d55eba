"""Models with towers (a VLM's vision encoder): the local backend against HF ``generate()``, then
2 and 3 ranks on FSDP2 and DeepSpeed with a rank holding only text and a rank holding none; the
tick's agreement on the towers shown needed (off: the ranks' gathers part), and plain HF
``generate(synced_gpus=True)`` on ZeRO-3 hanging when only one rank has an image."""

from __future__ import annotations

import contextlib

import pytest
import torch
import tower_scenarios as sc
from vlm import EOS, PAD, QWEN_VL, hf_tokens, images, prompt, tiny_qwen2_vl

import shardgen


def _local_requests():
    return [
        (prompt([5, 6], images((4, 6), seed=1)), images((4, 6), seed=1)),
        (prompt([9], None, [10, 11, 12]), None),
        (prompt([5], images((2, 2), (4, 4), seed=3)), images((2, 2), (4, 4), seed=3)),
        (prompt([3, 4, 5, 6, 7], images((6, 2), seed=5)), images((6, 2), seed=5)),
    ]


@pytest.mark.parametrize("family", sorted(QWEN_VL))
@pytest.mark.parametrize("max_batch_size, max_prefill_tokens", [(None, None), (2, None), (None, 8)])
def test_qwen2_vl_local_matches_hf_per_request(max_batch_size, max_prefill_tokens, family):
    """Images of different sizes, two images in one prompt and a text-only request in one batch
    (and, at 2 rows, refills into a running batch): M-RoPE offsets carried into decode per row.
    Under a prefill budget the prompts go in chunks, each image whole in one of them. Qwen2-VL
    and Qwen2.5-VL (windowed vision blocks)."""
    model = QWEN_VL[family](0)
    reqs = _local_requests()
    lengths = [3, 10, 5, 10]  # rows ending early: refills take their slots
    want = [hf_tokens(model, p, x, n) for (p, x), n in zip(reqs, lengths, strict=True)]
    opts = {} if max_batch_size is None else {"max_batch_size": max_batch_size}
    if max_prefill_tokens is not None:
        opts["max_prefill_tokens"] = max_prefill_tokens
    with shardgen.Engine(model, backend="local", **opts) as eng:
        with eng.paused():  # every request queued before the first tick: the refills are the test's
            futs = [
                eng.submit(p, inputs=x, max_new_tokens=n, eos_token_id=EOS, pad_token_id=PAD)
                for (p, x), n in zip(reqs, lengths, strict=True)
            ]
        got = [f.result(timeout=60) for f in futs]
        if max_batch_size:
            assert eng.stats()["refills"] > 0
        if max_prefill_tokens:
            assert eng.stats()["prefill_forwards"] > eng.stats()["prefills"]  # in chunks
    assert [c.token_ids for c in got] == want


def test_shared_prefill_of_an_image_prompt_and_different_images_apart():
    """The n samples of one image prompt (one inputs dict) share its prefill; the same ids with
    other images do not (their tokens differ from the first's)."""
    model = tiny_qwen2_vl(0)
    a, b = images((4, 6), seed=1), images((4, 6), seed=2)
    p = prompt([5, 6], a)
    with shardgen.Engine(model, backend="local") as eng:
        got = eng.generate(
            [p, p, p, p], inputs=[a, a, a, b], max_new_tokens=10, eos_token_id=EOS, pad_token_id=PAD
        )
        stats = eng.stats()
    assert [c.token_ids for c in got] == [hf_tokens(model, p, a, 10)] * 3 + [hf_tokens(model, p, b, 10)]
    assert stats["prefill_tokens"] == 2 * len(p)  # two distinct (prompt, images) rows computed


def test_inputs_that_do_not_fit_the_prompt_are_value_errors():
    model = tiny_qwen2_vl(0)
    x = images((4, 6), seed=1)
    with shardgen.Engine(model, backend="local") as eng:
        with pytest.raises(ValueError, match="image tokens"):
            eng.generate([[5, 6, 7]], inputs=[x], max_new_tokens=2)
        with pytest.raises(ValueError, match="one dict"):
            eng.generate([[5, 6, 7]], inputs=[x, x], max_new_tokens=2)


def test_a_replica_takes_inputs_for_a_model_kind_without_named_towers(monkeypatch):
    """``backend="local"`` (a replica, no peer to part from) runs whatever a request's inputs run:
    Qwen2.5-VL with its towers unnamed still equals HF there."""
    from shardgen.backends import towers

    monkeypatch.delitem(towers.TOWERS, "qwen2_5_vl")
    model = QWEN_VL["qwen2_5_vl"](0)
    (p, x), (q, _) = _local_requests()[:2]
    with shardgen.Engine(model, backend="local") as eng:
        got = eng.generate([p, q], inputs=[x, None], max_new_tokens=6, eos_token_id=EOS, pad_token_id=PAD)
    assert [c.token_ids for c in got] == [hf_tokens(model, p, x, 6), hf_tokens(model, q, None, 6)]


@pytest.mark.multirank
def test_inputs_for_a_model_kind_without_named_towers_are_value_errors(ds_world2):
    """Sharded, a request's ``inputs`` would run a part of the model (an unnamed vision tower) on
    the ranks that have them only, where the tick cannot agree on it: refused before any forward,
    on the rank that gave them, naming the kinds that take them; the engine still serves."""
    out = ds_world2.run(sc.undeclared_inputs, timeout=120)
    assert "inputs ['pixel_values'] for model type 'llama'" in out[0]["generate"], out
    assert "qwen2_vl" in out[0]["generate"] and "rank 0, request 0" in out[0]["generate"], out
    assert "which has no towers shardgen knows" in out[0]["score"], out
    assert [r["served"] for r in out] == [3, 3], out


@pytest.mark.parametrize("max_batch_size", [None, 2])
def test_llava_next_local_matches_hf_per_request(max_batch_size):
    """LLaVA-NeXT: images of 2, 3 and 5 tiles in one batch (their tiles zero-padded to one
    tensor, as its processor batches them) beside a text request; at 2 rows, refills. Again
    with the prefix cache: the second pass reuses the first's image rows."""
    from tower_scenarios import llava_next_requests
    from vlm import hf_llava_tokens, tiny_llava_next

    model = tiny_llava_next(4)
    ps, xs = llava_next_requests(model, 0)
    lengths = [3, 8, 5, 8]  # rows ending early: refills take their slots
    want = [hf_llava_tokens(model, p, x, n) for p, x, n in zip(ps, xs, lengths, strict=True)]
    opts: dict = {"prefix_cache_tokens": 4096}
    if max_batch_size:
        opts["max_batch_size"] = max_batch_size
    with shardgen.Engine(model, backend="local", **opts) as eng:
        for k in range(2):
            # The first pass's requests all queued before its first tick (the refills are the
            # test's); not the second's: paused() drops the prefix cache, which it must hit.
            with eng.paused() if k == 0 else contextlib.nullcontext():
                futs = [
                    eng.submit(p, inputs=x, max_new_tokens=n, eos_token_id=EOS, pad_token_id=PAD)
                    for p, x, n in zip(ps, xs, lengths, strict=True)
                ]
            assert [f.result(timeout=60).token_ids for f in futs] == want
        stats = eng.stats()
    assert stats["cached_prompt_tokens"] > 0, stats
    if max_batch_size:
        assert stats["refills"] > 0, stats


@pytest.mark.parametrize("kind", ["idefics3", "smolvlm"])
def test_idefics3_local_matches_hf_per_request(kind):
    """Idefics3 and SmolVLM: one and two images per prompt beside a text request in one batch
    (the one-image prompt's images padded with a zero image, which the model drops)."""
    from tower_scenarios import idefics3_requests
    from vlm import hf_llava_tokens, tiny_idefics3

    model = tiny_idefics3(kind, 4)
    ps, xs = idefics3_requests(0)
    with shardgen.Engine(model, backend="local", prefix_cache_tokens=4096) as eng:
        for _ in range(2):
            got = eng.generate(ps, inputs=xs, max_new_tokens=8, eos_token_id=EOS, pad_token_id=PAD)
            want = [hf_llava_tokens(model, p, x, 8) for p, x in zip(ps, xs, strict=True)]
            assert [c.token_ids for c in got] == want


def test_multi_turn_rollout_with_images_local():
    """A conversation over an image prompt: every turn carries the prompt's images (the
    conversation holds their tokens), M-RoPE positions over the whole row; greedy turns equal HF
    ``generate()`` run turn by turn, and each next turn's KV comes from the prefix cache."""
    out = sc.multi_turn_images("local")
    assert out["bad"] == [] and out["turns"] == [3, 2, 1], out
    assert out["cached"] > 0, out


@pytest.mark.multirank
@pytest.mark.parametrize("backend", ["fsdp2", "deepspeed"])
def test_multi_turn_rollout_with_images_two_ranks(ds_world2, backend):
    """Rank 0's conversations over image prompts, rank 1's text only and fewer: the ranks' turns
    part in time, the vision tower agreed in each forward that runs it."""
    out = ds_world2.run(sc.multi_turn_images, backend, timeout=240)
    for r, res in enumerate(out):
        assert res["bad"] == [], f"rank {r}: {res['bad']}"
    assert out[0]["turns"] == [3, 2, 1] and out[1]["turns"] == [2]
    assert out[0]["cached"] > 0


@pytest.mark.parametrize("family", ["llava_next", "idefics3", "smolvlm"])
def test_score_llava_next_and_idefics3_rows_as_hf(family):
    """``score(prompts, responses, inputs=...)``: one run of image rows of different tile or image
    counts (padded to one tensor) beside a text row, within 2e-5 of HF's ``model(prompt +
    response, images)``."""
    from tower_scenarios import idefics3_requests, llava_next_requests
    from vlm import tiny_idefics3, tiny_llava_next

    model = tiny_llava_next(4) if family == "llava_next" else tiny_idefics3(family, 4)
    ps, xs = llava_next_requests(model, 0) if family == "llava_next" else idefics3_requests(0)
    rs = [[10, 11, 12], [13, 14], [15, 16, 17, 18], [19]][: len(ps)]
    with shardgen.Engine(model, backend="local") as eng:
        sb = eng.score(ps, rs, inputs=xs)
    for i, (p, r, x) in enumerate(zip(ps, rs, xs, strict=True)):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([p + r]), **(x or {})).logits[0, len(p) - 1 : -1]
        want = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(r)[:, None]).squeeze(-1)
        assert torch.allclose(sb.logprobs[i, : len(r)], want, atol=2e-5), (i, sb.logprobs[i], want)


@pytest.mark.multirank
def test_llava_next_and_idefics3_two_ranks_one_with_text_only(ds_world2):
    """LLaVA-NeXT, Idefics3 and SmolVLM on FSDP2 per layer and stationary and DeepSpeed per
    layer, rank 1 text only: it runs the vision tower (LLaVA-NeXT: and the packing's newline) on
    its shadow image."""
    for family in ("llava_next", "idefics3", "smolvlm"):
        for backend, gather, bucket_mb in [
            ("fsdp2", "per-layer", None), ("fsdp2", "stationary", None), ("deepspeed", "per-layer", 0.001),
        ]:  # fmt: skip
            out = ds_world2.run(sc.family_equal, family, backend, gather, bucket_mb, timeout=240)
            for r, res in enumerate(out):
                assert res["bad"] == [], f"{family} {backend} {gather}, rank {r}: {res['bad']}"
                assert res["policy"] == gather
            assert out[1]["tower_runs"] > 0, (family, backend, gather)


@pytest.mark.multirank
def test_qwen2_5_vl_and_qwen3_vl_two_ranks_one_with_text_only(ds_world2):
    """Qwen2.5-VL (windowed vision blocks, a gate/up/down MLP) and Qwen3-VL (deepstack features)
    on FSDP2 per layer and stationary and DeepSpeed per layer, rank 1 text only: it runs the
    vision tower on its shadow image."""
    for family in ("qwen2_5_vl", "qwen3_vl"):
        for backend, gather, bucket_mb in [
            ("fsdp2", "per-layer", None), ("fsdp2", "stationary", None), ("deepspeed", "per-layer", 0.001),
        ]:  # fmt: skip
            out = ds_world2.run(sc.vlm_equal, backend, gather, None, bucket_mb, None, family, timeout=240)
            for r, res in enumerate(out):
                assert res["bad"] == [], f"{family} {backend} {gather}, rank {r}: {res['bad']}"
                if gather == "stationary":
                    assert_stationary(res, r)
            assert out[1]["tower_runs"] > 0, (family, backend, gather)


@pytest.mark.multirank
@pytest.mark.parametrize(
    "backend, gather",
    [
        ("fsdp2", "per-layer"), ("deepspeed", "per-layer"), ("fsdp2", "once"), ("fsdp2", "auto"),
        ("deepspeed", "once"), ("fsdp2", "stationary"), ("deepspeed", "stationary"),
    ],
)  # fmt: skip
def test_vlm_two_ranks_one_with_text_only(ds_world2, backend, gather):
    """``stationary``: every forward stationary on both ranks, the vision tower's exchanges sized
    at the call (rank 1's on its shadow image), only its patch convolution gathered per call."""
    out = ds_world2.run(sc.vlm_equal, backend, gather, timeout=240)
    for r, res in enumerate(out):
        assert res["bad"] == [], f"rank {r}: {res['bad']}"
        if gather == "stationary":
            assert_stationary(res, r)
    if gather in ("per-layer", "stationary"):
        assert out[1]["tower_runs"] > 0  # rank 1 (no image) ran the vision tower on shadow inputs
    if gather == "once":
        assert [res["policy"] for res in out] == ["once", "once"]  # the gathered replica, not per layer


def assert_stationary(res: dict, rank: int) -> None:
    """Every forward of the rank ran stationary, the vision tower's exchanges sized at the call
    among them (a rank without an image: on its shadow image), only the patch convolution gathered."""
    st = res["stationary"]
    assert res["policy"] == "stationary" and st["forwards"] == res["forwards"] > 0, (rank, st)
    assert st["free_exchanges"] > 0 and st["fallbacks"] == ["model.visual.patch_embed.proj"], (rank, st)
    assert any(n.startswith("model.visual.blocks.") for n in st["free"]), st["free"]


# At 3 ranks (rank 2 holds nothing: its shadows run the towers alone), the cases of `make test`, then
# those of `make fuzz` (each also at 2 ranks, test_vlm_two_ranks_one_with_text_only and
# test_llava_two_ranks_one_with_text_only): (Qwen2-VL cases, LLaVA cases, other families).
VLM3 = (
    [("fsdp2", "per-layer", None), ("deepspeed", "per-layer", 0), ("deepspeed", "stationary", None)],
    [("deepspeed", 0.001, "per-layer")],
    ["llava_next", "idefics3", "qwen3_vl"],
)
VLM3_REST = (
    [("fsdp2", "once", None), ("deepspeed", "per-layer", 0.001)],
    [("fsdp2", None, "per-layer"), ("fsdp2", None, "stationary")],
    [],
)


@pytest.mark.multirank
@pytest.mark.parametrize(
    "cases", [pytest.param(VLM3, id="test"), pytest.param(VLM3_REST, id="rest", marks=pytest.mark.long)]
)
def test_vlm_three_ranks_text_only_and_none(ds_world3, cases):
    """Rank 0 images, rank 1 text only, rank 2 nothing; batches of 2 (refills); FSDP2, and
    DeepSpeed with each unit a bucket and module by module (its own hooks), and stationary; then
    LLaVA, LLaVA-NeXT, Idefics3 and Qwen3-VL."""

    world = ds_world3
    qwen2_vl, llava, families = cases
    for backend, gather, bucket_mb in qwen2_vl:
        out = world.run(sc.vlm_equal, backend, gather, 2, bucket_mb, timeout=300)
        for r, res in enumerate(out):
            assert res["bad"] == [], f"{backend} {gather} {bucket_mb}, rank {r}: {res['bad']}"
            if gather == "stationary":
                assert_stationary(res, r)
        if gather != "once":
            assert out[1]["tower_runs"] > 0 and out[2]["tower_runs"] > 0  # no image on either
    for backend, bucket_mb, gather in llava:  # LLaVA: rank 2 none
        got = world.run(sc.llava_equal, backend, bucket_mb, gather, timeout=240)
        assert got == [[], [], []], (backend, gather)
    for family in families:  # rank 2 none: its shadows run the tower alone (FSDP2 per layer)
        if family == "qwen3_vl":
            out = world.run(sc.vlm_equal, "fsdp2", "per-layer", 2, None, None, "qwen3_vl", timeout=240)
        else:
            out = world.run(sc.family_equal, family, "fsdp2", "per-layer", timeout=240)
        assert [res["bad"] for res in out] == [[], [], []], family
        assert out[2]["tower_runs"] > 0, family


@pytest.mark.multirank
@pytest.mark.parametrize("backend, bucket_mb", [("fsdp2", None), ("deepspeed", 0.001), ("deepspeed", 0)])
def test_without_the_tower_agreement_the_ranks_part(backend, bucket_mb):
    """The same run as above with the tick's tower agreement switched off fails (the vision
    tower's gathers on rank 0 meet the decoder's on rank 1: an error or a hang, killed)."""
    from rollout_scenarios import ds_world
    from world import WorldError, WorldHang

    with ds_world(2) as world:
        with pytest.raises((WorldError, WorldHang)):
            world.run(sc.without_agreement, backend, bucket_mb, timeout=60)


@pytest.mark.multirank
def test_plain_hf_generate_on_zero3_hangs_when_one_rank_has_an_image():
    from rollout_scenarios import ds_world
    from world import WorldHang

    with ds_world(2) as world:
        out = world.run(sc.hf_zero3_one_image, True, timeout=90)  # an image on every rank: returns
        assert all(o.startswith("returned") for o in out)
        with pytest.raises(WorldHang) as hang:
            world.run(sc.hf_zero3_one_image, False, timeout=8)  # 4 tokens of a tiny model: 8 s is a hang
    assert "generate" in str(hang.value)  # stuck inside HF generate()


def test_rollout_with_images_shares_each_prompts_prefill():
    """``rollout(inputs=...)``: a prompt's n rows take its one inputs dict (one prefill), greedy
    rows equal HF; a text-only prompt beside it; ``rollout_iter`` gives the same rows."""
    model = tiny_qwen2_vl(0)
    a = images((4, 6), seed=1)
    prompts = [prompt([5, 6], a), prompt([9], None, [10, 11])]
    with shardgen.Engine(model, backend="local") as eng:
        b = eng.rollout(prompts, n=3, inputs=[a, None], do_sample=False, max_new_tokens=6, eos_token_id=EOS)
        stats = eng.stats()
        streamed = dict(
            eng.rollout_iter(
                prompts, n=3, inputs=[a, None], do_sample=False, max_new_tokens=6, eos_token_id=EOS
            )
        )
    for i, (p, x) in enumerate(zip(prompts, [a, None], strict=True)):
        want = hf_tokens(model, p, x, 6)
        for j in range(3):
            r = b.response_lengths[3 * i + j]
            assert b.response_ids[3 * i + j, :r].tolist() == want
        assert streamed[i].response_ids[0, : len(want)].tolist() == want
    assert stats["prefill_tokens"] == sum(len(p) for p in prompts)  # each prompt once, not n times
    with pytest.raises(ValueError, match="one dict"):
        eng.rollout(prompts, n=2, inputs=[a])


@pytest.fixture(scope="module")
def vlm_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2vl")
    tiny_qwen2_vl(3).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("family", sorted(QWEN_VL))
def test_from_pretrained_on_an_image_text_to_text_checkpoint(vlm_checkpoint, tmp_path, family):
    """Built by the image-text-to-text auto class, its weights read from the layout
    ``save_pretrained`` writes (``model.layers``: the model's ``model.language_model.layers``)."""
    ref = QWEN_VL[family](3)
    if family != "qwen2_vl":
        ref.save_pretrained(tmp_path)
    a = images((4, 6), seed=1)
    p = prompt([5, 6], a)
    path = vlm_checkpoint if family == "qwen2_vl" else str(tmp_path)
    with shardgen.Engine.from_pretrained(path, backend="local") as eng:
        got = eng.generate(
            [p, [9, 10]], inputs=[a, None], max_new_tokens=8, eos_token_id=EOS, pad_token_id=PAD
        )
    assert [c.token_ids for c in got] == [hf_tokens(ref, p, a, 8), hf_tokens(ref, [9, 10], None, 8)]


def test_from_pretrained_keeps_the_checkpoints_processor(tmp_path):
    """A checkpoint saved with its processor: ``engine.processor`` is it (its tokenizer the
    engine's), and a request built with it (a PIL image and text with the image token) decodes as
    HF ``generate()`` does on the processor's own outputs. Without processor files: None."""
    import numpy as np
    from PIL import Image
    from vlm import hf_llava_tokens, tiny_llava, tiny_llava_processor

    model, proc = tiny_llava(4), tiny_llava_processor()
    model.save_pretrained(tmp_path / "llava")
    proc.save_pretrained(tmp_path / "llava")
    picture = Image.fromarray((np.random.default_rng(0).random((20, 24, 3)) * 255).astype("uint8"))
    with shardgen.Engine.from_pretrained(str(tmp_path / "llava"), backend="local") as eng:
        assert type(eng.processor).__name__ == "LlavaProcessor" and eng.tokenizer is not None
        x = eng.processor(images=[picture], text=["t3 t4 <image> t7"], return_tensors="pt")
        ids = x["input_ids"][0].tolist()
        assert ids.count(proc.image_token_id) == 16  # the processor expanded the image token
        got = eng.generate([ids], inputs=[{"pixel_values": x["pixel_values"]}], max_new_tokens=8,
                           eos_token_id=EOS, pad_token_id=PAD)  # fmt: skip
    assert got[0].token_ids == hf_llava_tokens(model, ids, {"pixel_values": x["pixel_values"]}, 8)
    assert got[0].text == proc.tokenizer.decode(got[0].token_ids, skip_special_tokens=True)
    tiny_llava(4).save_pretrained(tmp_path / "bare")
    with shardgen.Engine.from_pretrained(str(tmp_path / "bare"), backend="local") as eng:
        assert eng.processor is None


@pytest.mark.multirank
@pytest.mark.parametrize("backend", ["fsdp2", "deepspeed"])
def test_from_pretrained_vlm_two_ranks(ds_world2, vlm_checkpoint, backend):
    out = ds_world2.run(sc.vlm_from_pretrained, backend, vlm_checkpoint, timeout=240)
    assert out == [[], []]


@pytest.mark.parametrize("max_prefill_tokens", [None, 40])
def test_llava_local_matches_hf_per_request(max_prefill_tokens):
    """A second family: LLaVA's vision tower and projector (one tower), one and two images per
    prompt beside text-only requests in one batch (and in chunks, each image whole in one)."""
    from vlm import hf_llava_tokens, llava_images, llava_prompt, tiny_llava

    model = tiny_llava(0)
    xs = [llava_images(1, 1), None, llava_images(2, 3), llava_images(1, 5)]
    ps = [llava_prompt([5, 6], xs[0]), llava_prompt([9], None, [10, 11, 12]), llava_prompt([5], xs[2])]
    ps.append(llava_prompt([3, 4, 5], xs[3]))
    with shardgen.Engine(model, backend="local", max_prefill_tokens=max_prefill_tokens) as eng:
        got = eng.generate(ps, inputs=xs, max_new_tokens=10, eos_token_id=EOS, pad_token_id=PAD)
        assert eng.stats()["prefill_forwards"] == (1 if max_prefill_tokens is None else 3)
    assert [c.token_ids for c in got] == [
        hf_llava_tokens(model, p, x, 10) for p, x in zip(ps, xs, strict=True)
    ]


@pytest.mark.multirank
@pytest.mark.parametrize(
    "backend, bucket_mb, gather",
    [
        ("fsdp2", None, "per-layer"), ("deepspeed", 0.001, "per-layer"), ("deepspeed", None, "once"),
        ("deepspeed", None, "stationary"),
    ],
)  # fmt: skip
def test_llava_two_ranks_one_with_text_only(ds_world2, backend, bucket_mb, gather):
    """``stationary``: the scenario also checks every forward ran stationary (the vision tower's
    exchanges sized at the call, its patch convolution alone gathered per call)."""
    assert ds_world2.run(sc.llava_equal, backend, bucket_mb, gather, timeout=240) == [[], []]


# ----------------------------------------------------------------------------- the prefix cache
@pytest.mark.parametrize("rank, max_prefill_tokens", [(0, None), (1, None), (0, 4)])
def test_image_rows_share_a_cached_prefix_only_with_the_same_images(rank, max_prefill_tokens):
    """The same system text and image with another question: the second prefill computes only
    the new question (the cached KV runs through the image); the same ids with another image
    take only the text before it; text rows unaffected. Greedy tokens equal HF per request.
    Under a budget of 4 tokens: the uncached columns in chunks, the image's 6 tokens in one."""
    res = sc.prefix_cache_equal("local", rank=rank, max_prefill_tokens=max_prefill_tokens)
    assert res["bad"] == []
    assert (res["computed"], res["cached"]) == sc.PREFIX_CACHE_COUNTS[rank]
    if max_prefill_tokens:  # 31 tokens: 8 chunks (a bound at 23 moved to the image's start, 21);
        assert res["prefill_forwards"] == 8 + 1 + 2 + 1  # then 3, 11 (21-28 and 28-32), 3


def test_a_batch_of_image_rows_takes_cached_columns_outside_every_rows_images():
    """Rows of different lengths in one prefill: the cached columns end where none cuts a row's
    image (they are lowered to an image's start), and the rows' images after them go with the
    forward (two images in one prompt, one of them cached)."""
    model = tiny_qwen2_vl(0)
    a, b = images((4, 6), seed=1), images((2, 2), (4, 4), seed=2)
    first = [prompt(sc.SYSTEM, a, [7, 8, 9]), prompt(sc.SYSTEM, b, [3, 3])]
    then = [prompt(sc.SYSTEM, a, [7, 5, 6, 11]), prompt(sc.SYSTEM, a, [7, 5, 6, 11, 12, 13, 14, 15])]
    then.append(prompt(sc.SYSTEM, b, [3, 3, 4, 5]))
    with shardgen.Engine(model, backend="local", prefix_cache_tokens=4096) as eng:
        got = eng.generate(first, inputs=[a, b], max_new_tokens=6, eos_token_id=EOS, pad_token_id=PAD)
        got += eng.generate(then, inputs=[a, a, b], max_new_tokens=6, eos_token_id=EOS, pad_token_id=PAD)
        stats = eng.stats()
    xs = [a, b, a, a, b]
    assert [c.token_ids for c in got] == [
        hf_tokens(model, p, x, 6) for p, x in zip(first + then, xs, strict=True)
    ]
    # 36 columns: the rows' matches (29, 29 and 30 tokens) end at columns 33, 29 and 33, inside the
    # first two rows' image (prompt columns 21-27): lowered to column 21 (the longest row's image)
    assert stats["cached_prompt_tokens"] == (21 - 4) + 21 + (21 - 3)


def test_llava_rows_share_a_cached_prefix_up_to_the_first_other_image():
    from vlm import hf_llava_tokens, llava_images, llava_prompt, tiny_llava

    model = tiny_llava(0)
    a = llava_images(2, 1)
    b = {"pixel_values": torch.cat([a["pixel_values"][:1], llava_images(1, 2)["pixel_values"]])}
    ps = [llava_prompt(sc.SYSTEM, a, [7, 8]), llava_prompt(sc.SYSTEM, a, [7, 9, 10])]
    ps.append(llava_prompt(sc.SYSTEM, b, [7, 9, 10]))  # the first image the same, the second not
    cached = []
    with shardgen.Engine(model, backend="local", prefix_cache_tokens=4096) as eng:
        for p, x in zip(ps, [a, a, b], strict=True):
            n = eng.stats()["cached_prompt_tokens"]
            c = eng.generate([p], inputs=[x], max_new_tokens=6, eos_token_id=EOS, pad_token_id=PAD)[0]
            cached.append(eng.stats()["cached_prompt_tokens"] - n)
            assert c.token_ids == hf_llava_tokens(model, p, x, 6)
    assert cached == [0, len(ps[1]) - 2, 20 + 16 + 1]  # up to the second image's tokens


def test_image_layout_salts_each_images_tokens_and_never_cuts_one():
    from shardgen.generation.images import image_layout

    model = tiny_qwen2_vl(0)
    x = images((2, 2), (4, 4), seed=1)
    ids = prompt([5, 6], x)  # 5 6 START img END START img*4 END 7 8
    lay = image_layout(ids, x, model.config)
    assert lay.spans == ((3, 4), (6, 10))
    assert [lay.cut(n) for n in (3, 4, 5, 7, 10)] == [3, 4, 5, 6, 10]
    assert lay.inputs_of(x, 1, 2)["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert lay.inputs_of(x, 0, 1)["pixel_values"].shape[0] == 4 and lay.inputs_of(x, 2, 2) is None
    same = image_layout(ids, {k: v.clone() for k, v in x.items()}, model.config)
    other = image_layout(ids, images((2, 2), (4, 4), seed=2), model.config)
    assert same.keys == lay.keys and other.keys[:3] == lay.keys[:3] and other.keys[3] != lay.keys[3]
    assert image_layout(ids, {**x, "video_grid_thw": x["image_grid_thw"]}, model.config).spans == ((3, 10),)


@pytest.mark.multirank
@pytest.mark.parametrize("backend", ["fsdp2", "deepspeed"])
def test_vlm_chunked_prefill_two_ranks(ds_world2, backend):
    """Prefills in chunks of at most 8 tokens, rank 1 text only: a chunk past the first with an
    image runs the vision tower, and the tick carries it (rank 1 runs it on a shadow image)."""
    out = ds_world2.run(sc.vlm_equal, backend, "per-layer", None, None, 8, timeout=240)
    for r, res in enumerate(out):
        assert res["bad"] == [], f"rank {r}: {res['bad']}"
        assert res["prefill_forwards"] > res["prefills"], f"rank {r}: {res}"


@pytest.mark.multirank
@pytest.mark.parametrize("backend", ["fsdp2", "deepspeed"])
def test_image_prefix_cache_two_ranks(ds_world2, backend):
    """Per layer: rank 0's image rows hit the cache (a forward with no image left while rank 1
    runs text; then one with an image again), rank 1 text only."""
    out = ds_world2.run(sc.prefix_cache_equal, backend, timeout=240)
    for r, res in enumerate(out):
        assert res["bad"] == [], f"rank {r}: {res['bad']}"
        assert (res["computed"], res["cached"]) == sc.PREFIX_CACHE_COUNTS[r], f"rank {r}"
