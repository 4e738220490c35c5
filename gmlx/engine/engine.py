"""The engine: owns the model, the drafter and the two decode loops; one step at a time.

All MLX work happens in one engine thread (or in the caller's thread when it drives `step()`
itself, as tests do). `submit()` validates a request completely before touching any state,
then queues it; requests join between rounds. `spec/admission.py` decides each step's
transition and round; `_apply` and `_round` carry them out. The queue, the streams, the engine
thread and shutdown are the service's (gmlx/engine/service.py).
"""

from __future__ import annotations

import threading
import time
import warnings
from pathlib import Path
from typing import Callable

from gmlx.policy import caps
from gmlx.config import EngineConfig, Switches, parse_cap_env
from gmlx.errors import ConfigError, EngineBusy, EngineClosed
from gmlx.engine.metrics import Counters, Event, EventKind, notify
from gmlx.kv import lift_caches
from gmlx.models.loading import LoadedModel, default_model_path, load
from gmlx.decode.prefill import Prefiller
from gmlx.prompt_cache import PromptCache
from gmlx.engine.row import Row, RowState, transition
from gmlx.sampling import RowSampling
from gmlx.policy import admission
from gmlx.policy.admission import Mode, Round
from gmlx.decode.batch import BatchLoop
from gmlx.drafters.base import Drafter
from gmlx.drafters.select import choose
from gmlx.decode.scalar import PlainDecoder, Prefilled, RoundResult, ScalarLoop, ScalarSeq
from gmlx.engine.service import EngineService


class Engine(EngineService):
    def __init__(self, model: LoadedModel | str | Path | None = None, config: EngineConfig | None = None,
                 *, switches: Switches | None = None, draft_model: LoadedModel | str | Path | None = None,
                 drafter: Drafter | None = None):
        """`draft_model`: a draft model (loaded or a local path) for the "draft" drafter kind;
        `drafter`: any implementation of the drafter protocol (gmlx.drafters.Drafter),
        used instead of the model's own."""
        self.config = (config or EngineConfig()).validated()
        self.switches = switches if switches is not None else Switches.from_env()
        self.lm = model if isinstance(model, LoadedModel) else load(model)
        choice = choose(self.lm, self.config, draft_model, drafter)
        self.drafter = drafter = choice.drafter
        self.draft_lm = choice.draft_lm
        self.notices = choice.notices  # said once to the user (the CLI prints them)
        self.speculative = drafter is not None
        self.k = self.config.num_draft_tokens or self.lm.default_k
        self.scalar = ScalarLoop(self.lm.target, drafter, self.k, self.config.prefill_step_size)
        self.batch = BatchLoop(self.lm.target, drafter, self.k)
        self.mode = Mode.IDLE
        self.model_key = (caps.model_key(None if self.lm.path == default_model_path() else self.lm.path)
                          + choice.cap_key_suffix)
        self._cap_defaults = choice.cap_defaults
        self._caps = self.cap_decision()  # a broken user config is an error at engine start, not mid-run
        self._cap_errors: set[str] = set()
        if self._caps.notice:
            self.notices.append(self._caps.notice)
        self.prompt_cache = PromptCache(self.config.prompt_cache_bytes) if self.config.prompt_cache_bytes else None
        self.prefiller = Prefiller(self.lm.target, self.prompt_cache, self.config.prefill_step_size)
        self.counters = Counters()
        self.listeners: list[Callable[[Event], None]] = []
        self._seq: ScalarSeq | None = None
        self._plain: PlainDecoder | None = None
        self._init_service()

    # ---- one step ----------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return self.mode is not Mode.IDLE or bool(self._queue)

    def step(self) -> list[Event]:
        """One round: reap cancellations, plan, apply the transition, run the round, retire."""
        if self._closed:
            raise EngineClosed("the engine is closed; create a new Engine")
        if self._thread is not None and threading.current_thread() is not self._thread:
            raise EngineBusy("the engine thread drives this engine (a submit() started it); do not call step()")
        self._in_transit = []
        events = self._reap_cancelled()
        self._caps = self._refresh_caps()  # once per round: the env and the user config may change live
        plan = admission.plan(self._view())
        events += self._apply(plan)
        events += self._round(plan.round)
        events += self._retire_finished()
        notify(self.listeners, events, self.counters)  # a raising listener is removed, never fatal
        return events

    def cap_decision(self) -> caps.CapDecision:
        """The width cap in force this round: CLI flag > GMLX_MTP_WIDTH_CAP (re-read every round,
        so a live change takes effect at the next round) > user config > model default."""
        return caps.resolve_cap(cli_cap=self.config.width_cap, env_cap=parse_cap_env(), model_key=self.model_key,
                                **self._cap_defaults)

    def _refresh_caps(self) -> caps.CapDecision:
        """The cap for this round. A value broken mid-run (a typo in GMLX_MTP_WIDTH_CAP or the user
        config) cannot stop requests being served: the last valid cap stays, with one warning per
        bad value (at engine start the same value is an error)."""
        try:
            return self.cap_decision()
        except ConfigError as e:
            if str(e) not in self._cap_errors:
                self._cap_errors.add(str(e))
                warnings.warn(f"gmlx: {e}; keeping the cap in force ({self._caps.text})", RuntimeWarning, stacklevel=2)
            return self._caps

    def _k_for(self, width: int) -> int:
        """Drafts per round at this width: the explicit setting, else a calibrated K per width
        (sweep-cap --write), else the model's default."""
        if self.config.num_draft_tokens is not None:
            return self.config.num_draft_tokens
        return self._caps.num_draft_tokens(width, self.lm.default_k)

    def cap(self) -> int | None:
        """None: off (never speculate in a batch); 0: uncapped; N: speculate while width <= N."""
        return self.cap_decision().cap

    def _view(self) -> admission.View:
        live = self._live_rows()
        with self._lock:
            queued = len(self._queue)
        return admission.View(
            mode=self.mode, width=len(live), queued=queued, cap=self._caps.cap, speculative=self.speculative,
            preempt=self.switches.preempt, resume=self.switches.resume, lookahead=self.batch.lookahead is not None,
            scalar_lookahead=self._plain is not None and self._plain.in_flight,
            min_remaining=min((r.remaining for r in live), default=0),
            resume_min_remaining=self.config.resume_min_remaining)

    @property
    def _wants_hidden(self) -> bool:
        return self.drafter is not None and self.drafter.needs_hidden

    def _reset_loops(self, drop_caches: bool = False) -> None:
        """No row is served any more (close() or a fault): drop both loops' state."""
        self._seq = self._plain = None
        self.batch = BatchLoop(self.lm.target, self.drafter, self.k)
        self.mode = Mode.IDLE
        if drop_caches and self.prompt_cache is not None:
            self.prompt_cache.clear()

    def _live_rows(self) -> list[Row]:
        if self.mode is Mode.SCALAR and self._seq is not None:
            return [self._seq.row]
        return list(self.batch.rows)

    def _apply(self, plan: admission.Plan) -> list[Event]:
        events = []
        if plan.transition is not None:
            events.append(self._transition_event(plan.transition, plan.reason))
        if plan.transition in ("preempt", "form_batch") and self.speculative and plan.round is Round.PLAIN:
            events.append(self._transition_event("gate", plan.reason))  # the new batch starts over the cap
        if plan.transition == "start_scalar":
            row = self._pop(1)[0]
            transition(row, RowState.SCALAR)
            pre = self.prefiller.prefill(row, want_hidden=self._wants_hidden)
            self._seq = self.scalar.start(row, RowSampling.from_params([row.params], [row.seed]), pre)
            self._plain = None if self.speculative else PlainDecoder(self.lm.target, self._seq)
            self.mode = Mode.SCALAR
        elif plan.transition == "preempt":
            self._preempt()
        elif plan.transition == "gate":
            self.batch.disarm()
            self.mode = Mode.GATED
            for r in self.batch.rows:
                transition(r, RowState.GATED)
        elif plan.transition == "form_batch":
            self.mode = Mode.BATCHED if plan.arm_newcomers else Mode.GATED
        if plan.admit and plan.transition != "start_scalar":  # start_scalar took its one row above; a
            self._admit(self._pop(plan.admit), plan.arm_newcomers)  # second pop would grab a late submit
        return events

    def _preempt(self) -> None:
        """Move the scalar request into an unarmed batch; its round's tokens are all delivered
        already (rounds are atomic here), so it restarts from its bonus with its real count."""
        seq = self._seq
        seq.row.preempted = True
        transition(seq.row, RowState.GATED)
        self.batch.add([seq.row], lift_caches([seq.cache]), [Prefilled(None, None, None)], arm=False)
        self._seq = self._plain = None
        self.mode = Mode.GATED

    def _admit(self, rows: list[Row], arm: bool) -> None:
        if not rows:  # the queue emptied since the plan (cancellations)
            return
        ordered, cache, pres = self.prefiller.prefill_many(rows, want_hidden=arm and self._wants_hidden)
        for row in ordered:
            transition(row, RowState.BATCHED if arm else RowState.GATED)
        self.batch.add(ordered, cache, pres, arm=arm)

    def _round(self, kind: Round) -> list[Event]:
        if kind is Round.NONE:
            return []
        t0 = time.perf_counter()
        if kind in (Round.SCALAR, Round.SCALAR_LAST):
            rows = [self._seq.row]
            if self._plain is not None:
                results = [self._plain.round(successor=kind is Round.SCALAR)]
            else:
                results = [self.scalar.round(self._seq)]
        else:
            rows = list(self.batch.rows)
            if kind is Round.SPECULATIVE:
                self.batch.k = self._k_for(len(rows))
                results = self.batch.speculative_round()
            elif kind is Round.CAPTURE:
                results = self.batch.capture_round()
                self.mode = Mode.BATCHED
                for r in rows:
                    transition(r, RowState.BATCHED)
            else:
                results = self.batch.plain_round(successor=kind is Round.PLAIN)
        now = time.perf_counter()
        per_row = tuple(self._deliver(row, res, now) for row, res in zip(rows, results))
        self.counters.rounds += 1
        self.counters.syncs += 1
        events = [Event(EventKind.ROUND, kind.value, len(rows), now - t0, per_row)]
        if kind is Round.CAPTURE:
            events.append(self._transition_event("capture", f"width {len(rows)}"))
        return events

    def _deliver(self, row: Row, res: RoundResult, now: float) -> tuple:
        row.stats.record_round(res.drafted, res.accepted)
        try:
            pieces = row.emit(res.tokens, now)
        except Exception as e:  # a detokenizer or stop-check fault ends this request only
            row.finish("error", now)
            row.error = f"{type(e).__name__}: {e}"
            pieces = []
        self._streams[row.rid]._put(pieces)
        n = sum(p.token >= 0 for p in pieces)
        self.counters.tokens += n
        self.counters.drafted += res.drafted
        self.counters.accepted += res.accepted
        return (row.rid, res.drafted, res.accepted, n)

    def _transition_event(self, kind: str, reason: str) -> Event:
        if kind in self.counters.transitions:
            self.counters.transitions[kind] += 1
        return Event(EventKind.TRANSITION, self.mode.value, len(self._live_rows()), transition=kind, reason=reason)

    def _reap_cancelled(self) -> list[Event]:
        """Cancelled requests leave at this boundary, before the plan counts the width."""
        now = time.perf_counter()
        with self._lock:
            gone = [r for r in self._queue if self._streams[r.rid].cancelled]
            for r in gone:
                self._queue.remove(r)
        for r in gone + [r for r in self._live_rows() if self._streams[r.rid].cancelled]:
            r.finish("cancelled", now)
            if r.state is RowState.QUEUED:
                self._deliver_final(r)
        return self._retire_finished()

    def _retire_finished(self) -> list[Event]:
        live = self._live_rows()
        done = [r for r in live if r.is_done]
        if not done:
            return []
        events = []
        for r in done:
            self._deliver_final(r)
            events.append(Event(EventKind.FINISH, self.mode.value, len(live), rid=r.rid, stats=r.stats.as_dict()))
        if self.mode is Mode.SCALAR:
            self.prefiller.retire(self._seq.row, self._seq.cache)
            self._seq = self._plain = None
        else:
            for i, r in enumerate(self.batch.rows):
                if r.is_done:
                    self.prefiller.retire_batch_row(r, self.batch.cache, i)
            self.batch.filter([i for i, r in enumerate(self.batch.rows) if not r.is_done])
        if not self._live_rows():
            self.mode = Mode.IDLE
        return events
