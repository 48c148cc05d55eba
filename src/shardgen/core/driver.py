"""The driver thread of one rank: the tick loop, forwards and shadows, gathers, pauses, stats.

Three kinds of state, three homes, so that a reader sees from the class which thread
may touch a field:

- ``Shared`` (``shared.py``): what user threads and the driver exchange (inbox, open
  requests, closed, pause wanted, the first failure, pause counts, the wake event), every
  field under ``Shared.lock``;
- ``Driver``: what only the driver thread writes (the local work, the tick, the phase,
  the gathered flag, the stats, the last agreed state);
- the ``Engine`` (``engine.py``): the user-side state (config, backend, groups, futures).

The driver runs the protocol of ``protocol.py``: once per tick it agrees with the other
drivers on the control group and runs exactly one forward or none. Around it, elsewhere: its
batch and prefix cache sized before it is built (``sizing.py``), the barrier on the store that
ends a pause (``faults/resume.py``), the rank blamed for a failure or a wait that ran out
(``faults/blame.py``), and the failure path every thread takes (``shared.Failure``).
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from shardgen.backends import Backend
from shardgen.config import EngineConfig
from shardgen.core import process, sizing
from shardgen.core.policy import ForwardMode, resolve
from shardgen.core.protocol import (
    ControlPlane,
    Decision,
    Fingerprint,
    Phase,
    TickRow,
    TickState,
    check_fingerprints,
    decide,
)
from shardgen.core.shared import EngineStats, Failure, Shared
from shardgen.core.timeline import Timeline
from shardgen.errors import PeerFailedError
from shardgen.faults import blame
from shardgen.faults.liveness import Liveness
from shardgen.faults.resume import ResumeBarrier
from shardgen.faults.stalls import GatherCounter
from shardgen.generation import parking
from shardgen.generation.drafts import share_limit
from shardgen.generation.plan import ForwardPlan, Work
from shardgen.generation.requests import completion_of, resolve_future
from shardgen.generation.scheduler import LocalWork
from shardgen.numerics import invariant_numerics
from shardgen.timeouts import Timeouts

#: Idle ticks sleep at most this long while the idleness is under DEEP_IDLE_AFTER_S old, then up
#: to ``EngineConfig.idle_sleep_max`` (a burst of calls keeps its latency; a long idle its CPU).
SHALLOW_IDLE_SLEEP_S = 0.005
DEEP_IDLE_AFTER_S = 1.0
#: Idle ticks in a row for which the whole weights of ``once`` stay gathered while a multi-turn
#: call is in progress on some rank (``TickRow.turning``): at least about a second (the first
#: second's ticks sleep under SHALLOW_IDLE_SLEEP_S), so a turn's environment step does not cost
#: the next turn a gather of the whole model, and a call whose iterator was left open holds them
#: no longer than that. A count of agreed ticks, not a time: every rank releases on the same tick.
TURN_HOLD_TICKS = 200


@dataclass(frozen=True)
class DriverSetup:
    """Everything a driver is built from, made by the ``Engine`` constructor.

    ``rank`` is global; ``ranks`` the engine's group in global ranks, whose index of ``rank``
    is this rank's row in the tick. ``control``: the private gloo group of the tick (None on
    one process); ``store``, ``key_prefix``: the c10d store and this engine's keys in it (None
    on one process). ``on_failure``: the engine's failure path (``shared.Failure``), taken by the
    driver thread with its own (attributed) failure and by the liveness thread with a peer's."""

    config: EngineConfig
    backend: Backend
    shared: Shared
    rank: int
    ranks: list[int]
    device: torch.device
    hf_config: Any
    tokenizer: Any
    timeouts: Timeouts
    on_failure: Failure
    control: Any = None
    store: Any = None
    key_prefix: str = "shardgen/engine0"

    @property
    def world(self) -> int:
        return len(self.ranks)


class Driver:
    """One rank's driver thread and everything only it writes.

    Constructed in the user thread inside the collective ``Engine`` constructor (it
    resolves the gather policy there); after ``start()``, only the driver thread writes
    its fields. Other threads use the public surface below it (``spans``, ``stats_dict``,
    ``phase_word``, ``tick``, ``check_wait``, ``join``, ``teardown``), which reads snapshots.
    """

    def __init__(self, setup: DriverSetup) -> None:
        config, backend, rank, world = setup.config, setup.backend, setup.rank, setup.world
        self.backend, self.shared, self.rank, self.world = backend, setup.shared, rank, world
        self.ranks, self.device = list(setup.ranks), setup.device
        self.tokenizer, self.timeouts = setup.tokenizer, setup.timeouts
        self.on_failure = setup.on_failure
        self.config = config
        self.phase = Phase.INIT
        self.tick = 0
        self.stats = EngineStats()
        self.timeline = Timeline(config.timeline)  # (t0, t1, kind) spans; off by default
        self.last_state: TickState | None = None
        self.last_forward_t = time.monotonic()
        self.last_tick_t = time.monotonic()  # when the last tick was agreed
        self.gathered = False
        self.fp = Fingerprint()
        # Finished rollouts ride in the tick (a payload after each rank's row).
        payload = share_limit(world) if world > 1 and config.shares_rollouts else 0
        self.cp = ControlPlane(setup.control, self.ranks.index(rank), world, payload)
        self.gather_policy = resolve(config, backend, setup.hf_config, self.device, setup.control, world)
        # max_batch_size and the prefix cache's bound, where unset: from the memory budget (local)
        config, prefix = sizing.sized(config, backend, self.gather_policy, setup.hf_config, self.device)
        self.config = config
        self.mode = ForwardMode(self.gather_policy, backend, self.ranks.index(rank))
        self.work = LocalWork(
            backend.hf_model, backend, self.device, config, self.stats, on_finished=self._finished,
            on_scored=self._scored, prefix_cache_tokens=prefix,
        )  # fmt: skip
        self.work.drafts.share = payload > 0  # finished rollouts go to the other ranks to draft from
        self.thread = threading.Thread(target=self._run, name=f"shardgen-driver-r{rank}", daemon=True)
        self.live: Liveness | None = None  # heartbeats and the peers' verdicts (its own thread)
        self.gathers: GatherCounter | None = None  # how far this driver got, for the heartbeats
        if setup.store is not None and world > 1:
            self.gathers = GatherCounter(backend)
            self.live = Liveness(
                setup.store, setup.key_prefix, rank, world, setup.timeouts, self.status,
                setup.on_failure.peer, ranks=self.ranks,
            )  # fmt: skip
        self.resume: ResumeBarrier | None = None  # after each pause, before the next tick
        if setup.store is not None:
            self.resume = ResumeBarrier(
                setup.store, setup.key_prefix, rank, self.ranks, setup.timeouts.stall, self.live
            )

    # ------------------------------------------------------------------ the other threads' surface
    def spans(self) -> list[Any]:
        """The timeline's ``(t0, t1, kind)`` spans so far (a copy). Any thread."""
        return list(self.timeline.spans)

    def stats_dict(self) -> dict[str, Any]:
        """The counters, as a snapshot, and ``gather``: the mode ``auto`` resolved to. Any thread."""
        return {**self.stats.as_dict(), "gather": self.mode.word()}

    def phase_word(self) -> str:
        """What the driver is doing, as the heartbeats say it. Any thread."""
        return self.status()[1]

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the thread to end; True once it has. User thread."""
        self.thread.join(timeout)
        return not self.thread.is_alive()

    def stop_liveness(self) -> None:
        """Stop the heartbeats (a failure: no more verdicts to wait for). Any thread; idempotent."""
        if self.live is not None:
            self.live.stop()

    def teardown(self) -> None:
        """After the thread ended: liveness stopped, the process-wide state and the stall
        counter's hooks released (a user's model outlives the engine). User thread. Local."""
        self.stop_liveness()
        process.closed(self)
        if self.gathers is not None:
            self.gathers.remove()

    def start(self) -> None:
        """Start liveness (its first heartbeat) and the driver thread. User thread, once."""
        if self.live is not None:
            self.live.start()
        self.thread.start()

    def status(self) -> tuple[int, str, int, int]:
        """(tick, phase, forwards run, parameter gathers entered) for heartbeats; any thread."""
        phase = str(Phase.FAILED if self.shared.failed is not None else self.phase)
        gathers = self.gathers.count if self.gathers is not None else 0
        return self.tick, phase, self.stats.forwards + self.stats.shadow_forwards, gathers

    def check_wait(
        self,
        called: float,
        limit: float,
        col: str,
        what: str,
        never: str,
        absent_if: int = 0,
        verdict: bool = True,
    ) -> None:
        """Raise ``RendezvousTimeoutError`` naming the ranks whose column ``col`` (a ``TickRow``
        field, last tick) is ``absent_if``, once ``what`` has waited ``limit`` s with no forward
        anywhere (``faults/blame.py: check_wait``, with and without ``verdict``). User thread
        (``close()``, ``paused()``): reads snapshots."""
        st = self.last_state
        cols = st.col(col) if st is not None else []
        absent = [self.ranks[r] for r, v in enumerate(cols) if v == absent_if]  # global ranks
        seen = blame.Seen(self.last_forward_t, self.last_tick_t, str(self.phase), absent)
        blame.check_wait(
            seen, called, limit, what, never, rank=self.rank, live=self.live, timeouts=self.timeouts,
            idle_sleep_max=self.config.idle_sleep_max, verdict=verdict,
        )  # fmt: skip

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        torch.set_grad_enabled(False)  # grad mode is per thread
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        try:
            with invariant_numerics(self.config.numerics == "invariant"):  # this thread's forwards
                self._loop()
        except BaseException as e:  # every failure must reach the user threads, even if naming fails
            err = e

            def waiting() -> None:  # for liveness to name the cause of a broken collective
                self.phase = Phase.COMM_ERROR

            try:
                grace = self.timeouts.attribution_grace
                err = blame.attribute(e, lambda: self.shared.failed, self.live, grace, waiting)
                if err is e and self.live is not None and not isinstance(e, PeerFailedError):
                    self.live.report_error(e)  # our own failure: peers raise PeerFailedError naming us
            finally:
                self.phase = Phase.FAILED
                self.on_failure(err, driver=True)
                self.stop_liveness()
        else:
            if self.live is not None:
                with contextlib.suppress(Exception):  # rank 0 (the store) may already be gone
                    self.live.beat(str(Phase.CLOSED))
                self.live.stop()

    def _loop(self) -> None:
        sh, cfg, stats = self.shared, self.config, self.stats
        idle, idle_since = 0, time.monotonic()
        quiet = 0  # idle ticks in a row (agreed: the same on every rank)
        while True:
            new, closed, pause = sh.take_inbox()
            # A failed engine says nothing more in the tick; above all not "closed": a rank whose
            # block raised calls close() after its failure is set, and peers already waiting in
            # theirs would agree to it and close cleanly, never told (the failure is set first,
            # so a close taken here is always seen with it).
            if sh.failed is not None:
                raise sh.failed
            self._receive(new)
            # Partial rollouts' held rows (generation/parking.py): parked for a pause everyone asked
            # for (it then waits for the other rows only), requeued once it is not wanted or a
            # later quota call began; closing, they end.
            st = self.last_state
            if closed:
                parking.close_held(self.work)
            elif pause and st is not None and st.all_pause:
                parking.park_live(self.work)
            elif self.work.parked:
                parking.requeue(self.work)
            # One plan per outcome of the tick's admission, decided before it and carried in it.
            admitted, held = self.work.plan(True), self.work.plan(False)
            shared = self.work.drafts.outgoing(self.cp.payload) if self.cp.payload else []
            row = TickRow(
                live=self.work.live, pending=self.work.waiting, open=int(not closed), pause=int(pause),
                fingerprint=self.fp.value if cfg.debug_collectives else 0,
                tokens=admitted.tokens, head_rows=admitted.head_rows,
                held_tokens=held.tokens, held_head_rows=held.head_rows,
                towers=admitted.towers, held_towers=held.towers, shared=len(shared),
                turning=sh.turns_open(),
            )  # fmt: skip
            self.phase = Phase.TICK
            t0 = time.perf_counter()
            state = self.cp.agree(row, abort=lambda: sh.failed, shared=shared)
            if state.total("shared"):
                self._take_shared(state.payloads)
            stats.control_s += self.timeline.since(t0, "tick") - t0
            stats.ticks += 1
            self.tick += 1
            self.last_state = state
            self.last_tick_t = time.monotonic()
            if cfg.debug_collectives:
                check_fingerprints(state, self.ranks)
            decision = decide(state)
            if decision is Decision.FORWARD:
                idle = quiet = 0
                stats.forward_ticks += 1
                if self.gather_policy == "once" and not self.gathered:
                    self.phase = Phase.GATHER
                    t0 = time.perf_counter()
                    self.backend.gather_all()  # collective: every rank, this same tick
                    self.timeline.since(t0, "gather")
                    self.gathered = True
                    stats.whole_gathers += 1
                    if cfg.debug_collectives:
                        self.fp.fold("gather_all")
                self._forward_tick(state, admitted if state.admit else held)
                self.last_forward_t = time.monotonic()
            elif decision is Decision.IDLE:
                quiet += 1
                # Nobody has work: give the memory back, unless a multi-turn call waits on its
                # environment (the next turn would gather the whole model again), for a while.
                if not state.total("turning") or quiet > TURN_HOLD_TICKS:
                    self._release_if_gathered()
                stats.idle_ticks += 1
                self.phase = Phase.IDLE
                t0 = time.perf_counter()
                if idle == 0:
                    idle_since = time.monotonic()
                # Doubling from 0.5 ms: a request that arrives on any rank waits at most the
                # sleep in progress. Past the first second of idleness, up to idle_sleep_max:
                # an idle tick costs about 2 ms of CPU (most of it in gloo's network thread), so
                # an open engine with nothing to do would keep a quarter of a core busy per rank.
                cap = cfg.idle_sleep_max
                if time.monotonic() - idle_since < DEEP_IDLE_AFTER_S:
                    cap = min(cap, SHALLOW_IDLE_SLEEP_S)
                sh.wake.wait(min(cap, 0.0005 * (2**idle)))
                self.timeline.since(t0, "idle")
                sh.wake.clear()
                idle = min(idle + 1, 16)
            elif decision is Decision.PAUSE:
                self._release_if_gathered()  # a training step inside would make the copies stale
                self._drop_kept()
                t0 = time.perf_counter()
                version = self._pause_here()
                self.timeline.since(t0, "paused")
                parking.requeue(self.work, version)  # the held rows resume, re-prefilled
                idle = quiet = 0
            else:
                assert decision is Decision.EXIT
                self._release_if_gathered()  # hand the model back sharded, as it came
                self._drop_kept()
                self.backend.enter_pause()  # with the user's own setup (their groups outlive ours)
                self.phase = Phase.CLOSED
                return

    def _take_shared(self, words: list[list[int]]) -> None:
        """The other ranks' finished rollouts (``TickState.payloads``) into this rank's drafts."""
        for r, theirs in enumerate(words):
            if r != self.cp.rank and theirs:
                self.work.drafts.incoming(theirs, sender=r)
        self.stats.drafts_received = self.work.drafts.received

    def _release_if_gathered(self) -> None:
        """Back to sharded weights. Every rank calls it on the same (agreed) tick."""
        if self.gathered:
            t0 = time.perf_counter()
            self.backend.release_all()
            self.timeline.since(t0, "release")
            self.gathered = False
            if self.config.debug_collectives:
                self.fp.fold("release_all")

    def _drop_kept(self) -> None:
        """The stationary mode's kept parameters and cut rows go (a pause may change the weights;
        the next stationary forward gathers them again), and the prefix cache (KV of the weights
        before). Local; every rank on the same tick."""
        if self.backend.stationary is not None:
            self.backend.stationary.invalidate()
        self.work.forget_prefixes()

    def _forward_tick(self, state: TickState, plan: ForwardPlan) -> None:
        """Exactly one forward on this rank: ``plan`` (its prefill, chunk, refill or decode), or a
        shadow for an idle plan (protocol invariant). Collective on the parameter group while the
        backend is in ``lockstep``: every rank, this same tick, after ``agree``.

        The forward's access is decided here, from the agreed state and whether the weights are
        whole (``Backend.lockstep``, the same on every rank: gathered and released on agreed
        ticks), and goes with every rank's agreed shape and the agreed towers (each rank's forward
        runs them all, on shadow inputs where its own have none) into the plan: the backend reads
        only the plan. When forwards issue no parameter collectives (weights gathered, or the
        local backend), a rank with work runs a burst of up to ``burst_steps`` real forwards
        instead, each planned in turn, and nobody shadows: the tick then only decides admission,
        pause, release and exit.
        """
        t0 = time.perf_counter()
        lockstep = self.backend.lockstep
        access = self.mode.choose(state, whole=not lockstep)
        if lockstep:
            plan = plan.agreed(access, state.shapes(), state.towers(plan.towers))
        else:
            plan = plan.agreed(access)  # no gathers to match: no shapes, no shadow tower
        did_work = False
        t = t0
        for i in range(1 if lockstep else self.config.burst_steps):
            if not lockstep and (i or plan.kind is Work.IDLE):
                # Local forwards: nothing to agree, so each is planned when it runs.
                self._take_new()
                plan = self.work.plan(state.admit).agreed(access)
            if not self.work.step(plan):
                break
            self.phase = Phase(self.work.phase.value)
            t = self.timeline.since(t, str(self.work.phase))
            did_work = True
        if not did_work and lockstep:
            self.phase = Phase.SHADOW
            self.backend.shadow_forward(plan)
            self.timeline.since(t, "shadow")
            self.stats.shadow_forwards += 1
        if self.config.debug_collectives:
            signature = self.backend.collective_signature()  # always drained
            self.fp.fold("forward", signature if lockstep else (), str(access))
        self.stats.forward_s += time.perf_counter() - t0

    def _receive(self, new: list[Any]) -> None:
        """New requests into the work, with what they are admitted under read now: a
        ``train()``/``eval()`` switch drops the prefix cache, and the quota calls begun (rows cut
        at their budget park under the latest and go back at the next one; a quota call begins
        before it submits, so its rows park under its own number). Local: at each tick, and
        between a burst's forwards (``_take_new``)."""
        self.work.check_mode()
        self.work.add(new)
        self.work.releases = self.shared.quota_calls()

    def _take_new(self) -> None:
        """Between the local forwards of a burst: the requests submitted since the tick, so that a
        rank whose user thread submitted just after its tick row was built starts now, not after
        the peers' bursts (up to ``burst_steps`` forwards each) and another tick. Not while rows
        are parked: a quota call's held rows go back first, at the tick (``parking.requeue``).
        Local."""
        if not self.work.parked and (new := self.shared.take_requests()):
            self._receive(new)

    def _finished(self, seq: Any) -> None:
        """A request finished: resolve its future (raising, it stays open for the failure path)."""
        resolve_future(seq.tag.future, result=completion_of(seq, self.tokenizer, self.rank))

    def _scored(self, req: Any, row: Any) -> None:
        """A score row is done: resolve its future."""
        resolve_future(req.future, result=row)

    def _pause_here(self) -> int:
        """Every rank agreed to pause: no traffic until this rank's ``paused()`` block exits, and
        then none until every rank's has (``faults/resume.py``: on the store, not a collective).
        Returns the pause's number: the weights' version from now on."""
        sh = self.shared
        self.phase = Phase.PAUSED
        self.backend.enter_pause()  # the model as the user set it up, for training
        process.paused(self, True)  # and the interpreter's switch interval
        pause = sh.enter_pause()
        try:
            while not sh.wait_block_left(pause, 0.05):
                pass
        finally:
            process.paused(self, False)
        self.backend.exit_pause()  # back to the generation settings before the next tick
        if self.resume is not None:
            self.resume.wait(pause, lambda: sh.failed)  # every rank has left its block (the store)
        return pause
