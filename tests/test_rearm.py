"""A lone request the control sends plain keeps its drafter and re-arms when the control asks for
drafts again (gmlx/decode/scalar.py REARM_MIN; gmlx/decode/plain.py `keep_hidden`): its plain
steps' hidden states become the drafter's pending entries. Tokens never move: every stream equals
its solo plain decode, greedy and seeded; the branch is forced both ways, on the test model and
on SmolLM2 with its shipped head. A round that switches kind (goes plain, re-arms) is not timed."""

import mlx.core as mx
import numpy as np
import pytest

from engine_helpers import P, check_solo, drive
from numerics import assert_close
from test_control import forced, on
from gmlx.decode import plain, scalar
from gmlx.decode.plain import PlainDecoder
from gmlx.decode.prefill import prefill_row
from gmlx.drafters.base import DraftPick
from gmlx.drafters.select import select_drafter
from gmlx.engine import speculation
from gmlx.engine.oracle import make_row
from gmlx.policy import control, thresholds, width_control
from gmlx.sampling import RowSampling

LM_WITHOUT_EOS = True  # budgets alone end these requests


def _lone(lm, prompt, params, monkeypatch, rearm: bool | str):
    """One lone request whose drafts lose (a round of drafts timed at 6 plain ones), the control
    unpinned: nothing paired, it drafts on the load probe's costs until the control's plain windows
    (after PLAIN_CHECK_AFTER rounds, then every 4: FAR and REFRESH_FIRST patched, so the windows
    come soon) pair the two kinds of round; the loss measured, it decodes plain, and its
    exploration asks for drafts again after 8 plain rounds (EXPLORE_FIRST, EXPLORE_SOON patched).
    `rearm` False: REARM_MIN out of reach (the window runs at the request's tail, its drafter
    dropped); "capped": plain.KEEP_MAX under every plain stretch (the drafter is dropped there).
    Returns the drafts of its rounds from the first plain one on; its stream checked against its
    solo plain decode."""
    forced(monkeypatch, 6.0)
    monkeypatch.setattr(width_control, "FAR", 100.0)
    monkeypatch.setattr(width_control, "REFRESH_FIRST", 4)
    monkeypatch.setattr(width_control, "EXPLORE_FIRST", 8)
    monkeypatch.setattr(width_control, "EXPLORE_SOON", 8)
    if rearm == "capped":  # fewer plain steps kept than any plain stretch here: the drafter goes
        monkeypatch.setattr(plain, "KEEP_MAX", 3)
    elif not rearm:
        monkeypatch.setattr(thresholds, "REARM_MIN", 10 ** 6)
    eng = on(lm)
    run = drive(eng, {0: [("a", prompt, params)]})
    check_solo(lm, run)
    eng.close()
    drafted = [d for *_, d, _e in run.rounds_of("a")]
    first_plain = drafted.index(0, 1)  # round 0 may be the prompt's (no drafts)
    return drafted[first_plain:]


@pytest.mark.parametrize("params", [P(96), P(96, seed=9, t=0.8)], ids=["greedy", "seeded"])
@pytest.mark.parametrize("rearm", [True, False, "capped"])
def test_a_lone_request_sent_plain_drafts_again_only_when_it_may_rearm(lm, prompts, clean, monkeypatch, params,
                                                                      rearm):
    after = _lone(lm, prompts[5], params, monkeypatch, rearm)
    assert (sum(after) > 0) is (rearm is True), after
    if rearm:  # each exploration drafts a few rounds and, the loss confirmed, goes plain again
        assert after.count(0) > len(after) // 2, after


@pytest.mark.parametrize("cap", range(5, 11))
def test_a_lone_request_whose_kept_steps_reach_the_cap_as_it_re_arms_decodes_on(lm, prompts, clean, monkeypatch, cap):
    """plain.KEEP_MAX reached in the very plain round the control asks for drafts again (here at
    some cap from 5 to 10: the window's rounds, then the first re-arm): the request does not
    re-arm, drops its drafter, and its stream still equals its solo plain decode."""
    monkeypatch.setattr(plain, "KEEP_MAX", cap)
    _lone(lm, prompts[5], P(96), monkeypatch, True)


@pytest.mark.parametrize("rearm", [True, False])
def test_smollm2_a_lone_request_sent_plain_drafts_again_only_when_it_may_rearm(smollm2, monkeypatch, rearm):
    """The same on the real model with its shipped EAGLE-3 head (greedy)."""
    lm = smollm2.load("float32")
    control.forget(lm.target)
    try:
        after = _lone(lm, lm.tokenizer.encode("Explain why the sky is blue."), P(64), monkeypatch, rearm)
    finally:
        control.forget(lm.target)
    assert (sum(after) > 0) is rearm, after


def test_plain_steps_keep_the_hidden_states_a_verify_would_give(lm, prompts):
    """`keep_hidden`: the same tokens as the plain path, and per emitted step the hidden state at
    the token it read (a whole-sequence forward's, within tolerance) and the token it sampled."""
    n = 6
    row = make_row(lm, prompts[2], P(n))
    pre = prefill_row(lm.target, row, 512, want_hidden=False)
    rs = RowSampling.from_params([row.params], [row.seed])
    dec = PlainDecoder(lm.target, pre.cache, rs, row.prompt[-1], row.next_position, lambda: n, keep_hidden=True)
    out = [dec.round(0).tokens[0] for _ in range(n - 1)]
    out.append(dec.round(0, successor=False).tokens[0])
    hidden, tokens = dec.kept()
    assert np.array(tokens)[0].tolist() == out  # sync: test read
    seq = list(row.prompt) + out
    _, full = lm.target(mx.array([seq[:-1]], dtype=mx.int32), lm.target.make_cache())
    assert_close(hidden[0], full[0, len(row.prompt) - 1:], msg="kept hidden states")


@pytest.mark.parametrize("kind", ["mtp", "assistant", "draft", "ngram"])
def test_one_commit_of_the_plain_steps_drafts_as_one_commit_per_step(lm, prompts, kind):
    """The drafter base's contract for a re-arm: a commit with k = 0 of n entries leaves the state
    n commits of one entry each leave (the next drafts equal; the drafter teacher-forces over its
    pending entries at its next draft either way). The draft model is the target itself."""
    drafter = select_drafter(lm, kind, draft_lm=lm if kind == "draft" else None)
    n, row = 7, make_row(lm, prompts[3], P(8))
    pre = prefill_row(lm.target, row, 512, want_hidden=drafter.needs_hidden)
    rs = RowSampling.from_params([row.params], [row.seed])
    dec = PlainDecoder(lm.target, pre.cache, rs, row.prompt[-1], row.next_position, lambda: n, keep_hidden=True)
    for i in range(n):
        dec.round(0, successor=i < n - 1)
    hidden, tokens = dec.kept()
    pick = DraftPick(None, np.array([row.next_position + n]))
    drafts = []
    for one_by_one in (False, True):
        st = drafter.start([row], [pre])
        if one_by_one:
            for i in range(n):
                drafter.commit(st, 0, np.array([0]), hidden[:, i:i + 1], tokens[:, i:i + 1])
        else:
            drafter.commit(st, 0, np.array([n - 1]), hidden, tokens)
        drafts.append(np.array(drafter.draft(st, 3, pick, pre.cache)).tolist())  # sync: test read
    assert drafts[0] == drafts[1]


def test_a_lone_requests_switching_rounds_are_not_timed(lm, prompts, clean, monkeypatch):
    """A scalar round whose successor runs another k (it went plain, re-armed, changed K) is not
    timed (ScalarLane.switched): its period holds both kinds' work. Every period the control is
    given is a round between two rounds of its own k; and this run switched both ways."""
    events = []
    real_round, real_time = scalar.ScalarLane.round, speculation.Speculation.record_time

    def round_(self, last=False):
        res = real_round(self, last)
        events.append(("round", self.last_k))
        return res

    def record_time(self, width, k, seconds):
        events.append(("time", k))
        return real_time(self, width, k, seconds)

    monkeypatch.setattr(scalar.ScalarLane, "round", round_)
    monkeypatch.setattr(speculation.Speculation, "record_time", record_time)
    _lone(lm, prompts[5], P(96), monkeypatch, True)  # (forced: record_time's seconds replaced underneath)
    ks = [k for e, k in events if e == "round"]
    timed = 0
    for i, (e, k) in enumerate(events):
        if e == "time":
            before = [x for ev, x in events[:i] if ev == "round"]
            after = [x for ev, x in events[i + 1:] if ev == "round"]
            assert before[-1] == k == after[0], (i, before[-3:], k, after[:3])
            timed += 1
    assert timed >= 20  # (the request's plain tail, its drafter dropped, runs without the control)
    assert any(a > 0 and b == 0 for a, b in zip(ks, ks[1:])) and any(a == 0 and b > 0 for a, b in zip(ks, ks[1:]))
