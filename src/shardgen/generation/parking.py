"""Held rows of partial rollouts on one rank: parked out of the batch, requeued to resume.

A held row (``SeqState.holding``, ``generation/partial.py``) is parked when every rank asks to
pause (so the pause waits only for the other rows: a training step never waits for the longest
answer), or once it has drawn its ``budget`` of tokens since it was admitted. Parked, it is out of
the batch (the batch sees it finished and pads it, its generator's state kept) with its prompt
and tokens so far. Requeued at the front of the queue, it resumes: its prompt plus its tokens are
prefilled again under the weights of then (chunked within ``max_prefill_tokens`` like any
prompt; the prefix cache of the old weights was dropped with the pause), and it decodes on with
its own generator. Driver thread only; no collectives: parking changes what this rank's rows
are, never how many forwards it runs.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from shardgen.generation.partial import HELD
from shardgen.generation.sequence import SeqState

#: The epoch of a row parked for a pause: it goes back as soon as no pause is agreed.
FOR_PAUSE = -1


def park_spent(work: Any, batch: Any) -> None:
    """Rows of ``batch`` that drew their budget since they were admitted park until the next
    quota call (or pause). After each forward."""
    for s in batch.seqs:
        h = s.holding
        spent = h is not None and h.budget is not None and len(s.tokens) - s.admitted_at >= h.budget
        if spent and not s.finished:
            s.park()
            s.cut_in = work.releases  # the quota call it was cut in: the next one takes it back
            work.parked.append((s.tag, work.releases))


def park_live(work: Any) -> None:
    """Every rank asked to pause: the batch's held rows park. Rows of a prefill under way park
    the tick after it joins the batch (the pause waits for it: a few forwards)."""
    batch = work.batch
    if batch is None:
        return
    for s in batch.seqs:
        if s.holding is not None and not s.finished:
            s.park()
            s.cut_in = FOR_PAUSE
            work.parked.append((s.tag, FOR_PAUSE))
    if batch.done:  # held rows only were left: nothing of it is needed any more
        work.batch = None


def close_held(work: Any) -> None:
    """This rank's engine closes: its held rows end where they stand, finish reason ``"held"``
    (their futures resolved): those parked, those waiting to resume or to start, and the batch's
    (a prefill's rows the tick after they join it). No call can take held rows after ``close()``,
    so none is decoded further. Each tick while closing; no collective (the forwards are as many)."""
    park_live(work)
    ended = [req for req, _ in work.parked] + [req for req in work.pending if req.seq.holding is not None]
    work.pending = deque(req for req in work.pending if req.seq.holding is None)
    work.parked = []
    for req in ended:
        s = req.seq
        work.drafts.release(s)
        if s.finish_reason is None:
            s.finish_reason = HELD
            work.stats.generated_tokens += len(s.tokens)
            work.on_finished(s)


def _in_batch(work: Any, s: SeqState) -> bool:
    """Still a (padded) row of the batch or the prefill under way: it cannot go back yet."""
    return any(b is not None and any(x is s for x in b.seqs) for b in (work.batch, work.prefilling))


def requeue(work: Any, version: int | None = None) -> None:
    """Parked rows back at the front of the queue, resumed, in the order they parked: those parked
    for a pause, and those parked for their budget in a quota call before the latest one the
    driver has seen (``work.releases``). A row
    still inside the batch waits for the batch to drop it (a later tick). ``version``: a pause
    just ended (the weights' new version): every parked row goes back, and held rows, parked or
    waiting, past their ``max_staleness`` finish as ``"stale"`` instead."""
    if version is not None:
        work.version = version
    back, kept = [], []
    for req, epoch in work.parked:
        due = version is not None or epoch == FOR_PAUSE or epoch < work.releases
        (back if due and not _in_batch(work, req.seq) else kept).append((req, epoch))
    work.parked = kept
    for req, _ in back:
        req.seq.resume()
    work.pending.extendleft(req for req, _ in reversed(back))
    if version is None:
        return
    waiting: deque[Any] = deque()
    for req in work.pending:
        s = req.seq
        h = s.holding
        if h is not None and h.max_staleness is not None and version - h.born > h.max_staleness:
            s.finish_reason = "stale"  # cut where it stood: its tokens so far are all of the old weights
            work.drafts.release(s)
            work.stats.generated_tokens += len(s.tokens)
            work.on_finished(s)
        else:
            waiting.append(req)
    work.pending = waiting
