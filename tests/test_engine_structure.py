"""Structural checks of the dual-loop engine (docs/design.md §2, §7): which rounds run, in which order,
what the drafter may touch, and where the transitions put each request's tokens.

Every test drives `Engine.step()` in this thread and also checks the streams against their solo
plain references, so a structural pass never hides a content failure.
"""

import pytest

from engine_helpers import check_solo, drive, engine, P, solo, waiting
from gmlx.model_cache import row_lengths
from gmlx.engine.metrics import EventKind
from gmlx.policy.admission import Mode


LM_WITHOUT_EOS = True  # budgets (and cancels) alone end these requests: see conftest.lm



def full_length(lm, prompt, params):
    """Precondition: the solo stream runs to its budget, so budgets decide the schedule."""
    assert len(solo(lm, prompt, params)) == params.max_tokens, "fixture: pick a prompt that does not stop early"


def kinds_after(run, step):
    """Round kinds of the steps after `step`, one per step (the batch runs one round per step)."""
    return [e.round for i, e in run.rounds() if i > step]


def transitions_at(run, step):
    return [e.transition for e in run.steps[step] if e.kind is EventKind.TRANSITION]


class GuardedHead:
    """Stands in for the drafter's MTP head (the scalar and batch loops share it): any use while
    a batch is not armed (gated rounds, the gate round itself, capture rounds) raises. Counts the
    armed batch uses: calls, and attribute reads (the assistant drafter reads `head.attend` at
    every draft step; its compiled query and finish replay graphs without calling the head)."""

    def __init__(self, head, eng):
        self._head, self._eng, self.calls = head, eng, 0

    def _check(self, what):
        if self._eng.mode not in (Mode.BATCHED, Mode.SCALAR):
            raise AssertionError(f"drafter {what} while the batch is {self._eng.mode.value}")

    def __call__(self, *args, **kwargs):
        self._check("called")
        self.calls += self._eng.mode is Mode.BATCHED
        return self._head(*args, **kwargs)

    def __getattr__(self, name):
        self._check(f"attribute .{name} read")
        self.calls += self._eng.mode is Mode.BATCHED
        return getattr(self._head, name)


# ---- (1) gated rounds never draft -----------------------------------------------------------
@pytest.mark.parametrize("cap,arrive", [(2, {0: [0], 3: [1], 6: [2], 9: [3, 4]}), (1, {0: [0], 3: [1, 2]})],
                         ids=["gate-by-admission", "preempt-over-cap"])
def test_gated_rounds_never_touch_the_drafter(lm, prompts, cap, arrive):
    """Armed -> gated by an admission over the cap -> re-armed; or preempted straight into a gated
    batch. While gated (including the gate round and the capture round) the head is never used."""
    eng = engine(lm, cap, resume_min_remaining=4)
    guard = eng.batch.drafter.head = GuardedHead(eng.batch.drafter.head, eng)
    budgets = [64, 12, 22, 16, 14]  # request 0 outlives the others, so the drained batch can re-arm
    arrivals = {s: [(i, prompts[30 + i], P(budgets[i], seed=i, t=0.8 * (i % 2))) for i in ids]
                for s, ids in arrive.items()}
    run = drive(eng, arrivals)
    check_solo(lm, run)
    tr = run.transitions()
    assert "gate" in tr and "resume" in tr, tr  # it was gated, and armed again afterwards
    if cap == 2:
        assert tr[:3] == ["start_scalar", "preempt", "capture"] and "gate" in tr[3:], tr  # armed, then gated
        gate_step = next(i for i, e in run.events() if e.transition == "gate")
        assert any(e.kind is EventKind.ROUND and e.width == 3 and e.round == "plain" for e in run.steps[gate_step])
    assert guard.calls > 0  # the armed rounds did draft through the guard
    for _, e in run.rounds():
        if e.round in ("plain", "plain_last", "capture"):
            assert all(d == 0 for _, d, _, _ in e.rows)


# ---- (2) gated -> plain_last -> capture -> speculative -------------------------------------
def test_resume_sequence_and_capture_round(lm, prompts):
    eng = engine(lm, 2)
    reqs = [("a", prompts[0], P(6)), ("b", prompts[1], P(30, 1, 0.8)), ("c", prompts[2], P(30, 2))]
    for _, p, sp in reqs:
        full_length(lm, p, sp)
    state = {}

    def watch(run):  # boundary state right after each step
        if run.step_no:
            state[run.step_no - 1] = (eng.mode, eng.batch.lookahead is not None,
                                      [(len(r.prompt), len(r.tokens)) for r in eng.batch.rows],
                                      list(row_lengths(eng.batch.cache)), eng.batch.armed)

    run = drive(eng, {0: reqs}, before_step=watch)
    check_solo(lm, run)
    fa = run.finish_step("a")
    assert run.transitions()[:2] == ["form_batch", "gate"]
    assert kinds_after(run, -1)[: fa + 1] == ["plain"] * (fa + 1)
    # the drained batch: one plain round consuming the lookahead, a capture round, then speculation
    assert kinds_after(run, fa)[:3] == ["plain_last", "capture", "speculative"]
    assert transitions_at(run, fa + 1) == []
    assert transitions_at(run, fa + 2) == ["resume", "capture"]
    # KV at the boundaries: lookahead in flight -> prompt + emitted; consumed -> prompt + emitted - 1
    mode, la, rows, kv, armed = state[fa]
    assert mode is Mode.GATED and la and kv == [p + n for p, n in rows]
    mode, la, rows, kv, armed = state[fa + 1]
    assert mode is Mode.GATED and not la and not armed and kv == [p + n - 1 for p, n in rows]
    mode, la, rows, kv, armed = state[fa + 2]
    assert mode is Mode.BATCHED and armed and kv == [p + n - 1 for p, n in rows]
    (_, cap_round), = [(i, e) for i, e in run.rounds() if i == fa + 2]
    assert cap_round.width == 2 and [(d, n) for _, d, _, n in cap_round.rows] == [(0, 1), (0, 1)]
    (_, spec), = [(i, e) for i, e in run.rounds() if i == fa + 3]
    assert all(d == eng.k for _, d, _, _ in spec.rows)


# ---- (3) near-budget skip -------------------------------------------------------------------
@pytest.mark.parametrize("rmr,resumes", [(8, False), (4, True)])
def test_no_resume_near_budget(lm, prompts, rmr, resumes):
    """After `a` finishes, b and c have 6 tokens left: with resume_min_remaining 8 the batch
    stays plain to the end; with 4 it re-arms."""
    eng = engine(lm, 2, resume_min_remaining=rmr)
    reqs = [("a", prompts[3], P(6)), ("b", prompts[4], P(12, 1)), ("c", prompts[5], P(12, 2, 0.8))]
    for _, p, sp in reqs:
        full_length(lm, p, sp)
    run = drive(eng, {0: reqs})
    check_solo(lm, run)
    tr = run.transitions()
    if resumes:
        assert "resume" in tr and "capture" in tr
    else:
        assert "resume" not in tr and "capture" not in tr, tr
        assert set(kinds_after(run, -1)) == {"plain"}


def test_no_resume_while_any_row_is_near_its_budget(lm, prompts):
    """One row near its budget blocks the re-arm even though the other has plenty left; the
    re-arm comes once that row has finished."""
    eng = engine(lm, 2, resume_min_remaining=8)
    reqs = [("a", prompts[6], P(6)), ("b", prompts[7], P(12, 1)), ("c", prompts[8], P(36, 2))]
    for _, p, sp in reqs:
        full_length(lm, p, sp)
    run = drive(eng, {0: reqs})
    check_solo(lm, run)
    fb = run.finish_step("b")
    resume_steps = [i for i, e in run.events() if e.transition == "resume"]
    assert resume_steps and min(resume_steps) > fb, (resume_steps, fb)
    assert set(kinds_after(run, -1)[: fb + 1]) == {"plain"}


# ---- (4) same-round admission beats a pending resume ---------------------------------------
@pytest.mark.parametrize("cap", [2, 3])
def test_admission_beats_pending_resume(lm, prompts, cap):
    """The drained batch consumed its lookahead (plain_last): a resume is due this step. A
    request arriving now is admitted first; the batch stays gated this round (cap 2: the new
    width is over the cap; cap 3: newcomers join a gated batch unarmed)."""
    eng = engine(lm, cap)
    reqs = [("a", prompts[9], P(5)), ("b", prompts[10], P(30, 1)), ("c", prompts[11], P(30, 2, 0.8))]
    if cap == 3:
        reqs.append(("x", prompts[12], P(5, 3)))
    for _, p, sp in reqs:
        full_length(lm, p, sp)
    injected = {}

    def inject(run):
        last = run.steps[-1] if run.steps else []
        if not injected and any(e.kind is EventKind.ROUND and e.round == "plain_last" for e in last):
            injected["at"] = run.step_no
            run.submit("d", prompts[13], P(20, 4))

    run = drive(eng, {0: reqs}, before_step=inject)
    check_solo(lm, run)
    at = injected["at"]
    assert transitions_at(run, at - 1) == []  # the plain_last round was the resume path's
    assert "resume" not in transitions_at(run, at)
    (kind, width), = [(e.round, e.width) for i, e in run.rounds() if i == at]
    assert kind == "plain" and width == 3
    assert run.first_emission("d") == len([1 for i, _ in run.rounds() if i < at])  # admitted this round
    for _, e in run.rounds():
        assert e.round != "speculative" or e.width <= cap


# ---- (5) PREEMPT=0: waiters wait -----------------------------------------------------------
def test_preempt_off_waiters_wait(lm, prompts):
    eng = engine(lm, 0, preempt=False)
    run = drive(eng, {0: [("a", prompts[14], P(24))],
                      2: [("b", prompts[15], P(10, 1)), ("c", prompts[16], P(8, 2, 0.8))]})
    check_solo(lm, run)
    assert "preempt" not in run.transitions()
    last_a = run.last_emission("a")
    assert run.first_emission("b") > last_a and run.first_emission("c") > last_a
    assert {m for _, _, m, *_ in run.rounds_of("a")} == {"scalar"}
    # the waiters start right after the incumbent's finish, as a batch
    fa = run.finish_step("a")
    assert transitions_at(run, fa + 1)[0] == "form_batch"


# ---- (6) RESUME=0: a drained batch stays plain ---------------------------------------------
@pytest.mark.parametrize("cap,arrive", [(2, {0: ["a", "b", "c"]}), (1, {0: ["b"], 2: ["a"]})],
                         ids=["formed-over-cap", "preempted-over-cap"])
def test_resume_off_keeps_drained_batch_plain(lm, prompts, cap, arrive):
    eng = engine(lm, cap, resume=False)
    reqs = {"a": (prompts[17], P(6)), "b": (prompts[18], P(26, 1, 0.8)), "c": (prompts[19], P(24, 2))}
    run = drive(eng, {s: [(l, *reqs[l]) for l in ls] for s, ls in arrive.items()})
    check_solo(lm, run)
    tr = run.transitions()
    assert "gate" in tr and "resume" not in tr and "capture" not in tr, tr
    gate_step = next(i for i, e in run.events() if e.transition == "gate")
    assert set(kinds_after(run, gate_step - 1)) == {"plain"}
    assert eng.counters.transitions["resume"] == eng.counters.transitions["capture"] == 0


# ---- (7) preempt delivers the scalar round first, and the stream stays continuous -----------
@pytest.mark.parametrize("cap", [0, 1])
def test_preempt_order_and_continuity(lm, prompts, cap):
    eng = engine(lm, cap)
    before = {}  # step -> the scalar request's state at its start (a preempt is a step's first act)

    def watch(run):
        if eng.mode is Mode.SCALAR:
            row, stream = eng.scalar.seq.row, eng.service.stream(eng.scalar.seq.row.rid)
            before[run.step_no] = dict(row=row, emitted=len(row.tokens), delivered=stream.delivered,
                                       kv=eng.scalar.seq.cache[0].offset, prompt=len(row.prompt))

    run = drive(eng, {0: [("a", prompts[20], P(36, 5, 0.8))],
                      3: [("b", prompts[21], P(12, 1)), ("c", prompts[22], P(14, 2, 0.8))]}, before_step=watch)
    seen = before[next(i for i, e in run.events() if e.transition == "preempt")]
    seen["preempted"] = seen["row"].preempted
    check_solo(lm, run)  # the incumbent's stream is continuous across the preempt
    tr = run.transitions()
    assert tr[:2] == ["start_scalar", "preempt"] and (("gate" in tr) == (cap == 1))
    a_rounds = run.rounds_of("a")
    # three scalar rounds, then (waiters queued) one that reads the round in flight and starts none
    scalar = [r for r in a_rounds if r[2] in ("scalar", "scalar_last")]
    assert [r[2] for r in scalar] == ["scalar"] * 3 + ["scalar_last"] and scalar[-1][5] > 0
    last_scalar_round = scalar[-1][0]
    assert run.first_emission("b") > last_scalar_round and run.first_emission("c") > last_scalar_round
    # at the preempt every emitted token was already delivered, and the KV holds all but the bonus
    assert seen["emitted"] == sum(r[5] for r in scalar) == seen["delivered"] > 0
    assert seen["kv"] == seen["prompt"] + seen["emitted"] - 1
    assert seen["preempted"]
    # the preempt round itself carries the incumbent and the waiters
    first_batch = a_rounds[len(scalar)]
    assert first_batch[2] == ("plain" if cap == 1 else "capture") and first_batch[3] == 3


# ---- (8) every row finishes in the round while injections are queued ------------------------
@pytest.mark.parametrize("n_inject", [1, 2])
def test_all_rows_finish_with_injections_queued(lm, prompts, n_inject):
    eng = engine(lm, 1)  # gated: one token per row per round, so a and b finish together
    reqs = [("a", prompts[23], P(9)), ("b", prompts[24], P(9, 1, 0.8))]
    for _, p, sp in reqs:
        full_length(lm, p, sp)
    marks = {}

    def inject(run):
        rows = eng.batch.rows
        if not marks and rows and all(r.remaining == 1 for r in rows):
            marks["at"] = run.step_no
            for j in range(n_inject):
                run.submit(f"x{j}", prompts[25 + j], P(10, 10 + j, 0.8 * j))

    run = drive(eng, {0: reqs}, before_step=inject)
    check_solo(lm, run)
    at = marks["at"]
    assert run.finish_step("a") == run.finish_step("b") == at  # both finished in that round
    assert transitions_at(run, at + 1) == (["start_scalar"] if n_inject == 1 else ["form_batch", "gate"])
    for j in range(n_inject):
        assert run.streams[f"x{j}"].wait(1).finish_reason == "length"


# ---- (9) injected rows keep their own budgets -----------------------------------------------
@pytest.mark.parametrize("cap", [0, 2])
def test_injected_rows_keep_their_budgets(lm, prompts, cap):
    budgets = {"a": (0, 30), "b": (2, 5), "c": (4, 9), "d": (6, 13), "e": (6, 3), "f": (7, 1)}
    arrivals = {}
    for j, (label, (at, n)) in enumerate(budgets.items()):
        sp = P(n, 20 + j, 0.8 * (j % 2))
        full_length(lm, prompts[26 + j], sp)
        arrivals.setdefault(at, []).append((label, prompts[26 + j], sp))
    run = drive(engine(lm, cap), arrivals)
    check_solo(lm, run)
    for label, (_, n) in budgets.items():
        rec = run.streams[label].wait(1)
        assert len(rec.tokens) == n and rec.finish_reason == "length", (label, len(rec.tokens), n)
    if cap == 0:
        assert any(e.round == "speculative" and e.width >= 3 for _, e in run.rounds())


# ---- (10, 11) batch semantics after a preempt; the next request starts scalar ---------------
@pytest.mark.parametrize("cap", [0, 1])
def test_preempted_request_keeps_batch_semantics(lm, prompts, cap):
    eng = engine(lm, cap, resume_min_remaining=4)
    states = []

    def watch(run):
        rows = eng.batch.rows
        if len(rows) == 1 and run.streams and rows[0].rid == run.rid("a"):
            states.append((eng.mode, rows[0].state.value, rows[0].preempted))

    run = drive(eng, {0: [("a", prompts[32], P(36, 3, 0.8))], 2: [("b", prompts[33], P(4, 4))]}, before_step=watch)
    check_solo(lm, run)
    assert "preempt" in run.transitions()
    fb = run.finish_step("b")
    after = [r for r in run.rounds_of("a") if r[1] > fb]
    assert after and all(r[3] == 1 and r[2] not in ("scalar", "scalar_last") for r in after)  # width 1, batch loop
    assert any(r[2] == "speculative" and r[4] > 0 for r in after)  # it still drafts (greedy) at width 1
    kinds = [m for _, _, m, *_ in run.rounds_of("a")]
    lone = next(i for i, m in enumerate(kinds) if m not in ("scalar", "scalar_last"))  # scalar rounds come first
    assert lone >= 2 and set(kinds[lone:]) <= {"speculative", "capture", "plain", "plain_last"}
    assert states and all(m is not Mode.SCALAR and p for m, _, p in states)
    # the engine went idle: the next request starts in the scalar loop again
    run2 = drive(eng, {0: [("n", prompts[34], P(12, 5))]})
    check_solo(lm, run2)
    assert run2.transitions() == ["start_scalar"]
    assert {m for _, _, m, *_ in run2.rounds_of("n")} == {"scalar"}


def test_next_request_after_batch_drains_starts_scalar(lm, prompts):
    eng = engine(lm, 2)
    run = drive(eng, {0: [("a", prompts[35], P(8)), ("b", prompts[36], P(10, 1, 0.8))],
                      12: [("n", prompts[37], P(10, 2))]})
    check_solo(lm, run)
    fb = run.finish_step("b")
    assert fb < 12 and eng.mode is Mode.IDLE
    assert run.transitions() == ["form_batch", "start_scalar"]
    assert {m for _, _, m, *_ in run.rounds_of("n")} == {"scalar"}


# ---- (12) cancellation ----------------------------------------------------------------------
def test_cancel_queued_request(lm, prompts):
    eng = engine(lm, 0, preempt=False)  # the waiters stay queued behind the scalar request

    def cancel(run):
        if run.step_no == 4:
            assert eng.service.queued and waiting(eng, run.rid("b"))
            run.streams["b"].cancel()

    run = drive(eng, {0: [("a", prompts[38], P(14))], 2: [("b", prompts[39], P(10, 1)), ("c", prompts[40], P(8, 2))]},
                before_step=cancel)
    rec = run.streams["b"].wait(1)
    assert rec.finish_reason == "cancelled" and rec.tokens == []
    check_solo(lm, run, ["a", "c"])
    assert "form_batch" not in run.transitions()  # c ran alone, as a scalar request
    assert all(r[0] != run.rid("b") for _, e in run.rounds() for r in e.rows)


@pytest.mark.parametrize("cap,at", [(0, 3), (1, 3), (1, 0)], ids=["armed", "gated-lookahead", "scalar-with-waiters"])
def test_cancel_live_row(lm, prompts, cap, at):
    """Cancel a batched row (armed / gated with its lookahead in flight), or the scalar
    incumbent at the moment waiters would preempt it: the others still equal their solo streams
    and the cancelled stream is a prefix of its own."""
    eng = engine(lm, cap)

    def cancel(run):
        if run.step_no == at + 2:
            run.streams["a"].cancel()

    if at == 0:  # a runs scalar; b, c arrive at step 2 together with the cancel
        arrivals = {0: [("a", prompts[41], P(30, 1, 0.8))],
                    2: [("b", prompts[42], P(12, 2)), ("c", prompts[43], P(10, 3))]}
    else:
        arrivals = {0: [("a", prompts[41], P(30, 1, 0.8)), ("b", prompts[42], P(12, 2)), ("c", prompts[43], P(10, 3))]}
    run = drive(eng, arrivals, before_step=cancel)
    rec = run.streams["a"].wait(1)
    assert rec.finish_reason == "cancelled" and 0 < len(rec.tokens) < 30
    check_solo(lm, run, cancelled_prefix=True)
    ca = run.finish_step("a")
    assert ca == at + 2  # removed at the next boundary
    assert all(r[1] <= ca for r in run.rounds_of("a"))


# ---- speculation off: the plain scalar decoder must still be preempted ----------------------
def test_preempt_plain_scalar_decoder(lm, prompts):
    eng = engine(lm, 0, speculative=False)
    run = drive(eng, {0: [("a", prompts[44], P(30))], 3: [("b", prompts[45], P(8, 1)), ("c", prompts[46], P(8, 2))]})
    # (the streams themselves are right: test_engine_oracle.py::test_speculation_off)
    assert "preempt" in run.transitions()
    assert run.first_emission("b") < run.last_emission("a")
