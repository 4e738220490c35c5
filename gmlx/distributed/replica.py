"""The engine as a replicated state machine: every rank runs the same engine over its shard.

Rank 0 (the leader) owns the real queue, the streams and the engine thread. Every step, it takes
a snapshot of its inputs (the requests submitted and the streams cancelled since the last step),
and from then on it reads only the snapshot, never the live queue: the step admits rows up to the
snapshot's newest rid and reaps only the snapshot's cancellations, so a submit or cancel() landing
mid-step waits for the next one. Once it has reaped and decided its plan, it sends the snapshot,
the cap decision and the plan in one exchange (gmlx/distributed/channel.py). A follower receives
that message before its own step, queues the same rows under the same rids, reaps the same
cancellations, decides its own plan, and checks it equals rank 0's. Tokens are never sent: each
rank samples them itself, and the rolling checksum of emitted tokens and plans, compared at
every exchange, proves they agree.

Any exception inside a step is fatal to the rank (gmlx/distributed/channel.py:fatal): after it
the ranks cannot be known to hold the same state.
"""

from __future__ import annotations

import threading
import time

import mlx.core as mx

from gmlx.distributed import messages
from gmlx.distributed.channel import fatal, fold
from gmlx.distributed.watchdog import HEARTBEAT_S, IDLE_NAP_AFTER_S, IDLE_NAP_S
from gmlx.engine.engine import Engine
from gmlx.engine.intake import make_row
from gmlx.row import Row
from gmlx.engine.service import Service
from gmlx.engine.stream import Stream
from gmlx.errors import EngineBusy, EngineClosed, InvalidRequest, LaunchError, ReplicaDivergence
from gmlx.finish import FinishReason
from gmlx.policy import admission
from gmlx.policy.admission import Mode, Plan, Round

_FINISH = {None: 0, FinishReason.LENGTH: 1, FinishReason.STOP: 2, FinishReason.CANCELLED: 3, FinishReason.ERROR: 4}


class ReplicaService(Service):
    """The service whose every step reads a snapshot of its inputs: taken from the live queue on
    rank 0, received from rank 0 on the others."""

    def __init__(self, core, max_queued: int, speculative: bool, leader: bool):
        super().__init__(core, max_queued, speculative)
        self.leader = leader
        self._horizon = -1  # the newest rid this step may admit
        self._cancelled: frozenset[int] = frozenset()  # this step's cancellations
        self._new: list[Row] = []  # rank 0: the rows first seen in this step's snapshot
        self._scan = False  # rank 0: a cancel() arrived that no snapshot has looked at yet

    # ---- rank 0: the inputs ------------------------------------------------------------
    def submit(self, row: Row, start: bool = True) -> Stream:
        if row.params.stop_fn is not None:
            raise InvalidRequest("stop_fn runs only on rank 0 and cannot be replicated; it is not supported"
                                 " with --distributed (use stop strings)")
        return super().submit(row, start)

    def _note_cancel(self) -> None:
        super()._note_cancel()
        self._scan = True

    def begin_step(self) -> None:
        super().begin_step()
        if not self.leader:
            return
        with self._lock:
            self._new = [r for r in self._queue if r.rid > self._horizon]
            if self._new:
                self._horizon = self._new[-1].rid
            if self._scan:
                self._scan = False
                gone = {rid for rid, s in self._streams.items() if s.cancelled}
                self._scan = any(rid > self._horizon for rid in gone)  # not yet sent: a later step reaps it
                self._cancelled = frozenset(rid for rid in gone if rid <= self._horizon)
            else:
                self._cancelled = frozenset()

    def inputs(self) -> dict:
        """This step's snapshot, for the message to the other ranks."""
        return {"new": [[r.rid, r.prompt, messages.encode_params(r.params)] for r in self._new],
                "c": sorted(self._cancelled), "h": self._horizon}

    # ---- the other ranks: the same inputs, received --------------------------------------
    def apply(self, msg: dict) -> None:
        lm = self.core.lm
        with self._lock:
            for rid, prompt, params in msg["new"]:
                row = make_row(lm, prompt, messages.decode_params(params))
                row.rid = rid
                self._streams[rid] = Stream(rid, row.seed, on_cancel=self._note_cancel)
                self._queue.append(row)
        self._horizon = msg["h"]
        self._cancelled = frozenset(msg["c"])

    # ---- what the engine reads: the snapshot, never the live queue ------------------------
    @property
    def queued(self) -> int:
        with self._lock:
            return sum(1 for r in self._queue if r.rid <= self._horizon)

    def cancel_requested(self) -> bool:
        return bool(self._cancelled)

    def pop_cancelled(self) -> list[Row]:
        with self._lock:
            gone = [r for r in self._queue if r.rid in self._cancelled]
            for r in gone:
                self._queue.remove(r)
        return gone

    def cancelled(self, row: Row) -> bool:
        return row.rid in self._cancelled

    def finish(self, row: Row, error: str | None = None) -> None:
        stream = self._streams.get(row.rid)
        super().finish(row, error)
        listener = self.core.cluster.on_replica_finish
        if not self.leader and listener is not None and stream is not None:
            listener(self.core.sid, stream.result)  # tests compare what every rank emitted

    # ---- rank 0's engine thread: beats while idle ------------------------------------------
    def _run(self) -> None:
        """As Service._run, but an idle engine still steps every HEARTBEAT_S: the empty step's
        exchange tells the other ranks that rank 0 is alive (their watchdog bounds the wait)."""
        try:
            while True:
                with self._lock:
                    if not self._closed and not self._queue and not self.core.busy:
                        self._lock.wait(HEARTBEAT_S)
                    if self._closed:
                        return
                try:
                    self.core.advance()
                except EngineClosed:
                    return
        finally:
            mx.synchronize()
            mx.clear_streams()


class ReplicaEngine(Engine):
    """An engine that steps in lockstep with the same engine on every other rank. Build it
    through `Cluster.engine()` (rank 0) or `Cluster.follow()` (the others)."""

    def __init__(self, lm, config=None, *, switches=None, cluster, sid: int):
        super().__init__(lm, config, switches=switches)
        if self.drafter is not None and self.drafter.kind == "assistant":
            raise LaunchError("the assistant drafter reads the target's K/V cache, which --distributed splits"
                              " across ranks; use --drafter mtp or --draft-model PATH")
        self.cluster, self.channel, self.sid = cluster, cluster.channel, sid
        self.service = ReplicaService(self, self.config.max_queued, self.speculative, cluster.channel.leader)
        self.steps = 0
        self.checksum = 0
        self._msg: dict | None = None
        self._sent_caps = None
        self._leader_caps = None
        self._close_sent = False
        self._idle_since: float | None = None  # rank 0: when its engine last went idle
        self._lock = threading.Lock()

    def _measure_round_costs(self) -> None:
        """Not alone: the probe's forwards all_sum across ranks (`agree_round_costs`)."""

    def agree_round_costs(self) -> None:
        """Every rank, once every rank has this engine: measure the round costs together (the same
        forwards, so their all_sums pair up); rank 0 then sends its figures, which every rank
        decides with (measured apart, a lone request could go plain on one rank only)."""
        if not (self.speculative and self.scalar.may_go_plain):
            return
        measured = self.scalar.round_costs()
        if self.channel.leader:
            self.cluster.send(messages.costs(self.sid, measured), f"sharing engine {self.sid}'s round costs")

    def follow_costs(self, msg: dict) -> None:
        if msg["sid"] != self.sid:
            fatal(f"distributed: rank {self.channel.rank} has engine {self.sid}, but rank 0 sent the round costs of"
                  f" engine {msg['sid']}; this is a bug: please report it")
        self.scalar.costs = messages.costs_of(msg)

    @property
    def position(self) -> tuple[int, int, int]:
        return (self.sid, self.steps, self.checksum)

    # ---- the step, on every rank --------------------------------------------------------
    def _step(self, want_events: bool):
        n = self.steps + 1
        self.cluster.watchdog.arm(f"in step {n} of engine {self.sid}")
        try:
            events = super()._step(want_events)
        except (EngineClosed, EngineBusy):  # refused before anything changed (rank 0 only)
            self.cluster.watchdog.disarm()
            raise
        except Exception as e:  # noqa: BLE001 - whatever it was, the ranks may now differ
            fatal(self.cluster.describe(e, f"in step {n} of engine {self.sid}"))
        self.steps = n
        self.channel.position = self.position
        if self.channel.leader:
            self.cluster.watchdog.disarm()
        return events

    def _decide(self, view: admission.View) -> Plan:
        plan = super()._decide(view)
        if self.channel.leader:
            msg = {"k": messages.STEP, "sid": self.sid, "n": self.steps + 1, **self.service.inputs(),
                   "p": messages.encode_plan(plan)}
            if self.caps.current is not self._sent_caps:
                msg["cap"] = messages.encode_caps(self.caps.current)
                self._sent_caps = self.caps.current
            if self._idle_for(view, plan) >= IDLE_NAP_AFTER_S:
                msg["nap"] = IDLE_NAP_S
            self.channel.exchange(msg)
        elif messages.encode_plan(plan) != self._msg["p"]:
            raise ReplicaDivergence(f"rank {self.channel.rank} diverged from rank 0 at step {self.steps + 1} of engine"
                                    f" {self.sid}: rank 0 planned {self._msg['p']}, this rank"
                                    f" {messages.encode_plan(plan)}; this is a bug: please report it")
        self.checksum = fold(self.checksum, messages.plan_digest(plan))
        return plan

    def _idle_for(self, view: admission.View, plan: Plan) -> float:
        """How long rank 0's engine has had nothing to do (0 while it has work)."""
        now = time.monotonic()
        if view.mode is not Mode.IDLE or view.queued or plan.round is not Round.NONE:
            self._idle_since = None
            return 0.0
        if self._idle_since is None:
            self._idle_since = now
        return now - self._idle_since

    def _refresh_caps(self):
        if self.channel.leader:
            return super()._refresh_caps()
        if self._leader_caps is not None:  # rank 0's decision: its env and user config rule (K per width too)
            self.caps.current = self._leader_caps
        return self.caps.current

    def _deliver(self, row: Row, res, now: float) -> tuple:
        lost = self.channel.lost_peer
        if lost is not None and not self.channel.closed:  # this round's all_sums may have lacked its part
            fatal(f"distributed: rank {self.channel.rank}: rank {lost}'s process ended during step {self.steps + 1} of"
                  f" engine {self.sid}; its own output names why")
        before = len(row.tokens)
        out = super()._deliver(row, res, now)
        self.checksum = fold(self.checksum, row.rid, *row.tokens[before:], _FINISH.get(row.finish_reason, 5))
        return out

    # ---- the other ranks -----------------------------------------------------------------
    def follow(self, msg: dict) -> None:
        """Run the step rank 0 just announced."""
        if msg["sid"] != self.sid or msg["n"] != self.steps + 1:
            fatal(f"distributed: rank {self.channel.rank} is at step {self.steps} of engine {self.sid}, but rank 0"
                  f" sent step {msg['n']} of engine {msg['sid']}; this is a bug: please report it")
        self._msg = msg
        if "cap" in msg:
            self._leader_caps = messages.decode_caps(msg["cap"])
        self.service.apply(msg)
        self._step(want_events=False)

    # ---- closing (rank 0 tells the others) -----------------------------------------------
    def close(self) -> None:
        super().close()
        with self._lock:
            send = self.channel.leader and not self._close_sent and not self.channel.closed
            self._close_sent = True
        if send:
            self.cluster.send({"k": messages.CLOSE, "sid": self.sid}, f"closing engine {self.sid}")
