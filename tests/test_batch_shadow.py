"""A gated batch keeps its drafter and measures what its drafts would accept (gmlx/decode/batch_shadow.py):
the plain steps' hidden states go to the drafter, its replay's proposals become K = 1 records at
the batch's width. Each proposal is its entry's first draft (tie-aware against the drafter run
alone); every emitted position is recorded once per row; the control resumes on those records and
only on them, forced both ways, on the test model and on SmolLM2; tokens never move."""

import mlx.core as mx
import numpy as np
import pytest

from engine_helpers import P, check_solo, drive
from numerics import tie_margin
from test_control import forced, on
from gmlx.decode import batch_shadow
from gmlx.decode.batch import BatchLoop
from gmlx.decode.prefill import Prefiller, prefill_row
from gmlx.drafters.base import take_rows_at
from gmlx.drafters.select import select_drafter
from gmlx.engine import lanes
from gmlx.engine.oracle import make_row
from gmlx.policy import control, width_control
from gmlx.policy.admission import Transition
from gmlx.policy.figures import DECAY, Acceptance

LM_WITHOUT_EOS = True  # budgets alone end these requests


def _alone_first_draft(lm, drafter, prompt, tokens: list[int], j: int) -> np.ndarray:
    """The head's logits for the first draft after the prompt and tokens[:j], the drafter run
    alone on one row (its prompt's entries, then each plain step's hidden state committed)."""
    row = make_row(lm, prompt, P(len(tokens)))
    pre = prefill_row(lm.target, row, 512, want_hidden=True)
    st = drafter.start([row], [pre])
    if j:
        _, hidden = lm.target(mx.array([[prompt[-1], *tokens[:j - 1]]], dtype=mx.int32), pre.cache)
        drafter.commit(st, 0, np.array([j - 1]), hidden, mx.array([tokens[:j]], dtype=mx.int32))
    out = drafter._absorb(st)
    return np.array(drafter.head.logits(take_rows_at(out, np.array([int(st.lengths[0]) - 1])))[0, 0])  # sync: test


def test_the_batch_shadow_records_each_row_and_position_once_as_its_first_draft_would_fare(lm, prompts):
    """A batch of 3 formed gated with shadow rounds, stepped plain as the lanes step it (read,
    then dispatch): per row, one record per emitted position after the first, in order, each
    accepted exactly when the drafter's first draft there, drafted alone, is the emitted token
    (unless its top-2 logits are within the tie margin)."""
    drafter = select_drafter(lm, "mtp")
    n = 26
    made = [make_row(lm, p, P(n)) for p in prompts[3:6]]
    for i, r in enumerate(made):
        r.rid = i
    prompt_of = {r.rid: p for r, p in zip(made, prompts[3:6])}
    rows, cache, pres = Prefiller(lm.target, None, 512).prefill_many(made, want_hidden=True)
    batch = BatchLoop(lm.target, drafter)
    batch.add(rows, cache, pres, arm=False, shadow=True)
    assert batch.shadow is not None
    records: list[tuple[int, int]] = []
    seen = {r.rid: [] for r in rows}
    proposed = {r.rid: {} for r in rows}
    real_read = batch_shadow.BatchShadow.read

    for i in range(n):
        res = batch.plain_round(successor=i < n - 1)
        for r, rr in zip(rows, res):
            r.tokens.extend(rr.tokens)
        before = {r.rid: dict(batch.shadow.proposals[r.rid]) for r in rows}
        got = real_read(batch.shadow, rows)
        for r in rows:  # which positions were recorded: those proposed and emitted
            now = batch.shadow.proposals[r.rid]
            seen[r.rid] += sorted(q for q in before[r.rid] if q not in now)
            proposed[r.rid].update((q, t) for q, t in before[r.rid].items() if q not in now)
        records += got
        batch.shadow.dispatch(rows)
    assert records and all(d == 1 for d, _ in records)
    for r in rows:
        pos = seen[r.rid]
        assert pos == sorted(set(pos)) and len(pos) > n - 3 * batch_shadow.SHADOW_EVERY, pos
    # each recorded position against the drafter alone (a few positions per row: a forward each)
    ties = checked = 0
    for r in rows:
        prompt = prompt_of[r.rid]
        for q in seen[r.rid][::5]:
            j = q - len(prompt)  # the proposal for tokens[j], after tokens[:j]
            logits = _alone_first_draft(lm, drafter, prompt, r.tokens, j)
            top2 = np.sort(logits)[-2:]
            if top2[1] - top2[0] < tie_margin():
                ties += 1
                continue
            checked += 1
            agree = int(np.argmax(logits)) == r.tokens[j]
            assert agree == (proposed[r.rid][q] == r.tokens[j]), (r.rid, q)
    assert checked > ties


def _gated_with_no_agreement(lm, arrivals, monkeypatch, shadows: bool, drafter: str | None = "mtp"):
    """A batch whose drafts pay (a draft round timed at 1.2 plain ones), the control unpinned,
    its exploration out of reach; each time it gates (the control's plain window first) its
    width's acceptance and tokens per round are replaced by figures that say its drafts never
    agree, so the control decides plain after the window. Only what its drafts are seen to
    accept while gated can resume it. Returns the engine's rounds (step, kind, drafted) from the
    first gate on; every stream checked against its solo plain decode."""
    forced(monkeypatch, 1.2)
    monkeypatch.setattr(width_control, "FAR", 100.0)
    monkeypatch.setattr(width_control, "EXPLORE_FIRST", 10 ** 6)
    monkeypatch.setattr(width_control, "EXPLORE_SOON", 10 ** 6)
    monkeypatch.setattr(batch_shadow, "SHADOWS", shadows)
    real = lanes.Lanes.apply

    def apply(self, t, plan, pop):
        real(self, t, plan, pop)
        if t is Transition.GATE:
            wc = self.spec.control.at(self.batch.width + plan.admit)
            wc.acceptance = Acceptance(0.01, 12.0, rounds=20, decay=DECAY)
            wc.spec.tokens.clear()
            wc.spec.memo.clear()

    monkeypatch.setattr(lanes.Lanes, "apply", apply)
    eng = on(lm, drafter=drafter)
    run = drive(eng, arrivals)
    check_solo(lm, run)
    eng.close()
    kinds = [(e.round, sum(d for _, d, _, _ in e.rows)) for _, e in run.rounds()]
    first_plain = next(i for i, (_, d) in enumerate(kinds) if d == 0 and i > 0)
    return kinds[first_plain:]


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("shadows", [True, False])
def test_a_gated_batch_resumes_on_what_its_shadow_rounds_accept(lm, prompts, clean, monkeypatch, seeded, shadows):
    p = (lambda i: P(110, seed=i, t=0.7)) if seeded else (lambda i: P(110))
    after = _gated_with_no_agreement(lm, {0: [("a", prompts[6], p(1)), ("b", prompts[7], p(2))]}, monkeypatch,
                                     shadows)
    assert after[0][1] == 0
    assert (sum(d for _, d in after) > 0) is shadows, after


@pytest.mark.parametrize("shadows", [True, False])
def test_smollm2_a_gated_batch_resumes_on_what_its_shadow_rounds_accept(smollm2, monkeypatch, shadows):
    """The same on the real model with its default drafter, the shipped EAGLE-3 head (greedy)."""
    lm = smollm2.load("float32")
    control.forget(lm.target)
    enc = lm.tokenizer.encode
    try:
        after = _gated_with_no_agreement(lm, {0: [("a", enc("Write a Python function that reverses a list."), P(64)),
                                                  ("b", enc("Write a Python function that sums a list."), P(64))]},
                                         monkeypatch, shadows, drafter=None)
    finally:
        control.forget(lm.target)
    assert after[0][1] == 0
    assert (sum(d for _, d in after) > 0) is shadows, after


def test_a_resume_continues_the_state_the_shadow_rounds_kept(lm, prompts, clean, monkeypatch):
    """The capture round after a shadowed stretch arms the drafter with the shadow's state (its
    whole history), not a cold start; without shadows, a fresh capture."""
    seen = []
    real = BatchLoop.capture_round

    def capture_round(self):
        kept = self.shadow.state if self.shadow is not None else None
        out = real(self)
        seen.append(kept is not None and self.draft is kept)
        return out

    monkeypatch.setattr(BatchLoop, "capture_round", capture_round)
    _gated_with_no_agreement(lm, {0: [("a", prompts[6], P(110)), ("b", prompts[7], P(110))]}, monkeypatch, True)
    assert True in seen, seen


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_random_gates_and_resumes_with_shadows_keep_every_stream(lm, prompts, clean, monkeypatch, seed):
    """The control's plain widths drawn at random every step (gates, resumes, admissions and
    finishes into and out of shadowed stretches, a replay's consumed state merged with newcomers):
    the shadow's state always has the batch's rows, and every stream equals its solo plain decode."""
    import random

    from gmlx.engine import speculation

    rng = random.Random(seed)
    monkeypatch.setattr(speculation.Speculation, "plain_widths",
                        lambda self, width, rows, queued: frozenset(w for w in range(1, 9) if rng.random() < 0.5))
    eng = on(lm, drafter="mtp")
    widths = []

    def check(run):
        b = eng.lanes.batch
        if b.shadow is not None:
            widths.append(eng.lanes.drafter.width(b.shadow.state) == len(b.rows))

    arrivals = {step: [(f"{step}-{i}", prompts[(step + i) % len(prompts)], P(rng.choice([6, 12, 20])))
                       for i in range(rng.choice([1, 2]))] for step in range(0, 40, 2)}
    run = drive(eng, arrivals, before_step=check)
    check_solo(lm, run)
    eng.close()
    assert widths and all(widths), widths


def test_a_merge_after_a_replay_consumed_every_pending_entry(lm, prompts):
    """MTPDrafter.merge into a state with nothing pending (a shadow's replay consumed it): one
    pending row per row, the newcomers' after (a gated batch admitting rows right after a replay)."""
    drafter = select_drafter(lm, "mtp")
    made = [make_row(lm, p, P(8)) for p in prompts[:3]]
    for i, r in enumerate(made):
        r.rid = i
    rows, _, pres = Prefiller(lm.target, None, 512).prefill_many(made[:2], want_hidden=True)
    st = drafter.start(rows, pres)
    assert drafter.replay_rows(st) is not None and st.hidden is None
    new_rows, _, new_pres = Prefiller(lm.target, None, 512).prefill_many(made[2:], want_hidden=True)
    merged = drafter.merge(st, drafter.start(new_rows, new_pres))
    assert merged.hidden.shape[0] == merged.tokens.shape[0] == len(merged.lengths) == 3 == merged.cache.batch_size
    assert merged.lengths[:2].tolist() == [0, 0] and merged.lengths[2] == new_pres[0].hidden.shape[1]
