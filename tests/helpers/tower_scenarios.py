"""Scenarios for tests/multirank/test_towers.py (they run inside gloo ranks of a World): a tiny Qwen2-VL
(``vlm.py``) generating on ranks whose batches hold images, text only, or nothing."""

from __future__ import annotations

import time
from typing import Any

import torch.distributed as dist
from encdec_scenarios import stationary_stats
from vlm import EOS, IMAGE, PAD, QWEN_VL, hf_tokens, images, prompt, tiny_qwen2_vl

# Per rank: the calls it makes, each a list of (text, images or None). Rank 0 mixes images of
# different sizes, several images in one prompt and a text-only request in one batch; rank 1
# holds only text; rank 2 (at 3 ranks) holds none.
_REQUESTS = {
    0: [
        [([5, 6], ((4, 6),)), ([9], None), ([5], ((2, 2), (4, 4))), ([3, 4, 5, 6, 7], ((6, 2),))],
        [([11, 12], ((2, 4),)), ([13], ((4, 2), (2, 2)))],
    ],
    1: [[([9, 10], None), ([4, 4, 4], None)], [([7], None)]],
    2: [],
}


def _requests(r: int) -> list[list[tuple[list[int], Any]]]:
    out = []
    for k, call in enumerate(_REQUESTS.get(r, [])):
        reqs = []
        for j, (text, sizes) in enumerate(call):
            x = None if sizes is None else images(*sizes, seed=100 * r + 10 * k + j)
            reqs.append((prompt(text, x), x))
        out.append(reqs)
    return out


def vlm_equal(
    backend: str,
    gather: str,
    max_batch_size: int | None = None,
    bucket_mb: float | None = None,
    max_prefill_tokens: int | None = None,
    family: str = "qwen2_vl",
) -> dict:
    """Every rank's requests (``_REQUESTS``) on one engine; each completion against single-process
    HF ``generate()`` on an unsharded copy. Returns the mismatches and what the engine counted.
    ``bucket_mb`` (DeepSpeed): small, each unit is a bucket of its own (the tiny model's units
    otherwise fit one bucket, gathered whole at the first unit either rank calls); 0: module by
    module, DeepSpeed's own hooks. ``max_prefill_tokens``: prefills in chunks, an image's tokens
    in one of them (a later chunk's images run the vision tower: the tick carries it).
    ``family``: the model type (``vlm.QWEN_VL``)."""
    import shardgen

    r = dist.get_rank()
    model, ref = QWEN_VL[family](3), QWEN_VL[family](3)
    runs: list[int] = []  # the vision tower's forwards on this rank (a replica's not counted)
    model.model.visual.register_forward_hook(lambda *_: runs.append(1))
    calls = _requests(r)
    bad = []
    opts: dict[str, Any] = {"gather": gather}
    if max_batch_size:
        opts["max_batch_size"] = max_batch_size
    if bucket_mb is not None:
        opts["bucket_mb"] = bucket_mb
    if max_prefill_tokens is not None:
        opts["max_prefill_tokens"] = max_prefill_tokens
    with shardgen.Engine(model, backend=backend, **opts) as eng:
        for k, reqs in enumerate(calls):
            got = eng.generate(
                [p for p, _ in reqs], inputs=[x for _, x in reqs], max_new_tokens=8,
                eos_token_id=EOS, pad_token_id=PAD,
            )  # fmt: skip
            for j, ((p, x), c) in enumerate(zip(reqs, got, strict=True)):
                want = hf_tokens(ref, p, x, 8)
                if c.token_ids != want:
                    bad.append((k, j, c.token_ids, want))
    stats = eng.stats()  # after close: every rank's work done
    out = {"bad": bad, "shadows": stats["shadow_forwards"], "tower_runs": len(runs)}
    out["forwards"] = stats["forwards"] + stats["shadow_forwards"]
    out["prefills"], out["prefill_forwards"] = stats["prefills"], stats["prefill_forwards"]
    return {**out, "policy": eng.gather_policy, "stationary": stationary_stats(eng.backend.stationary)}


def without_agreement(backend: str, bucket_mb: float | None = None) -> str:
    """The towers' agreement switched off: rank 0 has an image, rank 1 text only. Rank 1's
    forward skips the vision tower's gathers that rank 0's issues: they never match."""
    from shardgen.core import protocol

    protocol._AGREE_TOWERS = False
    try:
        return vlm_equal(backend, "per-layer", bucket_mb=bucket_mb)["policy"]
    finally:
        protocol._AGREE_TOWERS = True


def hf_zero3_one_image(every_rank: bool) -> str:
    """Plain HF ``generate(synced_gpus=True)`` on a ZeRO-3 model: rank 0's prompt has an image and
    rank 1's none (``every_rank``: both have one). With one image, rank 0 gathers the vision
    tower's parameters and rank 1 the decoder's: it hangs."""
    import deepspeed

    model = tiny_qwen2_vl(3)
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    m = engine.module
    x = images((4, 6), seed=1) if dist.get_rank() == 0 or every_rank else None
    p = prompt([5, 6], x)
    t0 = time.monotonic()
    import torch

    ids = torch.tensor([p])
    kw = {} if x is None else dict(x, mm_token_type_ids=(ids == 120).int())
    m.generate(input_ids=ids, max_new_tokens=4, do_sample=False, synced_gpus=True, **kw)
    return f"returned after {time.monotonic() - t0:.1f}s"


def vlm_from_pretrained(backend: str, path: str) -> list:
    """``Engine.from_pretrained`` on a saved Qwen2-VL checkpoint (its keys in the older layout that
    ``save_pretrained`` writes), rank 0 with an image, rank 1 text only: the mismatches to HF."""
    import shardgen

    ref = tiny_qwen2_vl(3)
    x = images((4, 6), seed=1) if dist.get_rank() == 0 else None
    p = prompt([5, 6], x)
    with shardgen.Engine.from_pretrained(path, backend=backend) as eng:
        got = eng.generate([p], inputs=[x], max_new_tokens=8, eos_token_id=EOS, pad_token_id=PAD)[0].token_ids
    want = hf_tokens(ref, p, x, 8)
    return [] if got == want else [(got, want)]


def _against_hf(eng: Any, ref: Any, ps: list[list[int]], xs: list[Any]) -> list:
    """``ps`` (with their ``xs``) generated greedily on ``eng`` against HF ``generate()`` on ``ref``
    per request (the LLaVA layout of inputs: passed to ``generate`` as they are): the mismatches."""
    from vlm import hf_llava_tokens

    if not ps:
        return []
    got = eng.generate(ps, inputs=xs, max_new_tokens=8, eos_token_id=EOS, pad_token_id=PAD)
    want = [hf_llava_tokens(ref, p, x, 8) for p, x in zip(ps, xs, strict=True)]
    return [(c.token_ids, w) for c, w in zip(got, want, strict=True) if c.token_ids != w]


def llava_equal(backend: str, bucket_mb: float | None = None, gather: str = "per-layer") -> list:
    """LLaVA: rank 0 one and two images per prompt beside a text-only request, rank 1 text only,
    any rank past 1 none; against HF ``generate()`` per request. The mismatches; ``stationary``:
    also a line if a forward was not stationary, no exchange was sized at the call (the tower's),
    or a module fell back to gathers."""
    from vlm import llava_images, llava_prompt, tiny_llava

    import shardgen

    r = dist.get_rank()
    model, ref = tiny_llava(4), tiny_llava(4)
    if r == 0:
        xs = [llava_images(1, 1), None, llava_images(2, 3)]
        ps = [llava_prompt([5, 6], xs[0]), llava_prompt([9], None, [10, 11]), llava_prompt([5], xs[2])]
    elif r == 1:
        xs, ps = [None, None], [[9, 10, 11], [4, 4]]
    else:
        xs, ps = [], []
    opts: dict[str, Any] = {} if bucket_mb is None else {"bucket_mb": bucket_mb}
    with shardgen.Engine(model, backend=backend, gather=gather, **opts) as eng:
        bad = _against_hf(eng, ref, ps, xs)
    if gather == "stationary":
        st, stats = stationary_stats(eng.backend.stationary), eng.stats()
        forwards = stats["forwards"] + stats["shadow_forwards"]
        if st is None or st["forwards"] != forwards or not st["free_exchanges"] or st["fallbacks"] != _CONVS:
            bad.append(("not stationary", forwards, st))
    return bad


def llava_next_requests(model: Any, r: int) -> tuple[list[list[int]], list[Any]]:
    """Rank 0: images of three sizes (2, 3 and 5 tiles: one batch pads their tiles) beside a text
    request; rank 1 text only; any rank past 1 none."""
    from vlm import llava_next_image

    if r == 0:
        ps, xs = [], []
        for hw, seed in (((16, 16), 1), ((32, 16), 2), (None, 0), ((32, 32), 3)):
            x, k = (None, 0) if hw is None else llava_next_image(model, *hw, seed)
            ps.append([5] + [IMAGE] * k + [7, 8] if x is not None else [5, 6, 7])
            xs.append(x)
        return ps, xs
    return ([[9, 10, 11], [4, 4]], [None, None]) if r == 1 else ([], [])


def idefics3_requests(r: int) -> tuple[list[list[int]], list[Any]]:
    """Rank 0: one and two images per prompt (one batch pads the first to two, a zero image the
    model drops) beside a text request; rank 1 text only; any rank past 1 none."""
    from vlm import IDEFICS_TOKENS, idefics3_images

    if r == 0:
        one, two = idefics3_images(1, 1), idefics3_images(2, 2)
        image = [IMAGE] * IDEFICS_TOKENS
        return [[5, *image, 7, 8], [5, 6, 7], [5, *image, 9, *image, 7]], [one, None, two]
    return ([[9, 10, 11], [4, 4]], [None, None]) if r == 1 else ([], [])


def family_equal(family: str, backend: str, gather: str, bucket_mb: float | None = None) -> dict:
    """A VLM ``family`` (``llava_next``: ``llava_next_requests``; ``idefics3`` / ``smolvlm``:
    ``idefics3_requests``) against HF ``generate()`` per request: the mismatches and the vision
    tower's runs on this rank."""
    from vlm import tiny_idefics3, tiny_llava_next

    import shardgen

    r = dist.get_rank()
    if family == "llava_next":
        model, ref = tiny_llava_next(4), tiny_llava_next(4)
        tower = model.model.vision_tower
        ps, xs = llava_next_requests(ref, r)
    else:
        model, ref = tiny_idefics3(family, 4), tiny_idefics3(family, 4)
        tower = model.model.vision_model
        ps, xs = idefics3_requests(r)
    runs: list[int] = []
    tower.register_forward_hook(lambda *_: runs.append(1))
    opts: dict[str, Any] = {} if bucket_mb is None else {"bucket_mb": bucket_mb}
    with shardgen.Engine(model, backend=backend, gather=gather, **opts) as eng:
        bad = _against_hf(eng, ref, ps, xs)
    return {"bad": bad, "tower_runs": len(runs), "policy": eng.gather_policy,
            "stationary": stationary_stats(eng.backend.stationary)}  # fmt: skip


#: The one module of the tiny LLaVA that falls back (gathered per call): the vision tower's
#: patch embedding, a convolution.
_CONVS = ["model.vision_tower.embeddings.patch_embedding"]


def score_rows(r: int, llava: bool = False) -> tuple[list[list[int]], list[list[int]], list[Any]]:
    """Rank 0: image rows (Qwen2-VL: two sizes, two images in one prompt) beside a text row; rank
    1: text rows only; any other rank: none. (prompts, responses, inputs)."""
    from vlm import llava_images, llava_prompt

    if r == 0 and llava:
        xs = [llava_images(1, 1), None, llava_images(2, 3)]
        ps = [llava_prompt([5, 6], xs[0]), llava_prompt([9], None, [10, 11]), llava_prompt([5], xs[2])]
    elif r == 0:
        xs = [images((4, 6), seed=1), None, images((2, 2), (4, 4), seed=3)]
        ps = [prompt([5, 6], xs[0]), prompt([9], None, [10, 11, 12]), prompt([5], xs[2])]
    elif r == 1:
        xs, ps = [None, None], [[9, 10, 11], [4, 4]]
    else:
        return [], [], []
    rs = [[3, 4, 5, 6], [7, 8], [9, 10, 11, 12, 13]][: len(ps)]
    return ps, rs, xs


def score_equal(backend: str, gather: str, bucket_mb: float | None = None, llava: bool = False) -> dict:
    """``score(prompts, responses, inputs=)`` on every rank's rows (``score_rows``) against
    single-process HF teacher forcing; the largest logprob difference and how many times the
    vision tower ran here (a text-only rank: on its shadow image, when another rank's rows run it)."""
    from vlm import hf_scores, tiny_llava

    import shardgen

    r = dist.get_rank()
    make = tiny_llava if llava else tiny_qwen2_vl
    model, ref = make(3), make(3)
    ps, rs, xs = score_rows(r, llava)
    opts: dict[str, Any] = {"gather": gather}
    if bucket_mb is not None:
        opts["bucket_mb"] = bucket_mb
    runs = []  # the vision tower's forwards on this rank (real or shadow)
    tower = model.model.vision_tower if llava else model.model.visual
    tower.register_forward_hook(lambda *_: runs.append(1))
    diff = 0.0
    with shardgen.Engine(model, backend=backend, **opts) as eng:
        if ps:
            sb = eng.score(ps, rs, inputs=xs)
            for i, (p, resp, x) in enumerate(zip(ps, rs, xs, strict=True)):
                want = hf_scores(ref, p, resp, x)
                assert sb.mask[i].sum() == len(resp)
                diff = max(diff, (sb.logprobs[i, : len(resp)] - want).abs().max().item())
    return {"diff": diff, "tower_runs": len(runs), "policy": eng.gather_policy}


def score_without_agreement(backend: str, bucket_mb: float | None = None) -> dict:
    """``score_equal`` with the towers' agreement switched off: rank 1's text rows skip the vision
    tower's gathers that rank 0's image rows issue."""
    from shardgen.core import protocol

    protocol._AGREE_TOWERS = False
    try:
        return score_equal(backend, "per-layer", bucket_mb)
    finally:
        protocol._AGREE_TOWERS = True


SYSTEM = list(range(20, 40))  # a system prompt before every image: 20 tokens, more than a block


def prefix_cache_turns(r: int) -> list[tuple[list[int], Any]]:
    """Per rank, requests made one call after another: rank 0 an image prompt, the same system text
    and image with another question (a cached prefix through the image), the same ids with another
    image (cached only up to the image's start), a text-only row with the same system text; rank 1
    text only (a cached system prompt); any other rank none. (prompt, images or None)."""
    if r == 0:
        a, b = images((4, 6), seed=1), images((4, 6), seed=2)
        return [
            (prompt(SYSTEM, a, [7, 8, 9]), a),
            (prompt(SYSTEM, a, [7, 5, 6, 11]), a),
            (prompt(SYSTEM, b, [7, 5, 6, 11]), b),
            (SYSTEM + [7, 5, 6], None),
        ]
    if r == 1:
        return [(SYSTEM + [9, 10], None), (SYSTEM + [9, 11, 12], None)]
    return []


#: Per rank: the prompt tokens each request of ``prefix_cache_turns`` computes, and those it takes
#: from the prefix cache (the image prompt 31 tokens: 20 of system text, the image's 8, 3).
PREFIX_CACHE_COUNTS = {0: ([31, 3, 11, 3], [0, 29, 21, 20]), 1: ([22, 2], [0, 21]), 2: ([], [])}


def prefix_cache_equal(
    backend: str, gather: str = "per-layer", rank: int | None = None, max_prefill_tokens: int | None = None
) -> dict:
    """``prefix_cache_turns`` on one engine, a call per request: each completion against
    single-process HF ``generate()``, and per request the prompt tokens its prefill computed and
    those the prefix cache gave. Returns the mismatches and those counts. ``rank``: the rank's
    requests to make (the local backend's); None: this gloo rank's."""
    import shardgen

    r = dist.get_rank() if rank is None else rank
    model, ref = tiny_qwen2_vl(3), tiny_qwen2_vl(3)
    bad, computed, cached = [], [], []
    opts: dict[str, Any] = {"gather": gather, "prefix_cache_tokens": 4096}
    if max_prefill_tokens is not None:
        opts["max_prefill_tokens"] = max_prefill_tokens
    with shardgen.Engine(model, backend=backend, **opts) as eng:
        for p, x in prefix_cache_turns(r):
            before = eng.stats()
            c = eng.generate([p], inputs=[x], max_new_tokens=6, eos_token_id=EOS, pad_token_id=PAD)[0]
            after = eng.stats()
            computed.append(after["prefill_tokens"] - before["prefill_tokens"])
            cached.append(after["cached_prompt_tokens"] - before["cached_prompt_tokens"])
            want = hf_tokens(ref, p, x, 6)
            if c.token_ids != want:
                bad.append((p, c.token_ids, want))
        forwards = eng.stats()["prefill_forwards"]
    return {"bad": bad, "computed": computed, "cached": cached, "prefill_forwards": forwards}


def undeclared_inputs() -> dict:
    """FSDP2, a tiny Llama: rank 0's ``generate`` and ``score`` with ``inputs=`` (a kind with no
    named towers) raise; both ranks then generate. -> the messages (rank 0), the tokens served."""
    import torch
    from models import tiny_model

    import shardgen

    out: dict[str, Any] = {}
    with shardgen.Engine(tiny_model("llama", seed=1), backend="fsdp2") as eng:
        if dist.get_rank() == 0:
            x = {"pixel_values": torch.zeros(4, 8)}
            for what, call in (
                ("generate", lambda: eng.generate([[5, 6, 7]], inputs=[x], max_new_tokens=2)),
                ("score", lambda: eng.score([[5, 6]], [[7]], inputs=[x])),
            ):
                try:
                    call()
                    out[what] = "no error"
                except ValueError as e:
                    out[what] = str(e)
        got = eng.generate([[5, 6, 7]], max_new_tokens=3, eos_token_id=[])
        out["served"] = len(got[0].token_ids)
    return out


def _turn_reply(conv: list[int]) -> list[int]:
    """The environment's reply to a conversation: 3 ids from its last tokens (never an image id)."""
    return [3 + (sum(conv[-3:]) * (j + 5) + len(conv)) % 100 for j in range(3)]


def multi_turn_rows(r: int) -> tuple[list[list[int]], list[Any], list[int]]:
    """Rank 0: two image prompts and a text one, taking 3, 2 and 1 model turns; rank 1: text only,
    2 turns; any rank past 1 none. -> prompts, their inputs, each one's model turns."""
    if r == 0:
        a, b = images((4, 6), seed=1), images((2, 2), (4, 4), seed=2)
        return [prompt([5, 6], a), prompt([5], b), prompt([9, 10], None)], [a, b, None], [3, 2, 1]
    return ([[9, 10, 11, 12]], [None], [2]) if r == 1 else ([], [], [])


def hf_conversation(ref: Any, ids: list[int], x: Any, turns: int, max_new: int) -> list[int]:
    """Single-process HF ``generate()`` turn by turn: the response (model and environment tokens)."""
    conv = list(ids)
    for t in range(turns):
        conv += hf_tokens(ref, conv, x, max_new)
        if t + 1 < turns:
            conv += _turn_reply(conv)
    return conv[len(ids) :]


def multi_turn_images(backend: str, gather: str = "per-layer") -> dict:
    """``rollout(prompts, inputs=..., env=...)`` on Qwen2-VL (``multi_turn_rows``), greedy, against
    :func:`hf_conversation` per row; the engine's cached prompt tokens (a next turn's KV comes
    from the last one's)."""
    import shardgen

    model, ref = tiny_qwen2_vl(3), tiny_qwen2_vl(3)
    ps, xs, turns = multi_turn_rows(dist.get_rank() if dist.is_initialized() else 0)

    said: dict[int, int] = {}  # model turns per row so far

    def env(row: int, c: Any) -> list[int] | None:
        said[row] = said.get(row, 0) + 1
        return None if said[row] >= turns[row] else _turn_reply(list(c.prompt_token_ids) + list(c.token_ids))

    bad = []
    with shardgen.Engine(model, backend=backend, gather=gather, prefix_cache_tokens=4096) as eng:
        b = eng.rollout(ps, inputs=xs, env=env, max_new_tokens=4, do_sample=False, eos_token_id=EOS,
                        pad_token_id=PAD)  # fmt: skip
        stats = eng.stats()
    for i, (p, x, t) in enumerate(zip(ps, xs, turns, strict=True)):
        got = b.response_ids[i, : int(b.response_lengths[i])].tolist()
        want = hf_conversation(ref, p, x, t, 4)
        if got != want or b.turns[i] != t:
            bad.append((i, b.turns[i], got, want))
    return {"bad": bad, "cached": stats["cached_prompt_tokens"], "turns": list(b.turns or [])}
