"""A driver that raises at each point a request can be in: every waiting call must raise.

Run in-process by tests/multirank/test_failure_paths.py (one process, backend ``local``) and on the
2-rank World (``local`` at 2 ranks). ``fail_at(point)``
builds an engine, replaces the function at ``point`` by one that raises ``Injected`` (on the
raising ranks), starts every call that can reach the point in a thread of its own while the
engine is paused (so that their requests reach the driver together), and reports how each
call ended within ``BOUND`` s: a regression fails the test instead of hanging it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from models import tiny_model

import shardgen
from shardgen.core import driver
from shardgen.generation import batch, scheduler, score_run

BOUND = 20.0  # s for every call to end once the pause is left (they end in well under a second)
PROMPTS = [[5, 6, 7], [8, 9, 10, 11]]
NO_EOS = {"max_new_tokens": 4, "eos_token_id": []}  # no row ends before the step the point is at


class Injected(RuntimeError):
    """The failure a test puts into the driver."""


class IdsOnly:
    """A tokenizer that is only its two ids, no ``decode`` (as DeepSpeed's rollout tests pass)."""

    eos_token_id, pad_token_id = 2, 0


def _turn_two(_self: Any, reqs: list[Any]) -> bool:
    """A multi-turn row's second turn reaches the driver (its prompt holds the first answer)."""
    return any(len(getattr(getattr(r, "seq", None), "prompt_ids", ())) > 4 for r in reqs)


# point -> (owner, name, the calls that reach it, when the replacement raises: always, or a test
# of its arguments, or the number of calls it lets through first)
GENERATE = ["generate", "submit", "rollout", "rollout_iter", "turns"]
POINTS: dict[str, tuple[Any, str, list[str], Any]] = {
    "queued": (scheduler.LocalWork, "add", [*GENERATE, "score"], lambda _s, reqs: bool(reqs)),
    "admitted": (scheduler.LocalWork, "_start", GENERATE, None),
    "prefilling": (batch.Batch, "prefill_step", GENERATE, None),
    "scoring": (score_run.ScoreRun, "step", [*GENERATE, "score"], None),  # prefills go first
    "scored": (score_run.ScoreRun, "results", [*GENERATE, "score"], None),
    "decoding": (batch.Batch, "step", GENERATE, None),
    "finishing": (driver, "completion_of", GENERATE, None),
    "next turn": (scheduler.LocalWork, "add", ["turns"], _turn_two),
    "later group": (driver, "completion_of", ["rollout_iter"], 1),  # one group yielded first
}
REQUESTS = {"generate": 2, "submit": 1, "rollout": 2, "rollout_iter": 2, "turns": 1, "score": 1}


def _calls(eng: Any, out: dict[str, Any]) -> dict[str, Callable[[], Any]]:
    def rollout_iter() -> None:
        out["groups"] = []
        for i, _ in eng.rollout_iter(PROMPTS, **NO_EOS):
            out["groups"].append(i)

    return {
        "generate": lambda: eng.generate(PROMPTS, **NO_EOS),
        "submit": lambda: eng.submit(PROMPTS[0], **NO_EOS).result(),
        "rollout": lambda: eng.rollout(PROMPTS[:1], n=2, **NO_EOS),
        "rollout_iter": rollout_iter,
        "turns": lambda: eng.rollout(PROMPTS[:1], env=lambda _r, _c: [12, 13], max_turns=3, **NO_EOS),
        "score": lambda: eng.score(PROMPTS[:1], [[12, 13, 14]]),
    }


def _raising(real: Any, when: Any) -> Any:
    count = [0]

    def replacement(*args: Any, **kwargs: Any) -> Any:
        if isinstance(when, int):
            count[0] += 1
            fire = count[0] > when
        else:
            fire = when is None or when(*args, **kwargs)
        if fire:
            raise Injected("injected failure")
        return real(*args, **kwargs)

    return replacement


def fail_at(point: str, raising_ranks: tuple[int, ...] = (0,)) -> dict[str, Any]:
    """Each call that can reach ``point`` -> how it ended: ``raised <type>``, ``returned`` or
    ``hung``; ``groups`` -> the groups ``rollout_iter`` yielded before it raised."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    owner, name, names, when = POINTS[point]
    eng = shardgen.Engine(tiny_model("llama", seed=7), IdsOnly(), backend="local", max_batch_size=16)
    real = getattr(owner, name)
    if rank in raising_ranks:
        setattr(owner, name, _raising(real, when))
    out: dict[str, Any] = {}
    threads = []
    try:
        calls = _calls(eng, out)
        with eng.paused():  # every call's requests reach the driver in one tick
            for call in names:
                threads.append(threading.Thread(target=_run, args=(calls[call], call, out), daemon=True))
                threads[-1].start()
            deadline = time.monotonic() + BOUND
            want = sum(REQUESTS[c] for c in names)
            while len(eng._shared.inbox) < want and time.monotonic() < deadline:
                time.sleep(0.005)
        deadline = time.monotonic() + BOUND
        for t, call in zip(threads, names, strict=True):
            t.join(max(0.0, deadline - time.monotonic()))
            out.setdefault(call, "hung")
    finally:
        setattr(owner, name, real)
        eng._driver.thread.join(BOUND)
        eng._teardown()
    return out


def _run(call: Callable[[], Any], name: str, out: dict[str, Any]) -> None:
    try:
        call()
    except BaseException as e:  # what the waiting call raised is the result
        out[name] = f"raised {type(e).__name__}: {e}"
    else:
        out[name] = "returned"


def fail_at_each(points: list[str], raising_ranks: tuple[int, ...]) -> dict[str, dict[str, Any]]:
    """``fail_at`` for each point in turn, one engine each (one World call for them all)."""
    return {point: fail_at(point, raising_ranks) for point in points}
