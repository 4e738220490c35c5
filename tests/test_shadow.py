"""A lone request decoding plain with its drafter kept measures what its drafts would accept
(gmlx/decode/shadow.py): the drafter replays the plain steps and each proposal is a K = 1 record
in the request's acceptance. The replay is each entry's first draft exactly (tie-aware against
one draft per entry); every position is recorded once; the control re-arms on those records,
and only on them, forced both ways; tokens never move."""

import mlx.core as mx
import numpy as np
import pytest

from engine_helpers import P, check_solo, drive
from numerics import tie_margin
from test_control import forced, on
from gmlx.decode import scalar, shadow
from gmlx.decode.plain import PlainDecoder
from gmlx.decode.prefill import prefill_row
from gmlx.drafters.base import take_rows_at
from gmlx.drafters.context_lookup import ContextLookup
from gmlx.drafters.select import select_drafter
from gmlx.engine.oracle import make_row
from gmlx.policy import control, width_control
from gmlx.policy.figures import DECAY, Acceptance
from gmlx.sampling import RowSampling

LM_WITHOUT_EOS = True  # budgets alone end these requests


class Records:
    """An acceptance that keeps its records: (drafted, accepted) in order."""

    def __init__(self):
        self.seen: list[tuple[int, int]] = []

    def record(self, drafted: int, accepted: int) -> None:
        self.seen.append((drafted, accepted))


def _first_draft_logits(drafter, row, pre, hidden, tokens, n):
    """The head's logits for the first draft after the prompt and the first n plain steps, drafted
    alone (a fresh state, the steps committed, the pending entries run as `draft` runs them)."""
    st = drafter.start([row], [pre])
    if n:
        drafter.commit(st, 0, np.array([n - 1]), hidden[:, :n], tokens[:, :n])
    out = drafter._absorb(st)
    return drafter.head.logits(take_rows_at(out, np.array([int(st.lengths[0]) - 1])))[0, 0]


def test_the_shadow_records_each_plain_position_once_as_its_first_draft_would_fare(lm, prompts):
    """Plain steps from a fresh prompt, the shadow dispatched every SHADOW_EVERY of them and read a
    step later (as the lane does): one record per emitted position, in order, each accepted
    exactly when the drafter's own first draft there (drafted alone) is the emitted token —
    unless its top-2 logits are within the tie margin."""
    drafter = select_drafter(lm, "mtp")
    n = 30
    row = make_row(lm, prompts[4], P(n))
    pre = prefill_row(lm.target, row, 512, want_hidden=True)
    rs = RowSampling.from_params([row.params], [row.seed])
    state = drafter.start([row], [pre])
    dec = PlainDecoder(lm.target, pre.cache, rs, row.prompt[-1], row.next_position, lambda: row.remaining,
                       keep_hidden=True)
    sh, rec, steps = shadow.Shadow(row.next_position), Records(), []
    for i in range(n):
        sh.read(row, rec)
        if sh.due(dec):
            sh.dispatch(drafter, state, dec, rs)
        res = dec.round(0, successor=i < n - 1)
        steps.append(dec.keep[-1])
        row.tokens.extend(res.tokens)
    sh.read(row, rec)
    assert [d for d, _ in rec.seen] == [1] * len(rec.seen)
    assert len(rec.seen) > n - 2 * shadow.SHADOW_EVERY  # read up to the last replay
    hidden = mx.concatenate([h for h, _ in steps], axis=1)
    tokens = mx.concatenate([t for _, t in steps], axis=1)
    ties = 0
    for j, (_, accepted) in enumerate(rec.seen):  # position row.next_position at start + j: after j plain steps
        logits = np.array(_first_draft_logits(drafter, row, pre, hidden, tokens, j))  # sync: test read
        top2 = np.sort(logits)[-2:]
        if top2[1] - top2[0] < tie_margin():
            ties += 1
            continue
        assert accepted == int(int(np.argmax(logits)) == row.tokens[j]), j
    assert ties < len(rec.seen) // 2
    assert any(a for _, a in rec.seen)  # the test model's head agrees on most positions


def _sent_plain_with_no_agreement(lm, prompt, params, monkeypatch, shadows: bool, drafter: str | None = "mtp"):
    """A lone request whose drafts pay (a draft round timed at 1.2 plain ones), the control
    unpinned, its exploration out of reach; each time it goes plain (the control's plain window,
    after PLAIN_CHECK_AFTER rounds) its acceptance is replaced by one that says its drafts never
    agree, so the control decides plain after the window. Only what its drafts are seen to accept
    while plain can bring it back. Returns the drafts of its rounds from the first plain one on;
    its stream checked against its solo plain decode."""
    forced(monkeypatch, 1.2)
    monkeypatch.setattr(width_control, "FAR", 100.0)
    monkeypatch.setattr(width_control, "EXPLORE_FIRST", 10 ** 6)
    monkeypatch.setattr(width_control, "EXPLORE_SOON", 10 ** 6)
    if not shadows:
        monkeypatch.setattr(shadow, "SHADOW_EVERY", 10 ** 6)
    real = scalar.ScalarLane._go_plain

    def go_plain(self, seq, *a, keep=False):
        real(self, seq, *a, keep=keep)
        if keep:
            seq.acceptance = Acceptance(0.01, 12.0, rounds=20, decay=DECAY)  # (rounds: no new request's try)

    monkeypatch.setattr(scalar.ScalarLane, "_go_plain", go_plain)
    # (the test model's default, the KV-sharing assistant, offers no replay); nor may a recurring
    # context bring it back (a re-arm for a context round: tests/test_context_lookup.py)
    monkeypatch.setattr(ContextLookup, "recurs", lambda self, *a: False)
    eng = on(lm, drafter=drafter)
    run = drive(eng, {0: [("a", prompt, params)]})
    check_solo(lm, run)
    eng.close()
    drafted = [d for *_, d, _e in run.rounds_of("a")]
    return drafted[drafted.index(0, 1):]


@pytest.mark.parametrize("params", [P(120), P(120, seed=5, t=0.7)], ids=["greedy", "seeded"])
@pytest.mark.parametrize("shadows", [True, False])
def test_a_lone_request_sent_plain_re_arms_on_what_its_shadow_rounds_accept(lm, prompts, clean, monkeypatch,
                                                                           params, shadows):
    after = _sent_plain_with_no_agreement(lm, prompts[6], params, monkeypatch, shadows)
    assert after[0] == 0
    assert (sum(after) > 0) is shadows, after


@pytest.mark.parametrize("shadows", [True, False])
def test_smollm2_a_lone_request_sent_plain_re_arms_on_what_its_shadow_rounds_accept(smollm2, monkeypatch, shadows):
    """The same on the real model with its default drafter, the shipped EAGLE-3 head (greedy)."""
    lm = smollm2.load("float32")
    control.forget(lm.target)
    try:
        after = _sent_plain_with_no_agreement(lm, lm.tokenizer.encode("Write a Python function that reverses a list."),
                                              P(72), monkeypatch, shadows, drafter=None)
    finally:
        control.forget(lm.target)
    assert after[0] == 0
    assert (sum(after) > 0) is shadows, after
