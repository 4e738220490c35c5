"""A hypothesis state machine over the engine: random submits, steps, cancels and live cap
changes (GMLX_MTP_WIDTH_CAP, re-read every round), with the engine's invariants checked at
every round boundary:

- no token lost or duplicated: each finished stream equals its solo plain stream (tie-aware),
  each cancelled stream is a prefix of it, and never longer than max_tokens;
- the batch drafts only while width <= cap (cap 0: uncapped);
- rows move only along `ALLOWED` and their states agree with the engine's mode;
- pending-bonus KV: each live row's KV holds prompt + emitted - 1 positions, or prompt + emitted
  while a gated plain lookahead (which has appended the bonus) is in flight;
- counters never decrease.
"""

import os

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from engine_helpers import solo, with_eos
from gmlx import Engine, EngineConfig, SamplingParams
from gmlx.config import Switches
from gmlx.engine.metrics import EventKind
from gmlx.model_cache import row_lengths
from gmlx.row import ALLOWED, RowState
from gmlx.policy.admission import Mode
from numerics import compare_tokens

ENV = "GMLX_MTP_WIDTH_CAP"


def make_machine(lm, prompts, tally, preempt=True, resume=True):
    class EngineMachine(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.saved_env = os.environ.get(ENV)
            os.environ[ENV] = "2"
            self.eng = Engine(lm, EngineConfig(width_cap=None, resume_min_remaining=4),
                              switches=Switches(preempt=preempt, resume=resume))
            self.reqs = {}  # rid -> (prompt, params, stream)
            self.state_of = {}  # rid -> last seen RowState
            self.counters = self.eng.counters.snapshot()

        # ---- rules ------------------------------------------------------------------------
        @rule(p=st.integers(0, len(prompts) - 1), n=st.integers(1, 40), max_tokens=st.integers(4, 16),
              temp=st.sampled_from([0.0, 0.0, 0.8]), seed=st.integers(0, 3))
        def submit(self, p, n, max_tokens, temp, seed):
            prompt = prompts[p][:n]
            params = SamplingParams(max_tokens=max_tokens, temperature=temp, top_p=0.95 if temp else 1.0, seed=seed)
            stream = self.eng.submit(prompt, params, start=False)
            self.reqs[stream.request_id] = (prompt, params, stream)

        @initialize(p=st.integers(0, len(prompts) - 1), q=st.integers(0, len(prompts) - 1), seed=st.integers(0, 3))
        def tour(self, p, q, seed):
            """Every program starts with the engine's tour, whatever the random rules then draw (the
            coverage asserted by the tests must not depend on the programs Hypothesis derives from
            this source): a lone request (scalar), a waiter (preempt; capture and speculative
            rounds within cap 2), two more (gate: plain rounds)."""
            self.set_cap(2)
            self.submit(p, 24, 16, 0.8, seed)
            self._step()
            self.submit(q, 24, 12, 0.0, seed)
            for _ in range(4):
                self._step()
            self.submit(q, 12, 6, 0.0, seed + 1)
            self.submit(p, 12, 6, 0.0, seed + 2)
            for _ in range(3):
                self._step()

        @rule(n=st.integers(1, 3))
        def step(self, n):
            for _ in range(n):
                self._step()

        @precondition(lambda self: any(not s.done and not s.cancelled for _, _, s in self.reqs.values()))
        @rule(i=st.integers(0, 1 << 16))
        def cancel(self, i):
            live = [s for _, _, s in self.reqs.values() if not s.done and not s.cancelled]
            live[i % len(live)].cancel()

        @rule(cap=st.sampled_from([0, 1, 2, 3]))
        def set_cap(self, cap):
            os.environ[ENV] = str(cap)

        def _step(self):
            events = self.eng.step()
            cap = self.eng.cap_in_force.cap  # the decision this step's rounds ran under
            for e in events:
                if e.kind is EventKind.TRANSITION:
                    tally["transitions"].add(e.transition)
                if e.kind is EventKind.ROUND:
                    tally["rounds"].add(e.round)
                    tally["n_rounds"] += 1
                    if e.round == "speculative":
                        assert cap == 0 or e.width <= cap, f"drafted at width {e.width} over cap {cap}"
                    if e.round in ("plain", "plain_last", "capture"):
                        assert all(d == 0 for _, d, _, _ in e.rows)

        # ---- invariants (checked after every rule) ------------------------------------------
        @invariant()
        def counters_monotone(self):
            now = self.eng.counters.snapshot()
            assert all(now[k] >= v for k, v in self.counters.items()), (self.counters, now)
            self.counters = now

        @invariant()
        def states_follow_allowed_and_mode(self):
            eng = self.eng
            live = eng.live_rows()
            seen = {r.rid: r.state for r in live}
            waiting = [rid for rid, (_, _, s) in self.reqs.items() if not s.done and rid not in seen]
            assert eng.service.queued == len(waiting)  # every open request no lane holds is queued
            for rid, (_, _, s) in self.reqs.items():
                if s.done:
                    seen[rid] = RowState.DONE
            for rid, state in seen.items():
                old = self.state_of.get(rid, RowState.QUEUED)
                assert state is old or state in ALLOWED[old], f"row {rid}: {old} -> {state}"
                self.state_of[rid] = state
            assert all(self.state_of.get(rid, RowState.QUEUED) is RowState.QUEUED for rid in waiting)
            expect = {Mode.SCALAR: RowState.SCALAR, Mode.BATCHED: RowState.BATCHED, Mode.GATED: RowState.GATED}
            if eng.mode is Mode.IDLE:
                assert not live and not eng.batch.rows and eng.scalar.seq is None
            else:
                assert live and all(r.state is expect[eng.mode] for r in live), (eng.mode, [r.state for r in live])
                assert all(not r.is_done for r in live)  # finished rows leave at the boundary
            if eng.mode in (Mode.BATCHED, Mode.GATED):
                assert eng.batch.armed == (eng.mode is Mode.BATCHED)
                assert eng.scalar.seq is None

        @invariant()
        def kv_holds_all_but_the_bonus(self):
            eng = self.eng
            if eng.mode is Mode.SCALAR:
                row, flight = eng.scalar.seq.row, eng.scalar.flight
                extra = 0 if flight is None else flight.k + 1  # a dispatched round appended its inputs
                assert eng.scalar.seq.cache[0].offset == len(row.prompt) + len(row.tokens) - 1 + extra
            elif eng.mode in (Mode.BATCHED, Mode.GATED):
                extra = 1 if eng.batch.lookahead is not None else 0
                assert eng.batch.lookahead is None or eng.mode is Mode.GATED
                want = [len(r.prompt) + len(r.tokens) - 1 + extra for r in eng.batch.rows]
                assert list(row_lengths(eng.batch.cache)) == want, (eng.mode.value, extra, want)

        @invariant()
        def per_row_state_sized_to_the_batch(self):
            """Every per-row structure widens on admission and shrinks on filter (docs/design.md §7)."""
            b = self.eng.batch
            w = len(b.rows)
            if not w:
                assert b.cache == [] and b.draft is None and b.lookahead is None
                return
            assert all(c.batch_size == w for c in b.cache)
            assert b.rs is not None and b.rs.seeds.shape[0] == w
            if b.draft is not None:
                d = getattr(b.draft, "inner", b.draft)  # under the predicted-output wrapper
                assert b.drafter.width(b.draft) == w
                if hasattr(d, "cache"):  # the MTP head's own KV (the default assistant keeps none)
                    assert d.cache.batch_size == w and len(d.lengths) == w
                assert d.hidden is None or d.hidden.shape[0] == w
            if b.lookahead is not None:
                assert b.lookahead.shape[0] == w

        @invariant()
        def finished_streams_within_budget(self):
            for _, params, s in self.reqs.values():
                if s.done:
                    assert len(s.result.tokens) <= params.max_tokens

        def teardown(self):
            try:
                for _ in range(400):
                    if not self.eng.has_work:
                        break
                    self._step()
                    self.counters_monotone()
                    self.states_follow_allowed_and_mode()
                    self.kv_holds_all_but_the_bonus()
                assert not self.eng.has_work, "the engine did not drain"
                for rid, (prompt, params, s) in self.reqs.items():
                    assert s.done, f"request {rid} never finished"
                    rec = s.result
                    ref = solo(lm, prompt, params)
                    if s.cancelled and rec.finish_reason == "cancelled":
                        ref = ref[: len(rec.tokens)]
                    else:
                        assert rec.finish_reason in ("length", "stop"), rec
                    c = compare_tokens(lm, prompt, ref, rec.tokens, params)
                    assert c.ok, f"request {rid}: {c}\nsolo {ref}\ngot  {rec.tokens}"
                    assert len(rec.tokens) <= params.max_tokens
                    tally["finished" if rec.finish_reason != "cancelled" else "cancelled"] += 1
                    tally["stop"] += rec.finish_reason == "stop"
            finally:
                self.eng.close()
                if self.saved_env is None:
                    os.environ.pop(ENV, None)
                else:
                    os.environ[ENV] = self.saved_env

    return EngineMachine


SETTINGS = settings(max_examples=6, stateful_step_count=25, deadline=None)
SLOW = settings(max_examples=int(os.environ.get("GMLX_SM_EXAMPLES", "60")), stateful_step_count=50, deadline=None)


def new_tally():
    return {"rounds": set(), "transitions": set(), "n_rounds": 0, "finished": 0, "cancelled": 0, "stop": 0}


def test_engine_state_machine(lm, prompts):
    """Without EOS (budgets and cancels end the requests) so that the programs' shapes, and the
    coverage asserted below, do not depend on the retrainable embedded model."""
    tally = new_tally()
    run_state_machine_as_test(make_machine(with_eos(lm, ()), prompts, tally), settings=SETTINGS)
    # the random programs really exercised both loops and the transitions
    assert {"scalar", "speculative", "plain"} <= tally["rounds"], tally
    assert {"preempt", "gate"} <= tally["transitions"], tally
    assert tally["finished"] >= 8, tally


def test_engine_state_machine_frequent_eos(lm, prompts):
    """Common tokens (newline, indent, brackets) as EOS: many requests stop mid-round (scalar,
    speculative, gated, capture), never emitting the EOS token."""
    tally = new_tally()
    eos = {t for s in ("\n", "    ", " ", "(", ")", ":", ".") for t in lm.tokenizer.encode(s)}
    run_state_machine_as_test(make_machine(with_eos(lm, eos), prompts, tally),
                              settings=settings(SETTINGS, max_examples=4))
    assert tally["n_rounds"] >= 10 and tally["stop"] >= 3, tally


def test_engine_state_machine_switches_off(lm, prompts):
    tally = new_tally()
    run_state_machine_as_test(make_machine(with_eos(lm, ()), prompts, tally, preempt=False, resume=False),
                              settings=settings(SETTINGS, max_examples=4))
    assert "preempt" not in tally["transitions"] and "resume" not in tally["transitions"], tally
    assert tally["n_rounds"] >= 10, tally


@pytest.mark.slow
@pytest.mark.parametrize("preempt,resume", [(True, True), (False, True), (True, False)])
def test_engine_state_machine_long(lm, prompts, preempt, resume):
    """Longer programs (GMLX_SM_EXAMPLES examples, default 60): run with -m slow."""
    run_state_machine_as_test(make_machine(lm, prompts, new_tally(), preempt=preempt, resume=resume),
                              settings=SLOW)
