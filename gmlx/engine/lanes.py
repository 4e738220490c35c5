"""The two decode lanes and the mode between them: the scalar lane serves a lone request, the
batch loop serves several (armed: the drafter drafts for every row; gated: plain rounds).

`gmlx.policy.admission` names each step's transitions; `apply` carries one out on the lanes,
`run` runs the step's round on the lane the mode names, and `retire` lets finished rows leave
(their KV into the prompt cache). The engine (gmlx/engine/engine.py) calls these in its step and
does the bookkeeping around them: streams, counters, events.
"""

from __future__ import annotations

from typing import Callable

from gmlx.decode.batch import BatchLoop
from gmlx.decode.prefill import Prefiller
from gmlx.decode.scalar import ScalarLane
from gmlx.engine.speculation import Speculation
from gmlx.policy.admission import Mode, Plan, Round, Transition
from gmlx.row import RoundResult, Row, RowState, transition


class Lanes:
    def __init__(self, target, drafter, scalar: ScalarLane, prefiller: Prefiller, spec: Speculation):
        self.target, self.drafter = target, drafter
        self.scalar = scalar
        self.prefiller = prefiller
        self.spec = spec  # the drafts per round in force (the lone request's K, the batch's)
        self.batch = BatchLoop(target, drafter)
        self.mode = Mode.IDLE

    def live_rows(self) -> list[Row]:
        if self.mode is Mode.SCALAR:
            return [self.scalar.row] if self.scalar.row is not None else []
        return list(self.batch.rows)

    @property
    def wants_hidden(self) -> bool:
        return self.drafter is not None and self.drafter.needs_hidden

    # ---- transitions -------------------------------------------------------------------
    def apply(self, t: Transition, plan: Plan, pop: Callable[[int], list[Row]]) -> None:
        """Carry out one of the plan's transitions; `pop(n)` takes n queued requests."""
        match t:
            case Transition.START_SCALAR:
                self._start_scalar(pop(1)[0])
            case Transition.FORM_BATCH:
                self.mode = Mode.BATCHED if plan.arm_newcomers else Mode.GATED
            case Transition.PREEMPT:
                self._preempt()
            case Transition.GATE:  # within the cap, the drafter stays for shadow rounds
                self.batch.disarm(keep=self.spec.shadows(self.batch.width + plan.admit, self.batch.rows))
                self._enter(Mode.GATED, RowState.GATED)
            case Transition.RESUME:
                assert self.mode is Mode.GATED and self.batch.lookahead is None, "resume needs a drained, gated batch"
            case Transition.CAPTURE:  # this step's round is a capture round: it arms the drafter for every row
                self._enter(Mode.BATCHED, RowState.BATCHED)

    def _start_scalar(self, row: Row) -> None:
        transition(row, RowState.SCALAR)
        # Up to the calibrated K at width 1 (0: plain), unless the measured costs say no K pays.
        speculative = self.drafter is not None
        k = self.scalar.decide(self.spec.ceiling(1)) if speculative else 0
        if not k and speculative and row.params.prediction:  # its drafts cost no drafter work
            k = max(1, self.spec.ceiling(1))
        self.scalar.start(row, self.prefiller.prefill(row, want_hidden=k > 0 and self.wants_hidden), max_k=k)
        self.mode = Mode.SCALAR

    def _preempt(self) -> None:
        """The scalar request joins an unarmed batch with its real emitted count; it keeps batch
        semantics (greedy drafts) to its end and drops its prompt-cache retirement context."""
        self.scalar.row.preempted = True
        transition(self.scalar.row, RowState.GATED)
        self.batch.add(*self.scalar.evict(), arm=False)
        self.mode = Mode.GATED

    def _enter(self, mode: Mode, state: RowState) -> None:
        self.mode = mode
        for r in self.batch.rows:
            transition(r, state)

    def admit(self, rows: list[Row], arm: bool) -> None:
        """Queued requests join the batch, prefilled together (armed: the drafter drafts for them)."""
        if not rows:  # the queue emptied since the plan (cancellations)
            return
        # gated: they join its shadow rounds (gmlx/decode/batch_shadow.py), or start them in a new batch
        shadow = not arm and self.wants_hidden and (self.batch.shadow is not None or not self.batch.rows) \
            and self.spec.shadows(self.batch.width + len(rows), self.batch.rows + rows)
        ordered, cache, pres = self.prefiller.prefill_many(rows, want_hidden=arm and self.wants_hidden or shadow)
        for row in ordered:
            transition(row, RowState.BATCHED if arm else RowState.GATED)
        self.batch.add(ordered, cache, pres, arm=arm, shadow=shadow)

    # ---- the round and leaving ---------------------------------------------------------
    def cold(self, kind: Round) -> bool:
        """A batch plain round with no step in flight (after a row's first token: plain.FIRST_TOKEN_OUT):
        its own whole step falls in its period, which the control must not take for a steady round's."""
        return kind is Round.PLAIN and self.batch.lookahead is None

    def run(self, kind: Round, width: int) -> list[RoundResult]:
        if kind is Round.SCALAR or kind is Round.SCALAR_LAST:
            return [self.scalar.round(last=kind is Round.SCALAR_LAST)]
        if kind is Round.SPECULATIVE:  # the plan decided this batch speculates: at least one draft
            return self.batch.speculative_round(self.spec.batch_k(width, self.batch.rows))
        if kind is Round.CAPTURE:
            return self.batch.capture_round()
        results = self.batch.plain_round(successor=kind is Round.PLAIN)
        if self.batch.shadow is not None:  # last replay's records; the next replay, when due
            self.spec.shadowed(width, self.batch.shadow.read(self.batch.rows))
            if self.spec.shadows(width, self.batch.rows):
                self.batch.shadow.dispatch(self.batch.rows)
            else:  # the width is far from paying: its shadows' cost buys nothing (Speculation.shadows)
                self.batch.drop_shadow()
        elif self.mode is Mode.GATED and self.wants_hidden and self.spec.shadows(width, self.batch.rows):
            self.batch.shadow_again()  # (the width's exploration started its shadows again, or new rows joined)
        return results

    def retire(self) -> None:
        """Finished rows leave their lane, their KV into the prompt cache; an emptied lane idles."""
        if self.mode is Mode.SCALAR:
            self.prefiller.retire(*self.scalar.retire())
        else:
            for i, r in enumerate(self.batch.rows):
                if r.is_done:
                    self.prefiller.retire_batch_row(r, self.batch.cache, i)
            self.batch.filter([i for i, r in enumerate(self.batch.rows) if not r.is_done])
        if self.mode is Mode.SCALAR or not self.batch.rows:
            self.mode = Mode.IDLE

    def reset(self) -> None:
        """Drop both lanes' state (their rows were ended)."""
        self.scalar.clear()
        self.batch = BatchLoop(self.target, self.drafter)
        self.mode = Mode.IDLE
