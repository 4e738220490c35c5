"""Admission and transitions: decides, never applies (the engine applies). Imports no MLX.

The engine describes its state in a `View` once per step; `plan()` returns a `Plan`: which
transition (if any) happens before this step's round, how many queued requests join, and what
kind of round runs. The rules are docs/design.md §2:

- Idle: one queued request starts the scalar loop; two or more form a batch.
- Scalar with waiters: preempt into the batch loop (GMLX_MTP_PREEMPT); the rebuilt batch's
  first drain admits every waiter. PREEMPT off: the waiters wait for the scalar request.
- Batch with waiters: the cap is checked against the width the admission would reach
  (counting every queued request) *before* the newcomers are processed; over the cap the batch
  gates (the drafter is dropped, rows decode plain). A gated batch whose plain lookahead is in
  flight holds the admission one round (the lookahead is consumed first, never discarded).
- Every round the cap is checked again (GMLX_MTP_WIDTH_CAP is re-read live): an armed batch
  over the cap gates.
- A gated batch back within the cap re-arms (GMLX_MTP_RESUME) when no row is within
  `resume_min_remaining` tokens of its budget and nothing is admitted this round: first one
  plain round consumes the lookahead without a successor, then a capture round arms the drafter.
- width == cap speculates; cap 0 is uncapped; cap None ("off") never speculates in a batch.
- Where finished rows are refilled (a closed loop, a queue), a batch holds an admission up to
  HOLD_ROUNDS rounds while a live row is sure to finish within them: the newcomers are then
  prefilled together with that row's successor (`holds`).

A plan names its transitions in the order the engine applies them, e.g. (PREEMPT, CAPTURE):
the scalar request joins an unarmed batch, then a capture round arms it; (FORM_BATCH, GATE): a
batch formed over the cap decodes plain from its first round.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum

# How many rounds a batch may hold an admission for a row sure to finish within them (0: never).
# Why: a prefill has a fixed cost besides its tokens — SmolLM2 float32 on this 2-core CPU prefills
# 1 / 2 / 4 prompts of 24-53 tokens in 117 / 192 / 343 ms, ~42 ms fixed: a round at width 2-4 —
# while a round held costs the newcomer one round of its place. Rows that speculate finish apart
# even when their budgets are equal (each round accepts what it accepts), so each refill was
# prefilled alone: in bench's closed loop (c = 4, 64 tokens) K = 1 every round made four
# admission steps of 0.21 s where plain, its rows finishing in one step, made one of 0.45 s.
# Only where finished rows have been refilled (drain.Refills): elsewhere a hold waits for nobody.
HOLD_ROUNDS = 2


class Mode(StrEnum):
    IDLE = "idle"
    SCALAR = "scalar"
    BATCHED = "batched"  # batch loop, drafter armed
    GATED = "gated"  # batch loop, drafter unarmed, plain double-buffered rounds


class Round(StrEnum):
    NONE = "none"
    SCALAR = "scalar"
    SCALAR_LAST = "scalar_last"  # scalar plain decode consuming its lookahead, no successor
    SPECULATIVE = "speculative"
    PLAIN = "plain"  # gated plain round, dispatching its successor
    PLAIN_LAST = "plain_last"  # plain round consuming the lookahead, no successor
    CAPTURE = "capture"


class Transition(StrEnum):
    START_SCALAR = "start_scalar"  # idle -> scalar: one request
    FORM_BATCH = "form_batch"  # idle -> batch: several requests at once
    PREEMPT = "preempt"  # scalar -> unarmed batch: waiters join the running request
    GATE = "gate"  # batch over the cap: drop the drafter, decode plain
    RESUME = "resume"  # a gated batch back within the cap re-arms (a capture round follows)
    CAPTURE = "capture"  # an unarmed batch arms: this step's round is a capture round


@dataclass(frozen=True)
class View:
    mode: Mode
    width: int  # live rows in the active loop
    queued: int
    cap: int | None  # None: off; 0: uncapped; N: speculate while width <= N
    speculative: bool  # the engine has a drafter and speculation is on
    preempt: bool
    resume: bool
    lookahead: bool  # a gated plain step is in flight
    scalar_lookahead: bool  # the scalar plain decoder has a step in flight
    resume_min_remaining: int
    # Widths where the online control (gmlx/policy/control.py) has decided plain decoding pays
    # better: within the cap, a batch of such a width still decodes plain (gates / does not resume).
    plain_widths: frozenset[int] = frozenset()
    plain_why: str = "plain pays better"  # the control's reason, for the plan's
    remaining: tuple[int, ...] = ()  # each live row's budget left
    refilled: bool = False  # finished rows' places are taken (drain.Refills): a hold has someone to wait for
    held: int = 0  # consecutive rounds the queue has been held so far (`holds`)

    @property
    def min_remaining(self) -> int:
        """The smallest budget left over live rows."""
        return min(self.remaining, default=0)


@dataclass(frozen=True)
class Plan:
    transitions: tuple[Transition, ...]  # applied in order before the round
    admit: int  # queued requests to admit before the round
    arm_newcomers: bool  # newcomers join the drafter (batch stays within the cap)
    round: Round
    reason: str = ""
    held: bool = False  # the queue waits this round (`holds`)


def allows(cap: int | None, width: int) -> bool:
    """May a batch of this width speculate?"""
    if cap is None:
        return False
    return cap == 0 or width <= cap


def speculates(v: View, width: int) -> bool:
    """May a batch of this width speculate now: a drafter, within the cap, not decided plain."""
    return v.speculative and allows(v.cap, width) and width not in v.plain_widths


def _why_plain(v: View, width: int) -> str:
    return f"width {width}: {v.plain_why}" if width in v.plain_widths and allows(v.cap, width) \
        else f"width {width} over cap {_cap_str(v.cap)}"


def plan(v: View) -> Plan:
    if v.mode is Mode.IDLE:
        return _plan_idle(v)
    if v.mode is Mode.SCALAR:
        return _plan_scalar(v)
    return _plan_batch(v)


def _plan_idle(v: View) -> Plan:
    if v.queued == 0:
        return Plan((), 0, False, Round.NONE)
    if v.queued == 1:
        return Plan((Transition.START_SCALAR,), 1, False, Round.SCALAR, "one request")
    armed = speculates(v, v.queued)
    reason = f"{v.queued} requests, cap {_cap_str(v.cap)}" + ("" if armed or not v.speculative else
                                                                f"; {_why_plain(v, v.queued)}")
    if armed:
        return Plan((Transition.FORM_BATCH,), v.queued, True, Round.SPECULATIVE, reason)
    return Plan((Transition.FORM_BATCH, *_gate_if(v)), v.queued, False, Round.PLAIN, reason)


def _plan_scalar(v: View) -> Plan:
    if v.queued == 0 or not v.preempt:
        return Plan((), 0, False, Round.SCALAR)
    if v.scalar_lookahead:  # consume the plain decoder's in-flight step before moving the request
        return Plan((), 0, False, Round.SCALAR_LAST, "hold preempt one round: consume the plain lookahead")
    width = 1 + v.queued
    if speculates(v, width):
        return Plan((Transition.PREEMPT, Transition.CAPTURE), v.queued, False, Round.CAPTURE,
                    f"{v.queued} waiting; width {width} within the cap")
    return Plan((Transition.PREEMPT, *_gate_if(v)), v.queued, False, Round.PLAIN,
                f"{v.queued} waiting; {_why_plain(v, width)}")


def holds(v: View) -> bool:
    """Whether a batch holds its queue this round: the traffic refills finished rows, and a live
    row is sure to finish within the rounds the hold has left (every round emits at least one
    token per row, so a budget left of n ends within n rounds)."""
    left = HOLD_ROUNDS - v.held
    return v.refilled and left > 0 and any(0 < r <= left for r in v.remaining)


def _plan_batch(v: View) -> Plan:
    if v.queued and holds(v):
        plan = _plan_rows(v)
        why = f"{v.queued} waiting: admission held for a row finishing within {HOLD_ROUNDS - v.held} round(s)"
        return replace(plan, held=True, reason=why + (f"; {plan.reason}" if plan.reason else ""))
    if v.queued:
        armed = v.mode is Mode.BATCHED
        width = v.width + v.queued
        if not armed and v.lookahead:
            return Plan((), 0, False, Round.PLAIN_LAST, "admission held: consume the plain lookahead")
        within = speculates(v, width)
        if armed and not within:
            return Plan((Transition.GATE,), v.queued, False, Round.PLAIN, f"admission: {_why_plain(v, width)}")
        if armed:
            return Plan((), v.queued, True, Round.SPECULATIVE, f"admission to width {width}")
        return Plan((), v.queued, False, Round.PLAIN, f"admission to width {width} (gated)")
    return _plan_rows(v)


def _plan_rows(v: View) -> Plan:
    """The batch's round with no admission."""
    armed = v.mode is Mode.BATCHED
    if armed:
        if speculates(v, v.width):
            return Plan((), 0, False, Round.SPECULATIVE)
        return Plan((Transition.GATE,), 0, False, Round.PLAIN, _why_plain(v, v.width))
    # A consuming round emits one more token per row before the capture, so count it in.
    remaining_at_capture = v.min_remaining - (1 if v.lookahead else 0)
    can_resume = (speculates(v, v.width) and v.resume
                  and remaining_at_capture >= v.resume_min_remaining)
    if not can_resume:
        return Plan((), 0, False, Round.PLAIN)
    if v.lookahead:
        return Plan((), 0, False, Round.PLAIN_LAST, "resume: consume the plain lookahead")
    return Plan((Transition.RESUME, Transition.CAPTURE), 0, False, Round.CAPTURE,
                f"width {v.width} within cap {_cap_str(v.cap)}")


def _gate_if(v: View) -> tuple[Transition, ...]:
    """A new batch over the cap starts gated; without a drafter there is nothing to gate."""
    return (Transition.GATE,) if v.speculative else ()


def _cap_str(cap: int | None) -> str:
    return "off" if cap is None else ("uncapped" if cap == 0 else str(cap))
