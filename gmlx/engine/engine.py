"""The engine: owns the model, the drafter and the two decode lanes; one step at a time.

`submit()` validates a request completely before touching any state, then queues it; requests
join between rounds. `gmlx.policy.admission` decides each step's transitions and round; the
engine applies each transition through one named method (`_apply`'s table) and then runs the
round. The queue, the streams, the engine thread and shutdown are the service's
(gmlx/engine/service.py), which the engine holds.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from gmlx.config import EngineConfig, SamplingParams, Switches
from gmlx.decode.batch import BatchLoop
from gmlx.decode.prefill import Prefiller
from gmlx.decode.scalar import ScalarLane
from gmlx.row import RoundResult
from gmlx.drafters.base import Drafter
from gmlx.drafters.select import choose
from gmlx import trace
from gmlx.engine.cap_watch import CapWatch
from gmlx.engine.intake import make_row
from gmlx.engine.metrics import Counters, Event, EventKind, notify
from gmlx.row import Row, RowState, transition
from gmlx.engine.service import Service
from gmlx.engine.speculation import Speculation
from gmlx.engine.stream import FinalRecord, Stream
from gmlx.finish import FinishReason
from gmlx.models.loading import LoadedModel, default_model_path, load
from gmlx.policy import admission, caps
from gmlx.policy.admission import Mode, Plan, Round, Transition
from gmlx.prompt_cache import PromptCache
from gmlx.switches import check as check_switches


class Engine:
    # Each transition is applied by one named method (looked up per step, so tests may spy on it).
    _APPLY = {Transition.START_SCALAR: "_start_scalar", Transition.FORM_BATCH: "_form_batch",
              Transition.PREEMPT: "_preempt", Transition.GATE: "_gate", Transition.RESUME: "_resume",
              Transition.CAPTURE: "_arm"}

    def __init__(self, model: LoadedModel | str | Path | None = None, config: EngineConfig | None = None,
                 *, switches: Switches | None = None, draft_model: LoadedModel | str | Path | None = None,
                 drafter: Drafter | None = None):
        """`draft_model`: a draft model (loaded or a local path) for the "draft" drafter kind;
        `drafter`: any implementation of the drafter protocol (gmlx.drafters.Drafter),
        used instead of the model's own."""
        check_switches()  # every GMLX_* switch: an invalid value is an error here, at engine start
        self.config = (config or EngineConfig()).validated()
        self.switches = switches if switches is not None else Switches.from_env()
        self.lm = model if isinstance(model, LoadedModel) else load(model)
        choice = choose(self.lm, self.config, draft_model, drafter)
        self.lm = choice.lm or self.lm  # an EAGLE-3 head reads the target through its own view
        self.drafter = drafter = choice.drafter
        self.draft_lm = choice.draft_lm
        self.notices = choice.notices  # said once to the user (the CLI prints them)
        self.speculative = drafter is not None
        self.k = self.config.num_draft_tokens or self.lm.default_k
        # An explicit K is a request to speculate: lone requests then never fall back to plain.
        # GMLX_TREE=1: the lone request may verify token trees where measured faster (gmlx/decode/tree_verify.py).
        lane, tree = (ScalarLane, {}) if not self.switches.tree else _tree_lane()
        self.scalar = lane(self.lm.target, drafter, self.k, self.config.prefill_step_size,
                           may_go_plain=self.config.num_draft_tokens is None, **tree)
        self._measure_round_costs()
        self.batch = BatchLoop(self.lm.target, drafter)
        self.mode = Mode.IDLE
        self.model_key = (caps.model_key(None if self.lm.path == default_model_path() else self.lm.path)
                          + choice.cap_key_suffix)
        # A broken user config or cap variable is an error here, at engine start, not mid-run.
        self.caps = CapWatch(self.config.width_cap, self.model_key, choice.cap_defaults, self.config.num_draft_tokens,
                             self.lm.default_k)
        if self.caps.current.notice:
            self.notices.append(self.caps.current.notice)
        costs = self.scalar.costs if self.speculative else None
        self.spec = Speculation(self.lm.target, drafter, self.caps, self.config.num_draft_tokens, costs,
                                self.switches.control)
        self.scalar.control = self.spec.control
        self.prompt_cache = PromptCache(self.config.prompt_cache_bytes) if self.config.prompt_cache_bytes else None
        self.prefiller = Prefiller(self.lm.target, self.prompt_cache, self.config.prefill_step_size)
        self.counters = Counters()
        self.listeners: list[Callable[[Event], None]] = []
        self._events: list[Event] | None = None  # this step's events, when someone wants them
        self.service = Service(self, self.config.max_queued, self.speculative)

    # ---- the caller's side (thread-safe) -----------------------------------------------
    def submit(self, prompt: str | list[int], params: SamplingParams | None = None, *, start: bool = True) -> Stream:
        """Queue a request (thread-safe); returns its stream. Raises GmlxError on bad input,
        before anything changes. `start=False` leaves the engine thread off (tests drive step())."""
        return self.service.submit(make_row(self.lm, prompt, params), start)

    def generate(self, prompt: str | list[int], params: SamplingParams | None = None) -> FinalRecord:
        self.service.check_not_engine_thread("generate()")
        stream = self.submit(prompt, params)
        for _ in stream:
            pass
        return stream.result

    def close(self) -> None:
        """End live and queued streams ("cancelled"), join the engine thread, drop every cache."""
        self.service.close()

    # ---- one step ----------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return self.mode is not Mode.IDLE

    @property
    def has_work(self) -> bool:
        return self.busy or self.service.has_queued

    def step(self) -> list[Event]:
        """One round: reap cancellations, plan, apply the transitions, run the round, retire.
        Returns the step's events (a caller driving the engine reads them)."""
        return self._step(want_events=True)

    def advance(self) -> None:
        """One round for the engine thread: events are built only when a listener wants them."""
        self._step(want_events=bool(self.listeners))

    def _step(self, want_events: bool) -> list[Event]:
        trace.begin()
        self.service.begin_step()
        self._events = events = [] if want_events else None
        if self.service.cancel_requested():
            self._reap_cancelled()
        caps_now = self._refresh_caps()  # once per round: the env and the user config may change live
        plan = self._decide(self._view(caps_now.cap))
        self._apply(plan)
        trace.mark("admission")
        self._round(plan.round, steady=not (plan.transitions or plan.admit))
        self._retire_finished()
        if events:
            notify(self.listeners, events, self.counters)  # a raising listener is removed, never fatal
        trace.end_round()
        return events or []

    def _measure_round_costs(self) -> None:
        """Now (once per model and drafter), not in a first request's TTFT. A replica measures
        with its peers instead, once they all have the engine (gmlx/distributed)."""
        if self.speculative and self.scalar.may_go_plain:
            self.scalar.round_costs()

    def _refresh_caps(self) -> caps.CapDecision:
        """This round's cap decision. A replica follows its leader's instead (gmlx/distributed)."""
        return self.caps.refresh()

    def _decide(self, view: admission.View) -> Plan:
        """This step's plan. A replica takes it from its leader instead (gmlx/distributed)."""
        return admission.plan(view)

    def _emit_event(self, make) -> None:
        """Record an event when someone wants this step's events (`make` builds it only then)."""
        if self._events is not None:
            self._events.append(make())

    def cap_decision(self) -> caps.CapDecision:
        """The width cap from the current settings: CLI flag > GMLX_MTP_WIDTH_CAP > user config >
        model default (read now; the engine itself decides once per round: `cap_in_force`)."""
        return self.caps.decide()

    @property
    def cap_in_force(self) -> caps.CapDecision:
        """This round's cap decision (read by listeners on the engine thread)."""
        return self.caps.current

    def cap(self) -> int | None:
        """None: off (never speculate in a batch); 0: uncapped; N: speculate while width <= N."""
        return self.cap_decision().cap

    def _k_for(self, width: int) -> int:
        return self.caps.k_for(width)

    def _view(self, cap: int | None) -> admission.View:
        live = self.live_rows()
        batch_width = len(live) if self.mode in (Mode.BATCHED, Mode.GATED) else 0
        return admission.View(
            plain_widths=self.spec.plain_widths(batch_width, len(live), self.service.queued),
            plain_why=self.spec.plain_why,
            mode=self.mode, width=len(live), queued=self.service.queued, cap=cap,
            speculative=self.speculative, preempt=self.switches.preempt, resume=self.switches.resume,
            lookahead=self.batch.lookahead is not None, scalar_lookahead=self.scalar.in_flight,
            min_remaining=min((r.remaining for r in live), default=0),
            resume_min_remaining=self.config.resume_min_remaining)

    def live_rows(self) -> list[Row]:
        if self.mode is Mode.SCALAR:
            return [self.scalar.row] if self.scalar.row is not None else []
        return list(self.batch.rows)

    # ---- transitions: each a named method, applied in the plan's order -------------------
    def _apply(self, plan: Plan) -> None:
        admitted = False
        for t in plan.transitions:
            if t is Transition.CAPTURE:  # the newcomers join first: the capture round arms them too
                admitted = self._admit_planned(plan)
            getattr(self, self._APPLY[t])(plan)
            self.counters.transitions[t] += 1
            self._emit_event(lambda: Event(EventKind.TRANSITION, self.mode, len(self.live_rows()), transition=t,
                                           reason=plan.reason))
        if not admitted:
            self._admit_planned(plan)

    def _admit_planned(self, plan: Plan) -> bool:
        """The plan's queued requests join the batch (start_scalar took its one row itself; a
        second pop would grab a late submit)."""
        if plan.admit and Transition.START_SCALAR not in plan.transitions:
            self._admit(self.service.pop(plan.admit), plan.arm_newcomers)
        return True

    def _start_scalar(self, plan: Plan) -> None:
        row = self.service.pop(1)[0]
        transition(row, RowState.SCALAR)
        # Up to the calibrated K at width 1 (0: plain), unless the measured costs say no K pays.
        k = self.scalar.decide(self._k_for(1)) if self.speculative else 0
        if not k and self.speculative and row.params.prediction:  # its drafts cost no drafter work
            k = max(1, self._k_for(1))
        self.scalar.start(row, self.prefiller.prefill(row, want_hidden=k > 0 and self._wants_hidden), max_k=k)
        self.mode = Mode.SCALAR

    def _form_batch(self, plan: Plan) -> None:
        self.mode = Mode.BATCHED if plan.arm_newcomers else Mode.GATED

    def _preempt(self, plan: Plan) -> None:
        """The scalar request joins an unarmed batch with its real emitted count; it keeps batch
        semantics (greedy drafts) to its end and drops its prompt-cache retirement context."""
        self.scalar.row.preempted = True
        transition(self.scalar.row, RowState.GATED)
        self.batch.add(*self.scalar.evict(), arm=False)
        self.mode = Mode.GATED

    def _gate(self, plan: Plan) -> None:
        self.batch.disarm()
        self._enter(Mode.GATED, RowState.GATED)

    def _resume(self, plan: Plan) -> None:
        assert self.mode is Mode.GATED and self.batch.lookahead is None, "resume needs a drained, gated batch"

    def _arm(self, plan: Plan) -> None:
        """This step's round is a capture round: it arms the drafter for every row."""
        self._enter(Mode.BATCHED, RowState.BATCHED)

    def _enter(self, mode: Mode, state: RowState) -> None:
        self.mode = mode
        for r in self.batch.rows:
            transition(r, state)

    def _admit(self, rows: list[Row], arm: bool) -> None:
        if not rows:  # the queue emptied since the plan (cancellations)
            return
        ordered, cache, pres = self.prefiller.prefill_many(rows, want_hidden=arm and self._wants_hidden)
        for row in ordered:
            transition(row, RowState.BATCHED if arm else RowState.GATED)
        self.batch.add(ordered, cache, pres, arm=arm)

    @property
    def _wants_hidden(self) -> bool:
        return self.drafter is not None and self.drafter.needs_hidden

    # ---- the round ---------------------------------------------------------------------
    def _round(self, kind: Round, steady: bool = True) -> None:
        """Run the plan's round and emit it. `steady`: no transition or admission ran before it in
        this step (the control times rounds start to start, over steady stretches only)."""
        rows = self.live_rows()
        t0 = time.perf_counter()
        self.spec.round_starts(t0, len(rows), steady and kind is not Round.NONE)
        if kind is Round.NONE:
            return
        results = self._run(kind, len(rows))
        now = time.perf_counter()
        self.spec.observe(kind, len(rows), t0, results, self.scalar.last_k)
        for width, why in self.spec.switched():
            self.counters.control_switches += 1
            self._emit_event(lambda: Event(EventKind.DECISION, self.mode, width, reason=why))
        per_row = tuple(self._deliver(row, res, now) for row, res in zip(rows, results))
        self.counters.rounds += 1
        self.counters.syncs += 1
        self._emit_event(lambda: Event(EventKind.ROUND, self.mode, len(rows), now - t0, per_row, round=kind))

    def _run(self, kind: Round, width: int) -> list[RoundResult]:
        if kind is Round.SCALAR or kind is Round.SCALAR_LAST:
            return [self.scalar.round(last=kind is Round.SCALAR_LAST)]
        if kind is Round.SPECULATIVE:  # the plan decided this batch speculates: at least one draft
            return self.batch.speculative_round(self.spec.batch_k(width))
        if kind is Round.CAPTURE:
            return self.batch.capture_round()
        return self.batch.plain_round(successor=kind is Round.PLAIN)

    def _deliver(self, row: Row, res: RoundResult, now: float) -> tuple:
        pieces = row.take(res, now)
        trace.mark("emit")
        self.service.deliver(row, pieces)
        trace.mark("deliver")
        n = sum(p.token >= 0 for p in pieces)
        self.counters.tokens += n
        self.counters.drafted += res.drafted
        self.counters.accepted += res.accepted
        return (row.rid, res.drafted, res.accepted, n)

    # ---- leaving -----------------------------------------------------------------------
    def _reap_cancelled(self) -> None:
        """Cancelled requests leave at this boundary, before the plan counts the width."""
        now = time.perf_counter()
        for r in self.service.pop_cancelled():
            r.finish(FinishReason.CANCELLED, now)
            self.service.finish(r)
        for r in self.live_rows():
            if self.service.cancelled(r):
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
        if self.mode is Mode.SCALAR:
            self.prefiller.retire(*self.scalar.retire())
        else:
            for i, r in enumerate(self.batch.rows):
                if r.is_done:
                    self.prefiller.retire_batch_row(r, self.batch.cache, i)
            self.batch.filter([i for i, r in enumerate(self.batch.rows) if not r.is_done])
        if self.mode is Mode.SCALAR or not self.batch.rows:
            self.mode = Mode.IDLE

    def end_live(self, reason: FinishReason, error: str | None = None, drop_caches: bool = False) -> None:
        """End every row being served (close(): "cancelled"; the last-resort handler: "error")
        and drop both lanes' state."""
        now = time.perf_counter()
        for row in self.live_rows():
            row.finish(reason, now)
            self.service.finish(row, error)
        self.scalar.clear()
        self.batch = BatchLoop(self.lm.target, self.drafter)
        self.mode = Mode.IDLE
        if drop_caches and self.prompt_cache is not None:
            self.prompt_cache.clear()


def _tree_lane():
    """The scalar lane with tree rounds, chosen per round from measurements (GMLX_TREE=1)."""
    from gmlx.decode.tree_verify import TreeScalarLane

    return TreeScalarLane, {"tree": "auto"}
