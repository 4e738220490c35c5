"""Cancellation in every state a request can be in (queued, mid-prefill, scalar mid-round, batched
armed, gated, during a capture round, right after a preempt): the cancelled stream leaves at the
next step boundary with finish reason "cancelled" and a prefix of its solo stream; every other
stream equals its solo plain stream; the row's target and drafter state are gone once reaped;
after the run, MLX's active memory is back at its value before the requests.

mx.get_active_memory() does report the CPU backend's allocations (checked here: it tracks the
KV of a 3-row batch exactly and returns to the same byte count after the run).
"""

from dataclasses import dataclass, field
from typing import Callable

import pytest

from engine_helpers import active_memory, check_solo, drive, engine, P, solo, waiting
from gmlx.model_cache import cache_nbytes
from gmlx.engine.metrics import EventKind
from gmlx.engine.peers import Alone
from gmlx.policy.admission import Mode
from gmlx.engine.oracle import make_row

MEMORY_SLACK = 64 << 10  # bytes; one leaked row of this model's KV is ~1.4 MB at capacity 256


LM_WITHOUT_EOS = True  # budgets (and cancels) alone end these requests: see conftest.lm




def footprint(eng) -> dict:
    """What the engine holds per row: batch rows, the batch dimension of every target and drafter
    array, the target KV's bytes and capacity, and the scalar loop's request."""
    b = eng.batch
    d = getattr(b.draft, "inner", b.draft)  # under the predicted-output wrapper (gmlx/drafters/prediction.py)
    draft_rows = None
    if d is not None:
        draft_rows = {d.hidden.shape[0], d.tokens.shape[0]}
        if hasattr(d, "cache"):  # the MTP head's own KV (the default assistant keeps none)
            draft_rows |= {len(d.lengths), d.cache.batch_size}
            if d.cache.keys is not None:
                draft_rows.add(d.cache.keys.shape[0])
    return dict(rids=[r.rid for r in b.rows], width=len(b.rows),
                kv_rows={c.keys.shape[0] for c in b.cache if c.keys is not None} | {c.batch_size for c in b.cache},
                draft_rows=draft_rows, nbytes=cache_nbytes(b.cache), capacity=b.cache[0].capacity if b.cache else 0,
                scalar=None if eng.scalar.seq is None else eng.scalar.seq.row.rid)


class ReapWatch(Alone):
    """The engine's peers (gmlx/engine/peers.py), given to it as a parameter: the footprint just
    before and after the step's decision that ended `rid` (a decision reaps the step's
    cancellations, then plans; planning changes no footprint)."""

    def __init__(self):
        self.eng, self.rid, self.at = None, None, None

    def agree(self, take, decide):
        def watched(inputs):
            before = footprint(self.eng)
            plan = decide(inputs)
            if self.at is None and self.rid is not None and self.eng.service.stream(self.rid) is None:
                self.at = (before, footprint(self.eng))  # the decision that ended it (its stream is closed)
            return plan
        return super().agree(take, watched)


@dataclass
class Case:
    cap: int
    arrivals: dict  # step -> [(label, prompt index, params)]
    victim: str
    hook: Callable  # hook(eng, ctx) -> before_step(run) or None; cancels the victim, sets ctx["reached"]
    preempt: bool = True
    ctx: dict = field(default_factory=dict)


def _cancel(eng, ctx, rid, *, during_step: bool):
    """Cancel request `rid` now; it must leave at this step's reap (before a step) or the next one."""
    eng.service.stream(rid).cancel()
    ctx["rid"] = rid
    ctx["reap_at"] = ctx["run"].step_no + (1 if during_step else 0)


def queued(eng, ctx):
    def before(run):
        if run.step_no == 4 and "rid" not in ctx:
            ctx["reached"] = waiting(eng, run.rid("b")) and eng.mode is Mode.SCALAR
            _cancel(eng, ctx, run.rid("b"), during_step=False)
    return before


def in_prefill(method):
    def hook(eng, ctx):
        real = getattr(eng.prefiller, method)

        def wrapped(rows, want_hidden):
            row = rows[0] if isinstance(rows, list) else rows
            if "rid" not in ctx:
                ctx["reached"] = method
                _cancel(eng, ctx, row.rid, during_step=True)
            return real(rows, want_hidden)
        setattr(eng.prefiller, method, wrapped)
    return hook


def in_scalar_round(eng, ctx):
    real, calls = eng.scalar.round, []

    def wrapped(last=False):
        rid = eng.scalar.row.rid
        calls.append(rid)
        if len(calls) == 3:
            ctx["reached"] = eng.mode is Mode.SCALAR
            _cancel(eng, ctx, rid, during_step=True)
        return real(last)
    eng.scalar.round = wrapped


def at_boundary(mode, lookahead):
    def hook(eng, ctx):
        def before(run):
            if run.step_no == 3 and "rid" not in ctx:
                ctx["reached"] = eng.mode is mode and (eng.batch.lookahead is not None) == lookahead
                _cancel(eng, ctx, run.rid("a"), during_step=False)
        return before
    return hook


def in_capture_round(eng, ctx):
    real = eng.batch.capture_round

    def wrapped():
        if "rid" not in ctx:
            ctx["reached"] = eng.counters.transitions["resume"] == 1
            _cancel(eng, ctx, eng.batch.rows[-1].rid, during_step=True)
        return real()
    eng.batch.capture_round = wrapped


def after_preempt(eng, ctx):
    def listener(ev):
        if ev.kind is EventKind.TRANSITION and ev.transition == "preempt" and "rid" not in ctx:
            ctx["reached"] = eng.batch.rows[0].preempted
            _cancel(eng, ctx, eng.batch.rows[0].rid, during_step=True)
    eng.listeners.append(listener)


TRIO = {0: [("a", 41, P(30, 1, 0.8)), ("b", 42, P(12, 2)), ("c", 43, P(10, 3))]}
CASES = {
    "queued": Case(0, {0: [("a", 38, P(14))], 2: [("b", 39, P(10, 1)), ("c", 40, P(8, 2))]}, "b", queued,
                   preempt=False),
    "prefill-scalar": Case(0, {0: [("a", 0, P(20, 1, 0.8))], 2: [("c", 1, P(10, 2))]}, "a", in_prefill("prefill")),
    "prefill-batch": Case(0, TRIO, "a", in_prefill("prefill_many")),
    "scalar-round": Case(0, {0: [("a", 2, P(30, 1, 0.8))], 1: [("b", 3, P(10, 2))]}, "a", in_scalar_round,
                         preempt=False),
    "batched-armed": Case(0, TRIO, "a", at_boundary(Mode.BATCHED, lookahead=False)),
    "gated": Case(1, TRIO, "a", at_boundary(Mode.GATED, lookahead=True)),
    "capture-round": Case(2, {0: [("a", 4, P(6)), ("b", 5, P(30, 1, 0.8)), ("c", 6, P(30, 2))]}, "c",
                          in_capture_round),
    "after-preempt": Case(0, {0: [("a", 7, P(30, 1, 0.8))], 2: [("b", 8, P(12, 2)), ("c", 9, P(10, 3))]}, "a",
                          after_preempt),
}


@pytest.mark.parametrize("name", list(CASES))
def test_cancel_in_every_state(lm, prompts, name):
    case = CASES[name]
    arrivals = {s: [(label, prompts[i], sp) for label, i, sp in reqs] for s, reqs in case.arrivals.items()}
    for reqs in arrivals.values():  # references first: the memory baseline is taken after them
        for _, prompt, sp in reqs:
            solo(lm, prompt, sp)
    spy = ReapWatch()
    eng = spy.eng = engine(lm, case.cap, preempt=case.preempt, prompt_cache_bytes=0, peers=spy)
    ctx = {}
    before_hook = case.hook(eng, ctx)

    def before(run):
        ctx["run"] = run
        spy.rid = ctx.get("rid")
        if before_hook is not None:
            before_hook(run)
        spy.rid = ctx.get("rid")

    baseline = active_memory()
    run = drive(eng, arrivals, before_step=before)
    assert ctx.get("reached"), f"{name}: the cancel did not happen in the intended state ({ctx.get('reached')!r})"
    assert ctx["rid"] == run.rid(case.victim)

    rec = run.streams[case.victim].wait(1)
    assert rec.finish_reason == "cancelled" and rec.error is None
    assert len(rec.tokens) < run.reqs[case.victim].params.max_tokens
    check_solo(lm, run, cancelled_prefix=True)  # the others are whole and equal their solo streams
    assert all(run.streams[l].result.finish_reason == "length" for l in run.streams if l != case.victim)

    # it left at the next boundary and never ran again
    victim_rounds = run.rounds_of(case.victim)
    assert all(step < ctx["reap_at"] for _, step, *_ in victim_rounds)
    if name == "queued":
        assert victim_rounds == [] and rec.tokens == []
    else:
        assert run.finish_step(case.victim) == ctx["reap_at"]
        before_reap, after_reap = spy.at
        assert ctx["rid"] in before_reap["rids"] or before_reap["scalar"] == ctx["rid"]
        assert ctx["rid"] not in after_reap["rids"] and after_reap["scalar"] != ctx["rid"]
        if ctx["rid"] in before_reap["rids"]:  # a batch row: its slots in every array are gone
            w = after_reap["width"]
            assert w == before_reap["width"] - 1
            assert after_reap["kv_rows"] <= {w} and after_reap["draft_rows"] in (None, {w})
            if w:  # smaller for the same capacity: bytes per cache position shrink with the width
                assert after_reap["nbytes"] / after_reap["capacity"] < before_reap["nbytes"] / before_reap["capacity"]
            else:
                assert after_reap["nbytes"] == 0

    assert eng.mode is Mode.IDLE and eng.batch.cache == [] and eng.scalar.seq is None
    assert active_memory() - baseline <= MEMORY_SLACK
    eng.close()


def test_cancelled_rows_are_not_offered_to_the_prompt_cache(lm, prompts):
    eng = engine(lm, 0)

    def cancel(label, at):
        def before(run):
            if run.step_no == at:
                run.streams[label].cancel()
        return before

    batch = drive(eng, {0: [("a", prompts[10], P(20)), ("b", prompts[11], P(6, 1))]}, before_step=cancel("a", 3))
    scalar = drive(eng, {0: [("s", prompts[12], P(20, 2))]}, before_step=cancel("s", 2))
    assert batch.streams["a"].result.finish_reason == "cancelled"  # a batch row
    assert scalar.streams["s"].result.finish_reason == "cancelled" and scalar.transitions() == ["start_scalar"]
    keys = eng.prompt_cache.keys()
    assert any(k[: len(prompts[11])] == tuple(prompts[11]) for k in keys)  # the finished one was offered
    for prompt in (prompts[10], prompts[12]):
        assert not any(k[: len(prompt)] == tuple(prompt) for k in keys)
    # the rule itself: only a row that ended on its own is reusable
    for reason, wanted in (("length", True), ("stop", True), ("cancelled", False), ("error", False)):
        row = make_row(lm, prompts[13], P(4))
        row.finish_reason = reason
        assert eng.prefiller.wants(row) is wanted, reason
    eng.close()
