"""The engine as a replicated state machine: every rank runs the same engine over its shard.

A `Replica` is one rank's side of one engine: the engine's peers (gmlx/engine/peers.py). Rank 0
(the leader) owns the real queue, the streams and the engine thread. Each step reads a snapshot
of its inputs (the requests submitted and the streams cancelled since the last step), and from
then on only the snapshot, never the live queue (gmlx/engine/service.py). Once rank 0 has
decided its plan, it sends the new requests, the cancellations, the cap decision and the plan in
one exchange (gmlx/distributed/channel.py). Another rank receives that message before its own
step, queues the same requests under the same ids, steps from rank 0's inputs and cap decision,
and checks its plan equals rank 0's. Tokens are never sent: each rank samples them itself, and
the rolling checksum of emitted tokens and plans, compared at every exchange, proves they agree.

Any exception inside a step is fatal to the rank (gmlx/distributed/channel.py:fatal): after it
the ranks cannot be known to hold the same state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from typing import Callable, Iterator

from gmlx.config import EngineConfig
from gmlx.distributed import messages
from gmlx.distributed.channel import fatal, fold
from gmlx.distributed.watchdog import HEARTBEAT_S, IDLE_NAP_AFTER_S, IDLE_NAP_S
from gmlx.engine.engine import Engine
from gmlx.engine.intake import make_row
from gmlx.engine.peers import Inputs
from gmlx.engine.stream import Stream
from gmlx.errors import EngineBusy, EngineClosed, InvalidRequest, LaunchError, ReplicaDivergence
from gmlx.finish import FinishReason
from gmlx.policy.admission import Plan, Round
from gmlx.row import Row

_FINISH = {None: 0, FinishReason.LENGTH: 1, FinishReason.STOP: 2, FinishReason.CANCELLED: 3, FinishReason.ERROR: 4}


class Replica:
    """One rank's side of an engine that steps in lockstep with the same engine on every other
    rank (the engine's `peers`). Build it through `Cluster.engine()` (rank 0) or
    `Cluster.follow()` (the others)."""

    measures_alone = False  # the probe's forwards all_sum across ranks: `agree_round_costs`, together

    def __init__(self, lm, config=None, *, switches=None, cluster, sid: int):
        self.cluster, self.channel, self.sid = cluster, cluster.channel, sid
        self.leader = cluster.channel.leader
        # rank 0's idle engine thread still steps: the empty step's exchange tells the others it is alive
        self.heartbeat_s = HEARTBEAT_S if self.leader else None
        self.steps = 0
        self.checksum = 0
        self._msg: dict | None = None  # another rank: rank 0's message for the step it runs now
        self._sent_caps = None
        self._close_sent = False
        self._idle_since: float | None = None  # rank 0: when its engine last went idle
        self._streams: list[Stream] = []  # another rank: its copies' streams, until they finish
        self._lock = threading.Lock()
        config = config or EngineConfig()
        if (config.drafter is None and config.draft_model is None and lm.default_drafter == "assistant"
                and lm.head is not None):
            # The model's default (the embedded model's assistant) reads the target's K/V, which
            # --distributed splits: its MTP head drafts instead, as the user asked for no kind.
            config = dataclasses.replace(config, drafter="mtp")
        self.engine = Engine(lm, config, switches=switches, peers=self)
        self._leader_caps = self.engine.cap_in_force  # another rank: rank 0's decision, once it sends one
        if self.engine.drafter is not None and self.engine.drafter.kind == "assistant":
            raise LaunchError("the assistant drafter reads the target's K/V cache, which --distributed splits"
                              " across ranks; use --drafter mtp or --draft-model PATH")

    @property
    def position(self) -> tuple[int, int, int]:
        return (self.sid, self.steps, self.checksum)

    def agree_round_costs(self) -> None:
        """Every rank, once every rank has this engine: measure the round costs together (the same
        forwards, so their all_sums pair up); rank 0 then sends its figures, which every rank
        decides with (measured apart, a lone request could go plain on one rank only)."""
        measured = self.engine.measure_round_costs()
        if measured is not None and self.leader:
            self.cluster.send(messages.costs(self.sid, measured), f"sharing engine {self.sid}'s round costs")

    def follow_costs(self, msg: dict) -> None:
        if msg["sid"] != self.sid:
            fatal(f"distributed: rank {self.channel.rank} has engine {self.sid}, but rank 0 sent the round costs of"
                  f" engine {msg['sid']}; this is a bug: please report it")
        self.engine.scalar.costs = messages.costs_of(msg)

    # ---- the engine's peers (gmlx/engine/peers.py), on every rank ------------------------
    def accept(self, row: Row) -> None:
        if row.params.stop_fn is not None:
            raise InvalidRequest("stop_fn runs only on rank 0 and cannot be replicated; it is not supported"
                                 " with --distributed (use stop strings)")

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        n = self.steps + 1
        self.cluster.watchdog.arm(f"in step {n} of engine {self.sid}")
        try:
            yield
        except (EngineClosed, EngineBusy):  # refused before anything changed (rank 0 only)
            self.cluster.watchdog.disarm()
            raise
        except Exception as e:  # noqa: BLE001 - whatever it was, the ranks may now differ
            fatal(self.cluster.describe(e, f"in step {n} of engine {self.sid}"))
        self.steps = n
        self.channel.position = self.position
        if self.leader:
            self.cluster.watchdog.disarm()

    def agree(self, take: Callable[[], Inputs], decide: Callable[[Inputs], Plan]) -> Plan:
        if self.leader:
            inputs = take()
            plan = decide(inputs)
            self.channel.exchange(self._message(inputs, plan))
        else:
            msg = self._msg
            plan = decide(Inputs((), msg["h"], frozenset(msg["c"]), self._leader_caps))
            if messages.encode_plan(plan) != msg["p"]:
                raise ReplicaDivergence(f"rank {self.channel.rank} diverged from rank 0 at step {self.steps + 1} of"
                                        f" engine {self.sid}: rank 0 planned {msg['p']}, this rank"
                                        f" {messages.encode_plan(plan)}; this is a bug: please report it")
        self.checksum = fold(self.checksum, messages.plan_digest(plan))
        return plan

    def emitted(self, row: Row, tokens: list[int]) -> None:
        lost = self.channel.lost_peer
        if lost is not None and not self.channel.closed:  # this round's all_sums may have lacked its part
            fatal(f"distributed: rank {self.channel.rank}: rank {lost}'s process ended during step {self.steps + 1} of"
                  f" engine {self.sid}; its own output names why")
        self.checksum = fold(self.checksum, row.rid, *tokens, _FINISH.get(row.finish_reason, 5))

    def closed(self) -> None:
        """Rank 0 tells the other ranks (once) that its engine closed. A second close() (serve
        closes on a signal's thread and again as it returns) waits until the message is out, so
        nothing the caller exchanges next (the run's exit) can overlap it."""
        with self._lock:
            if self.leader and not self._close_sent and not self.channel.closed:
                self.cluster.send({"k": messages.CLOSE, "sid": self.sid}, f"closing engine {self.sid}")
            self._close_sent = True

    # ---- rank 0 ----------------------------------------------------------------------------
    def _message(self, inputs: Inputs, plan: Plan) -> dict:
        """The step's message: its new requests, cancellations, horizon and plan; the cap decision
        when it changed; a nap for the other ranks once rank 0 has been idle a while."""
        msg = {"k": messages.STEP, "sid": self.sid, "n": self.steps + 1,
               "new": [[r.rid, r.prompt, messages.encode_params(r.params)] for r in inputs.new],
               "c": sorted(inputs.cancelled), "h": inputs.horizon, "p": messages.encode_plan(plan)}
        if inputs.cap is not self._sent_caps:
            msg["cap"] = messages.encode_caps(inputs.cap)
            self._sent_caps = inputs.cap
        if self._idle_for(plan) >= IDLE_NAP_AFTER_S:
            msg["nap"] = IDLE_NAP_S
        return msg

    def _idle_for(self, plan: Plan) -> float:
        """How long rank 0's engine has had nothing to do (0 while it has work; a plan without a
        round is an idle engine's with nothing queued)."""
        now = time.monotonic()
        if plan.round is not Round.NONE:
            self._idle_since = None
            return 0.0
        if self._idle_since is None:
            self._idle_since = now
        return now - self._idle_since

    # ---- the other ranks -----------------------------------------------------------------
    def follow(self, msg: dict) -> None:
        """Run the step rank 0 just announced: its new requests join this rank's queue under
        rank 0's ids, then the engine steps from rank 0's inputs."""
        if msg["sid"] != self.sid or msg["n"] != self.steps + 1:
            fatal(f"distributed: rank {self.channel.rank} is at step {self.steps} of engine {self.sid}, but rank 0"
                  f" sent step {msg['n']} of engine {msg['sid']}; this is a bug: please report it")
        self._msg = msg
        if "cap" in msg:
            self._leader_caps = messages.decode_caps(msg["cap"])
        for rid, prompt, params in msg["new"]:
            row = make_row(self.engine.lm, prompt, messages.decode_params(params))
            row.rid = rid
            self._streams.append(self.engine.service.enqueue(row))
        self.engine.advance()
        self._report_finished()

    def end(self) -> None:
        """Rank 0 closed the engine: end what this rank still serves ("cancelled")."""
        self.engine.end_live(FinishReason.CANCELLED, drop_caches=True)
        self._report_finished()

    def _report_finished(self) -> None:
        """Hand each stream that finished to the cluster's listener (tests compare every rank's)."""
        listener = self.cluster.on_replica_finish
        done = [s for s in self._streams if s.done]
        self._streams = [s for s in self._streams if not s.done]
        if listener is not None:
            for s in done:
                listener(self.sid, s.result)
