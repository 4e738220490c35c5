"""The engine: owns the model, the drafter and the two decode lanes; one step at a time.

`submit()` validates a request completely before touching any state, then queues it; requests
join between rounds. Each step schedules (`gmlx.policy.admission` plans it from the step's
inputs), runs (the plan's transitions and round, on the lanes: gmlx/engine/lanes.py) and
postprocesses (the round's tokens to their streams, finished rows retired). The queue, the
streams, the engine thread and shutdown are the service's (gmlx/engine/service.py); the other
processes running the same engine, if any, are met at one seam (`peers`: gmlx/engine/peers.py).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from gmlx.config import EngineConfig, SamplingParams, Switches
from gmlx.decode.prefill import Prefiller
from gmlx.decode.scalar import ScalarLane
from gmlx.row import RoundResult
from gmlx.drafters.base import Drafter
from gmlx.drafters.select import choose
from gmlx import trace
from gmlx.engine.cap_watch import CapWatch
from gmlx.engine.intake import make_row
from gmlx.engine.lanes import Lanes
from gmlx.engine.metrics import Counters, Event, EventKind, notify
from gmlx.engine.peers import Alone, Inputs, Peers
from gmlx.engine.service import Service
from gmlx.engine.speculation import Speculation
from gmlx.engine.stream import FinalRecord, Stream
from gmlx.finish import FinishReason
from gmlx.models.loading import LoadedModel, default_model_path, load
from gmlx.policy import admission, caps, user_config
from gmlx.policy.admission import Mode, Plan, Round, Transition
from gmlx.policy.costs import Costs
from gmlx.prompt_cache import PromptCache
from gmlx.row import Row
from gmlx.switches import check as check_switches


class Engine:
    def __init__(self, model: LoadedModel | str | Path | None = None, config: EngineConfig | None = None,
                 *, switches: Switches | None = None, draft_model: LoadedModel | str | Path | None = None,
                 drafter: Drafter | None = None, peers: Peers | None = None):
        """`draft_model`: a draft model (loaded or a local path) for the "draft" drafter kind;
        `drafter`: any implementation of the drafter protocol (gmlx.drafters.Drafter),
        used instead of the model's own; `peers`: the other processes running this engine
        (gmlx/distributed builds them; None: this process alone)."""
        check_switches()  # every GMLX_* switch: an invalid value is an error here, at engine start
        self.config = (config or EngineConfig()).validated()
        self.switches = switches if switches is not None else Switches.from_env()
        self.peers = peers if peers is not None else Alone()
        self.lm = model if isinstance(model, LoadedModel) else load(model)
        choice = choose(self.lm, self.config, draft_model, drafter)
        self.lm = choice.lm or self.lm  # an EAGLE-3 head reads the target through its own view
        self.drafter = drafter = choice.drafter
        self.draft_lm = choice.draft_lm
        self.notices = choice.notices  # said once to the user (the CLI prints them)
        self.speculative = drafter is not None
        self.k = self.config.num_draft_tokens or self.lm.default_k
        # An explicit K is obeyed as in mlx-lm and vLLM: K drafts every round (fewer at a request's end), never
        # plain, never the lone request's own context's (drafters/context_lookup.py); for the lone request too.
        # GMLX_TREE=1: the lone request may verify token trees where measured faster (gmlx/decode/tree_verify.py).
        lane, tree = (ScalarLane, {}) if not self.switches.tree else _tree_lane()
        self.scalar = lane(self.lm.target, drafter, self.k, self.config.prefill_step_size,
                           adaptive=self.config.num_draft_tokens is None,  # not adaptive: never plain
                           context=self.switches.context_lookup and self.config.num_draft_tokens is None, **tree)
        if self.peers.measures_alone:  # else with the peers, once they all have the engine
            self.measure_round_costs()
        self.model_key = (user_config.model_key(None if self.lm.path == default_model_path() else self.lm.path)
                          + choice.cap_key_suffix)
        # A broken user config or cap variable is an error here, at engine start, not mid-run.
        controlled = self.switches.control and self.config.num_draft_tokens is None
        self.caps = CapWatch(self.config.width_cap, self.model_key,
                             caps.under_control(choice.cap_defaults) if controlled else choice.cap_defaults,
                             self.config.num_draft_tokens, self.lm.default_k)
        if self.caps.current.notice:
            self.notices.append(self.caps.current.notice)
        costs = self.scalar.costs if self.speculative else None
        self.spec = Speculation(self.lm.target, drafter, self.caps, self.config.num_draft_tokens, costs,
                                self.switches.control)
        self.scalar.control = self.spec.control
        self.prompt_cache = PromptCache(self.config.prompt_cache_bytes) if self.config.prompt_cache_bytes else None
        self.prefiller = Prefiller(self.lm.target, self.prompt_cache, self.config.prefill_step_size)
        self.lanes = Lanes(self.lm.target, drafter, self.scalar, self.prefiller, self.spec)
        self.counters = Counters()
        self.listeners: list[Callable[[Event], None]] = []
        self._events: list[Event] | None = None  # this step's events, when someone wants them
        self.service = Service(self, self.config.max_queued, self.speculative, self.peers.heartbeat_s)
        self._held = 0

    # ---- the caller's side (thread-safe) -----------------------------------------------
    def submit(self, prompt: str | list[int], params: SamplingParams | None = None, *, start: bool = True) -> Stream:
        """Queue a request (thread-safe); returns its stream. Raises GmlxError on bad input,
        before anything changes. `start=False` leaves the engine thread off (tests drive step())."""
        row = make_row(self.lm, prompt, params)
        self.peers.accept(row)
        return self.service.submit(row, start)

    def generate(self, prompt: str | list[int], params: SamplingParams | None = None) -> FinalRecord:
        self.service.check_not_engine_thread("generate()")
        stream = self.submit(prompt, params)
        for _ in stream:
            pass
        return stream.result

    def close(self) -> None:
        """End live and queued streams ("cancelled"), join the engine thread, drop every cache."""
        self.service.close()
        self.peers.closed()

    @property
    def cap_in_force(self) -> caps.CapDecision:
        """The width cap and K per width in force: this round's decision (the engine's start's
        before its first step): CLI flag > GMLX_MTP_WIDTH_CAP > user config > model default."""
        return self.caps.current

    def measure_round_costs(self) -> Costs | None:
        """Time the rounds the lone request chooses between (once per model and drafter, not in a
        first request's TTFT); None when nothing is chosen from them."""
        if self.speculative and self.scalar.may_go_plain:
            return self.scalar.round_costs()
        return None

    # ---- the lanes ---------------------------------------------------------------------
    @property
    def mode(self) -> Mode:
        return self.lanes.mode

    @property
    def batch(self):
        return self.lanes.batch

    def live_rows(self) -> list[Row]:
        return self.lanes.live_rows()

    @property
    def busy(self) -> bool:
        return self.mode is not Mode.IDLE

    @property
    def has_work(self) -> bool:
        return self.busy or self.service.has_queued

    # ---- one step: schedule -> run -> postprocess --------------------------------------
    def step(self) -> list[Event]:
        """One round (plan, transitions, round, retire); its events, for a caller driving the engine."""
        return self._step(want_events=True)

    def advance(self) -> None:
        """One round for the engine thread: events are built only when a listener wants them."""
        self._step(want_events=bool(self.listeners))

    def _step(self, want_events: bool) -> list[Event]:
        with self.peers.step():
            trace.begin()
            self.service.begin_step()
            self._events = events = [] if want_events else None
            # schedule: reap the cancellations, plan (the same plan on every rank of a distributed run)
            plan = self.peers.agree(self._inputs, self._decide)
            self._held = self._held + 1 if plan.held else 0  # rounds the queue has waited (admission.holds)
            # run: the plan's transitions and admissions, then its round
            self._apply(plan)
            trace.mark("admission")
            ran = self._round(plan.round, steady=not (plan.transitions or plan.admit or self.lanes.cold(plan.round)))
            # postprocess: the round's tokens to their streams, finished rows out
            if ran is not None:
                self._deliver_round(plan.round, *ran)
            self._retire_finished()
            if events:
                notify(self.listeners, events, self.counters)  # a raising listener is removed, never fatal
            trace.end_round()
        return events or []

    def _inputs(self) -> Inputs:
        """This process's inputs for the step: the queue's snapshot, the cap decision (read live)."""
        return Inputs(*self.service.snapshot(), self.caps.read())

    def _decide(self, inputs: Inputs) -> Plan:
        """Reap the step's cancellations, put its cap decision in force, plan."""
        if inputs.cancelled:
            self._reap_cancelled(inputs.cancelled)
        self.caps.current = inputs.cap
        return admission.plan(self._view(inputs.horizon))

    def _view(self, horizon: int) -> admission.View:
        live = self.live_rows()
        queued = self.service.queued_through(horizon)
        batch_width = len(live) if self.mode in (Mode.BATCHED, Mode.GATED) else 0
        return admission.View(
            plain_widths=self.spec.plain_widths(batch_width, live, queued),
            plain_why=self.spec.plain_why,
            mode=self.mode, width=len(live), queued=queued, cap=self.caps.current.cap,
            speculative=self.speculative, preempt=self.switches.preempt, resume=self.switches.resume,
            lookahead=self.batch.lookahead is not None, scalar_lookahead=self.scalar.in_flight,
            remaining=tuple(r.remaining for r in live), resume_min_remaining=self.config.resume_min_remaining,
            refilled=self.spec.refills.refilled(queued), held=self._held)

    def _emit_event(self, make) -> None:
        """Record an event when someone wants this step's events (`make` builds it only then)."""
        if self._events is not None:
            self._events.append(make())

    # ---- run: the plan's transitions, in order, then its round ---------------------------
    def _apply(self, plan: Plan) -> None:
        admitted = False
        for t in plan.transitions:
            if t is Transition.CAPTURE:  # the newcomers join first: the capture round arms them too
                self._admit_planned(plan)
                admitted = True
            self.lanes.apply(t, plan, self.service.pop)
            self.counters.transitions[t] += 1
            self._emit_event(lambda: Event(EventKind.TRANSITION, self.mode, len(self.live_rows()), transition=t,
                                           reason=plan.reason))
        if not admitted:
            self._admit_planned(plan)

    def _admit_planned(self, plan: Plan) -> None:
        """The plan's queued requests join the batch (start_scalar took its one row itself; a
        second pop would grab a late submit)."""
        if plan.admit and Transition.START_SCALAR not in plan.transitions:
            self.lanes.admit(self.service.pop(plan.admit), plan.arm_newcomers)

    def _round(self, kind: Round, steady: bool) -> tuple[list[Row], list[RoundResult], float, float] | None:
        """Run the plan's round and show it to the online control; returns its rows, their results,
        its start and end (None: no round). `steady`: no transition or admission ran before it in
        this step (the control times rounds start to start, over steady stretches only)."""
        rows = self.live_rows()
        t0 = time.perf_counter()
        self.spec.round_starts(t0, len(rows), steady and kind is not Round.NONE)
        if kind is Round.NONE:
            return None
        results = self.lanes.run(kind, len(rows))
        now = time.perf_counter()
        self.spec.observe(kind, len(rows), t0, results, self.scalar.last_k, steady, self.scalar.switched)
        for width, why in self.spec.switched():
            self.counters.control_switches += 1
            self._emit_event(lambda: Event(EventKind.DECISION, self.mode, width, reason=why))
        return rows, results, t0, now

    # ---- postprocess: tokens to their streams, finished rows out ---------------------------
    def _deliver_round(self, kind: Round, rows: list[Row], results: list[RoundResult], t0: float, now: float) -> None:
        per_row = tuple(self._deliver(row, res, now) for row, res in zip(rows, results))
        self.counters.count_round(any(r.drafted for r in results))
        self._emit_event(lambda: Event(EventKind.ROUND, self.mode, len(rows), now - t0, per_row, round=kind))

    def _deliver(self, row: Row, res: RoundResult, now: float) -> tuple:
        before = len(row.tokens)
        pieces = row.take(res, now)
        trace.mark("emit")
        self.peers.emitted(row, row.tokens[before:])
        self.service.deliver(row, pieces)
        trace.mark("deliver")
        n = sum(p.token >= 0 for p in pieces)
        self.counters.tokens += n
        self.counters.drafted += res.drafted
        self.counters.accepted += res.accepted
        return (row.rid, res.drafted, res.accepted, n)

    def _reap_cancelled(self, cancelled: frozenset[int]) -> None:
        """Cancelled requests leave at this boundary, before the plan counts the width."""
        now = time.perf_counter()
        for r in self.service.pop_cancelled(cancelled):
            r.finish(FinishReason.CANCELLED, now)
            self.service.finish(r)
        for r in self.live_rows():
            if r.rid in cancelled:
                r.finish(FinishReason.CANCELLED, now)
        self._retire_finished()

    def _retire_finished(self) -> None:
        live = self.live_rows()
        done = [r for r in live if r.is_done]
        if not done:
            return
        for r in done:
            r.stats.decision = self.spec.describe(len(live), lone=self.mode is Mode.SCALAR)
            self.service.finish(r)
            self._emit_event(lambda r=r: Event(EventKind.FINISH, self.mode, len(live), rid=r.rid,
                                               stats=r.stats.as_dict()))
        self.lanes.retire()

    def end_live(self, reason: FinishReason, error: str | None = None, drop_caches: bool = False) -> None:
        """End every row being served (close(): "cancelled"; the last-resort handler: "error")
        and drop both lanes' state."""
        now = time.perf_counter()
        for row in self.live_rows():
            row.finish(reason, now)
            self.service.finish(row, error)
        self.lanes.reset()
        if drop_caches and self.prompt_cache is not None:
            self.prompt_cache.clear()


def _tree_lane():
    """The scalar lane with tree rounds, chosen per round from measurements (GMLX_TREE=1)."""
    from gmlx.decode.tree_verify import TreeScalarLane

    return TreeScalarLane, {"tree": "auto"}
