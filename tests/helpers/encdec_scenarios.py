"""Scenarios for tests/multirank/test_encdec.py (they run inside gloo ranks of a World): tiny T5 / BART
(``encdec_models.py``) generating on ranks whose requests start at different times, in uneven
numbers, and on a rank holding none."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch.distributed as dist
from encdec_models import features, hf_teacher, hf_tokens, hf_whisper, tiny, tiny_scored, tiny_whisper

# Per rank: its calls, each a list of (prompt ids, max_new_tokens) and how long the rank waits
# before it. Every rank's first call is submitted inside ``paused()``, so that the first tick
# after it finds them all. Rank 0 decodes a batch of mixed encoder lengths whose rows end at
# different steps: at 2 rows, its refills start new encoders while rank 1 decodes its first
# request; rank 1's later calls start while rank 0 decodes, then after a wait, in more calls
# than rank 0's; rank 2 (at 3 ranks) holds none.
_CALLS: dict[int, list[tuple[float, list[tuple[list[int], int]]]]] = {
    0: [(0.0, [([5, 6, 7, 8, 9], 4), ([10, 11], 10), ([3, 4, 5, 6, 7, 8, 9, 10, 11, 12], 6), ([20], 8)])],
    1: [(0.0, [([30, 31, 32], 12)]), (0.0, [([40, 41, 42, 43], 7), ([7, 8], 3)]), (0.2, [([9] * 6, 4)])],
    2: [],
}


def encdec_equal(
    kind: str,
    backend: str,
    gather: str,
    max_batch_size: int | None = 2,
    bucket_mb: float | None = None,
    **extra: Any,
) -> dict:
    """Every rank's calls (``_CALLS``) on one engine over a ``kind`` model; each completion against
    single-process HF ``generate()`` on an unsharded copy. The mismatches and what the engine
    counted. ``bucket_mb`` (DeepSpeed): small, each unit a bucket of its own (the tiny model's
    units otherwise fit one bucket, gathered whole at the first unit either rank calls); ``extra``:
    more engine settings."""
    import shardgen

    r = dist.get_rank()
    model, ref = tiny(kind), tiny(kind)
    opts: dict[str, Any] = {"gather": gather, **extra}
    if max_batch_size:
        opts["max_batch_size"] = max_batch_size
    if bucket_mb is not None:
        opts["bucket_mb"] = bucket_mb
    bad = []
    calls = _CALLS.get(r, [])
    with shardgen.Engine(model, backend=backend, **opts) as eng:
        with eng.paused():  # the first calls reach every driver in one tick
            first = [eng.submit(p, max_new_tokens=n) for p, n in calls[0][1]] if calls else []
        for k, (wait, call) in enumerate(calls):
            time.sleep(wait)
            futs = first if k == 0 else [eng.submit(p, max_new_tokens=n) for p, n in call]
            for j, ((p, n), f) in enumerate(zip(call, futs, strict=True)):
                got, want = f.result(timeout=120).token_ids, hf_tokens(ref, p, n)
                if got != want:
                    bad.append((k, j, got, want))
    stats = eng.stats()  # after close: every rank's work done
    st = eng.backend.stationary
    return {"bad": bad, "shadows": stats["shadow_forwards"], "refills": stats["refills"],
            "policy": eng.gather_policy, "forwards": stats["forwards"] + stats["shadow_forwards"],
            "stationary": stationary_stats(st)}  # fmt: skip


def stationary_stats(st: Any) -> dict | None:
    """What the weight-stationary mode ran (None: not built): its forwards, its exchanges sized at
    the call (a tower's, the cross-attention's), and which modules fall back (gathered per call)."""
    if st is None:
        return None
    d = st.layout.describe()
    return {"forwards": st.forwards, "free_exchanges": st.free_exchanges, "fallbacks": sorted(d["fallbacks"]),
            "free": d["free"], "gated": d["gated"]}  # fmt: skip


# Per rank: score rows (prompt, response); rank 0 more, in runs of 2 rows (3 forwards), rank 1
# one row after its generation.
_SCORE_ROWS: dict[int, list[tuple[list[int], list[int]]]] = {
    0: [([5, 6, 7, 8, 9], [7, 8, 9]), ([10, 11], [3]), (list(range(3, 13)), [4, 5, 6, 7, 8, 9, 10]),
        ([20], [11, 12]), ([30, 31, 32], [2, 13])],
    1: [([40, 41, 42, 43], [9, 10, 11, 12, 13])],
}  # fmt: skip


def encdec_score(kind: str, backend: str, gather: str, bucket_mb: float | None = None) -> dict:
    """``score()`` on an encoder-decoder, the ranks' forwards apart: rank 0's score runs (each its
    encoder inside the one forward) meet rank 1's decode steps of a request submitted in the same
    ``paused()`` block, then rank 1 scores one row while rank 0 idles (its shadows run the
    encoder). Each row against single-process HF teacher forcing, the tokens against HF
    ``generate()``: the largest score difference, the token mismatches, the counts."""
    import shardgen

    r = dist.get_rank()
    model, ref = tiny_scored(kind), tiny_scored(kind)
    opts: dict[str, Any] = {"gather": gather, "max_batch_size": 2}
    if bucket_mb is not None:
        opts["bucket_mb"] = bucket_mb
    rows = _SCORE_ROWS.get(r, [])
    ps, rs = [p for p, _ in rows], [x for _, x in rows]
    got: dict[str, Any] = {}
    bad = []
    with shardgen.Engine(model, backend=backend, **opts) as eng:
        with eng.paused():  # the first calls reach every driver in one tick
            if r == 0:
                t = threading.Thread(target=lambda: got.update(sb=eng.score(ps, rs, top_k=2)))
                t.start()
                while not eng._shared.open_reqs:  # the rows queued before the pause ends
                    time.sleep(0.01)
            gen = eng.submit([30, 31, 32], max_new_tokens=10) if r == 1 else None
        if gen is not None:
            if gen.result(timeout=120).token_ids != hf_tokens(ref, [30, 31, 32], 10):
                bad.append("generate")
            got["sb"] = eng.score(ps, rs, top_k=2)
        elif r == 0:
            t.join(timeout=120)
    stats = eng.stats()
    diff = 0.0
    if rows:
        from score_scenarios import worst

        diff = worst(got["sb"], hf_teacher(ref, ps, rs, top_k=2), top_k=2)
    return {"diff": diff, "bad": bad, "shadows": stats["shadow_forwards"], "policy": eng.gather_policy,
            "forwards": stats["prefill_forwards"]}  # fmt: skip


def without_agreement(kind: str, backend: str, bucket_mb: float | None = None) -> str:
    """The towers' agreement switched off: a rank's forward that starts a request runs the
    encoder's gathers, its peer's decode step (or shadow) does not: they never match."""
    from shardgen.core import protocol

    protocol._AGREE_TOWERS = False
    try:
        return encdec_equal(kind, backend, "per-layer", bucket_mb=bucket_mb)["policy"]
    finally:
        protocol._AGREE_TOWERS = True


def encdec_from_pretrained(kind: str, backend: str, path: str) -> list:
    """``Engine.from_pretrained`` on a saved ``kind`` checkpoint, rank 0 with two requests, rank 1
    with one started later: the mismatches to HF."""
    import shardgen

    ref = type(tiny(kind)).from_pretrained(path).eval()  # HF's own load (Marian: positions made)
    calls = {0: [([5, 6, 7], 6), ([9, 10, 11, 12], 8)], 1: [([20, 21], 5)]}.get(dist.get_rank(), [])
    if dist.get_rank() == 1:
        time.sleep(0.2)
    with shardgen.Engine.from_pretrained(path, backend=backend) as eng:
        got = [eng.submit(p, max_new_tokens=n) for p, n in calls]
        got = [f.result(timeout=120).token_ids for f in got]
    want = [hf_tokens(ref, p, n) for p, n in calls]
    return [(g, w) for g, w in zip(got, want, strict=True) if g != w]


# Per rank: Whisper score rows (decoder prefix, response, the features' seed); rank 1 fewer.
_WHISPER_ROWS: dict[int, list[tuple[list[int], list[int], int]]] = {
    0: [([1, 5, 6], [7, 8, 9], 0), ([1], [3, 4], 1), ([1, 7], [10], 2), ([1, 8, 9, 10], [11, 12], 3)],
    1: [([1, 4], [5, 6, 7, 8], 4)],
}


def whisper_score(backend: str, gather: str, bucket_mb: float | None = None) -> dict:
    """``score(..., inputs=[{"input_features": ...}])`` on a Whisper: rank 0 scores 4 rows in runs
    of 2 (its encoder in each forward), rank 1 one row after a wait (its shadows run the encoder
    on zero features meanwhile). Each row against single-process HF teacher forcing: the largest
    difference and the counts."""
    from score_scenarios import worst

    import shardgen

    r = dist.get_rank()
    model, ref = tiny_whisper(), tiny_whisper()
    opts: dict[str, Any] = {"gather": gather, "max_batch_size": 2}
    if bucket_mb is not None:
        opts["bucket_mb"] = bucket_mb
    rows = _WHISPER_ROWS.get(r, [])
    ps, rs, xs = [p for p, _, _ in rows], [x for _, x, _ in rows], [features(k) for _, _, k in rows]
    diff = 0.0
    with shardgen.Engine(model, backend=backend, **opts) as eng:
        if r == 1:
            time.sleep(0.2)
        if rows:
            diff = worst(eng.score(ps, rs, inputs=xs), hf_whisper(ref, ps, rs, xs))
    stats = eng.stats()
    return {"diff": diff, "shadows": stats["shadow_forwards"], "forwards": stats["prefill_forwards"],
            "policy": eng.gather_policy}  # fmt: skip


def score_without_agreement(kind: str, backend: str, bucket_mb: float | None = None) -> dict:
    """``encdec_score`` with the towers' agreement switched off: rank 0's score forwards run the
    encoder's gathers, rank 1's decode steps do not."""
    from shardgen.core import protocol

    protocol._AGREE_TOWERS = False
    try:
        return encdec_score(kind, backend, "per-layer", bucket_mb)
    finally:
        protocol._AGREE_TOWERS = True


def whisper_from_pretrained(backend: str, path: str) -> float:
    """``Engine.from_pretrained`` on a saved Whisper, rank 0 scoring two rows, rank 1 one: the
    largest difference to HF teacher forcing."""
    from score_scenarios import worst

    import shardgen

    ref = tiny_whisper()
    rows = {0: [([1, 5, 6], [7, 8], 0), ([1], [3, 4, 5], 1)], 1: [([1, 9], [10], 2)]}[dist.get_rank()]
    ps, rs, xs = [p for p, _, _ in rows], [x for _, x, _ in rows], [features(k) for _, _, k in rows]
    with shardgen.Engine.from_pretrained(path, backend=backend) as eng:
        sb = eng.score(ps, rs, inputs=xs)
    return worst(sb, hf_whisper(ref, ps, rs, xs))
