"""Admission's hold for grouped refills (gmlx/policy/admission.py `holds`): where finished rows are
refilled, a batch holds its queue up to HOLD_ROUNDS rounds while a live row is sure to finish
within them, so the newcomers are prefilled together with that row's successor. Pure plans first
(both ways, bounded, a property over random views), then engines: a closed loop whose rows finish
a round apart (plain: grouped with the hold, apart without), one whose rows finish too far apart
(no hold), a fresh target (nothing refilled yet: no hold), and a speculating closed loop — every
stream equal to its solo plain stream."""

import dataclasses

import hypothesis.strategies as st
from hypothesis import given, settings

import pytest

from engine_helpers import P, check_solo, drive, matches_solo
from gmlx import Engine, EngineConfig
from gmlx.config import Switches
from gmlx.policy import admission, control
from gmlx.policy.admission import Mode, Plan, Round, View, plan
from gmlx.policy.drain import Refills, Tally

LM_WITHOUT_EOS = True  # budgets alone end the requests: the schedules keep their shape


def view(**kw) -> View:
    base = dict(mode=Mode.BATCHED, width=2, queued=1, cap=0, speculative=True, preempt=True, resume=True,
                lookahead=False, scalar_lookahead=False, resume_min_remaining=8,
                remaining=(1, 10), refilled=True, held=0)
    base.update(kw)
    return View(**base)


def test_a_batch_holds_its_queue_for_a_row_about_to_finish():
    p = plan(view())
    assert p.held and p.admit == 0 and p.round is Round.SPECULATIVE and "admission held" in p.reason


@pytest.mark.parametrize("change", [dict(refilled=False), dict(remaining=(3, 10)),
                                    dict(held=admission.HOLD_ROUNDS), dict(held=1, remaining=(2, 9))])
def test_no_hold_without_refills_a_row_sure_to_finish_in_time_or_rounds_left(change):
    """Not refilled (nobody to wait for), no row within the rounds left, or the hold used up."""
    p = plan(view(**change))
    assert not p.held and p.admit == 1


def test_a_hold_of_one_more_round_for_a_row_one_token_from_its_budget():
    assert plan(view(held=1, remaining=(1, 9))).held


def test_a_finish_a_waiting_request_is_about_to_take_counts_as_a_refill():
    """drain.Refills.refilled: the prior (one drain) says no; a finish in the last steps with a
    request waiting says yes, as a refill would once admitted; no waiter, or no finish, says no."""
    r = Refills(Tally())
    r.step(frozenset({1, 2}))
    assert not r.refilled(1)  # nothing finished: an arrival only
    r.step(frozenset({2}))  # row 1 finished
    assert r.refilled(1) and not r.refilled(0)
    assert r.drain_share == 1.0  # nothing counted until the admission


def test_hold_off(monkeypatch):
    monkeypatch.setattr(admission, "HOLD_ROUNDS", 0)
    assert plan(view()).admit == 1


def test_a_gated_batch_holds_with_its_plain_lookahead_running():
    p = plan(view(mode=Mode.GATED, lookahead=True))
    assert p.held and p.admit == 0 and p.round is Round.PLAIN  # its successor dispatched, as with no queue


@pytest.mark.parametrize("mode", [Mode.IDLE, Mode.SCALAR])
def test_only_a_batch_holds(mode):
    assert not plan(view(mode=mode, width=1 if mode is Mode.SCALAR else 0, remaining=(1,))).held


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.lists(st.integers(1, 6), min_size=1, max_size=4),
                          st.booleans(), st.sampled_from([Mode.BATCHED, Mode.GATED])), min_size=1, max_size=12))
def test_property_a_held_plan_admits_nothing_and_holds_are_bounded(steps):
    held = 0
    for queued, remaining, refilled, mode in steps:
        v = view(mode=mode, queued=queued, width=len(remaining), remaining=tuple(remaining),
                 refilled=refilled, held=held)
        p = plan(v)
        if p.held:
            assert queued and refilled and p.admit == 0
            assert any(r <= admission.HOLD_ROUNDS - held for r in remaining)
        elif queued and not (mode is Mode.GATED and p.round is Round.PLAIN_LAST):
            assert p.admit == queued
        held = held + 1 if p.held else 0
        assert held <= admission.HOLD_ROUNDS


# ---- engines ----------------------------------------------------------------------------
def closed_loop(eng: Engine, prompts: list, budgets: list[int], waves: int, calls: list) -> dict:
    """len(budgets) clients, each sending its next request (its budget again) as its last finishes;
    `calls` records the rows of each batch prefill. Returns every request: rid -> (prompt, params, stream)."""
    real = eng.prefiller.prefill_many

    def counted(rows, want_hidden):
        calls.append(len(rows))
        return real(rows, want_hidden)

    eng.prefiller.prefill_many = counted
    sent = {}
    live = {}
    for c, n in enumerate(budgets):
        live[c] = eng.submit(prompts[c], P(n), start=False)
        sent[live[c].request_id] = (prompts[c], P(n), live[c])
    left = {c: waves - 1 for c in live}
    while eng.has_work:
        eng.step()
        for c, s in list(live.items()):
            if s.done and left[c]:
                left[c] -= 1
                prompt = prompts[(c + 3 * left[c] + 1) % len(prompts)]
                live[c] = eng.submit(prompt, P(budgets[c]), start=False)
                sent[live[c].request_id] = (prompt, P(budgets[c]), live[c])
    return sent


@pytest.fixture
def refilled(lm):
    """This target has seen finished rows refilled (as after a bench's first cell)."""
    control.forget(lm.target)
    for _ in range(3):
        control.tally(lm.target).count(refill=True)
    yield
    control.forget(lm.target)


def plain_prefills(lm, prompts, budgets: list[int], waves: int) -> list[int]:
    """The rows of each batch prefill of a plain engine's closed loop; every stream equals solo."""
    calls: list = []
    eng = Engine(lm, EngineConfig(speculative=False))
    try:
        sent = closed_loop(eng, prompts, budgets, waves, calls)
    finally:
        eng.close()
    for prompt, params, stream in sent.values():
        matches_solo(lm, prompt, params, stream.result.tokens)
    return calls


@pytest.mark.parametrize("hold", [True, False])
def test_plain_rows_finishing_a_round_apart_are_refilled_in_one_prefill(lm, prompts, refilled, monkeypatch, hold):
    """Two clients with budgets 8 and 10: when the first finishes the second has 2 tokens left
    (one after the plain lookahead's round, which an admission to a gated batch runs first). With
    the hold both successors are prefilled together (one call of 2 rows a wave); without it each
    alone."""
    if not hold:
        monkeypatch.setattr(admission, "HOLD_ROUNDS", 0)
    assert plain_prefills(lm, prompts, [8, 10], waves=3) == ([2, 2, 2] if hold else [2, 1, 1, 1, 1])


def test_rows_too_far_apart_are_not_waited_for(lm, prompts, refilled):
    """Budgets 8 and 12: the second has 3 tokens left after the lookahead's round, more than
    HOLD_ROUNDS rounds: no hold."""
    assert plain_prefills(lm, prompts, [8, 12], waves=2) == [2, 1, 1]


def recorded_holds(monkeypatch) -> list[bool]:
    """Every plan's `held` flag, in order."""
    held: list[bool] = []
    real = admission.plan

    def recorded(v):
        p = real(v)
        held.append(p.held)
        return p

    monkeypatch.setattr(admission, "plan", recorded)
    return held


@pytest.mark.parametrize("seen", [False, True])
def test_an_arrival_with_no_finish_before_it_is_held_only_where_refills_were_seen(lm, prompts, monkeypatch, seen):
    """A request arrives while a row is 2 tokens from its budget and no row has just finished (an
    open loop's arrival): on a target that has seen no refill (the prior: every finish a drain)
    it is admitted at once; where refills were seen it waits for that row. Streams equal solo."""
    control.forget(lm.target)
    for _ in range(3 if seen else 0):
        control.tally(lm.target).count(refill=True)
    held = recorded_holds(monkeypatch)
    try:
        run = drive(Engine(lm, EngineConfig(speculative=False)),
                    {0: [("a", prompts[0], P(8)), ("b", prompts[1], P(20))], 6: [("c", prompts[2], P(4))]})
    finally:
        control.forget(lm.target)
    check_solo(lm, run)
    assert any(held) is seen


def test_a_closed_loops_first_refill_is_seen_as_it_happens(lm, prompts):
    """Nothing seen on this target yet: the first finish whose place a waiting request takes
    counts as a refill already (drain.Refills.refilled), so the first wave's refills are grouped too."""
    control.forget(lm.target)
    try:
        assert plain_prefills(lm, prompts, [8, 10], waves=2) == [2, 2]
    finally:
        control.forget(lm.target)


def test_speculating_closed_loop_holds_and_every_stream_equals_solo(lm, prompts, refilled, monkeypatch):
    """K = 1 every round (rows finish apart by what each accepts), three clients with one budget:
    admission holds at least once, never more than HOLD_ROUNDS rounds running, and every stream
    equals its solo plain stream."""
    held = recorded_holds(monkeypatch)
    eng = Engine(lm, EngineConfig(num_draft_tokens=1, width_cap=0), switches=Switches(control=False))
    calls: list = []
    try:
        sent = closed_loop(eng, prompts, [12, 12, 12], waves=3, calls=calls)
    finally:
        eng.close()
    assert any(held)
    runs = "".join("h" if h else "." for h in held)
    assert "h" * (admission.HOLD_ROUNDS + 1) not in runs
    assert sum(calls) == 9
    assert len(sent) == 9
    for prompt, params, stream in sent.values():
        assert stream.done and stream.result.finish_reason == "length"
        matches_solo(lm, prompt, params, stream.result.tokens)


def test_held_plans_agree_across_ranks():
    """A held plan's flag is part of what ranks compare (gmlx/distributed/messages.py)."""
    from gmlx.distributed.messages import encode_plan

    p = Plan((), 0, False, Round.PLAIN)
    assert encode_plan(p) != encode_plan(dataclasses.replace(p, held=True))
