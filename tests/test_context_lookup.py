"""The lone request's drafts from its own context (gmlx/drafters/context_lookup.py): the lookup rule
(a recurring suffix of 3-4 tokens, the tokens that followed it, the budget), the wrapper's choice
between it and the model's drafter (the lone request's rounds only, the inner drafter untouched
and committed with k = 0), the engine's oracle (greedy and seeded streams equal solo plain
decoding, with the control on and off), the control learning nothing from such rounds, and where
it is off (an explicit K, GMLX_CONTEXT_LOOKUP=0)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import pytest

from engine_helpers import P, matches_solo
from gmlx import Engine, EngineConfig, SamplingParams
from gmlx.config import Switches
from gmlx.decode.scalar import ScalarLane
from gmlx.drafters.base import DraftPick
from gmlx.drafters.context_lookup import ContextLookup
from gmlx.drafters.draft_model import DraftModelDrafter
from gmlx.drafters.ngram import NGramDrafter
from gmlx.drafters.prediction import PredictionDrafter
from gmlx.engine.speculation import Speculation
from gmlx.policy.control import Controller
from gmlx.request_stats import RequestStats

LM_WITHOUT_EOS = True  # budgets alone end the engine tests' requests: see conftest.lm


@dataclass
class FakeRow:
    prompt: list[int]
    params: SamplingParams
    tokens: list[int] = field(default_factory=list)
    stats: RequestStats = field(default_factory=RequestStats)


def row(prompt, prediction=None, max_tokens=64):
    return FakeRow(list(prompt), SamplingParams(max_tokens=max_tokens, prediction=prediction))


def commit(d, st, per_row: list[list[int]], accepted: list[int]):
    """A verify's result: each row's verified tokens (accepted drafts + bonus), padded."""
    width = max(len(t) for t in per_row)
    d.commit(st, width - 1, np.array(accepted), None, np.array([t + [0] * (width - len(t)) for t in per_row]))

# 5 6 7 recurs: what followed it (8 9 1) is the draft
RECURRING = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7]
# code whose last line repeats an earlier one: the embedded model's continuation copies it
REPEATING = "def area(w, h):\n    return w * h\n\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n\n\ndef area(w, h):\n"


def test_a_recurring_suffix_of_three_drafts_what_followed_it_within_the_budget():
    lk = ContextLookup()
    st = lk.start(row(RECURRING))
    assert lk.propose(st, 3) == [8, 9, 1]
    assert lk.propose(lk.start(row([5, 6, 1, 2, 5, 6])), 3) == []  # two tokens recurring are not enough
    assert lk.propose(lk.start(row(RECURRING, max_tokens=2)), 3) == [8]  # a round of k emits k + 1
    assert lk.propose(lk.start(row(RECURRING, max_tokens=1)), 3) == []
    assert lk.propose(lk.start(row(RECURRING)), 1) == [8]  # the request's K ceiling
    # the verified tokens extend the context: ... 5 6 7 | 8 4 -> "7 8 4" never occurred
    lk.commit(st, np.array([1]), np.array([[8, 4]]))
    assert lk.propose(st, 3) == []
    lk.commit(st, np.array([0]), np.array([[5]]))  # ... 8 4 5: "4 5" is two tokens
    assert lk.propose(st, 3) == []


class Inner(NGramDrafter):
    """A drafter whose drafts another source may replace (as the MTP and EAGLE-3 heads), counting
    its drafts and the k of its commits."""

    kind = "fake"

    def __init__(self):
        super().__init__(n_min=1, n_max=1)
        self.drafts, self.commits = 0, []

    def draft(self, *a, **kw):
        self.drafts += 1
        return super().draft(*a, **kw)

    def commit(self, st, k, accepted, hidden, targets):
        self.commits.append(k)
        super().commit(st, k, accepted, hidden, targets)


def pick(context: bool, width: int = 1) -> DraftPick:
    return DraftPick(None, np.full(width, 10), context=3 if context else 0)


def test_the_lone_request_drafts_from_its_context_and_the_drafter_sits_the_round_out():
    inner = Inner()
    d = PredictionDrafter(inner)
    st = d.start([row(RECURRING)], [None])
    assert np.array(d.draft(st, 1, pick(True), [])).tolist() == [[8, 9, 1]]
    assert list(d.draft_lengths(st)) == [3] and d.foreign(st) and inner.drafts == 0
    commit(d, st, [[8, 9, 3]], [2])  # two accepted, then the target's 3
    assert inner.commits == [0] and not d.foreign(st)  # a round the inner drafter did not draft for
    assert st.inner.rows[0].seq[-3:] == [8, 9, 3] and st.context.index.seq[-3:] == [8, 9, 3]
    # no recurring suffix ("9 3" and "1 2 5 6 7 8 9 3"): the inner drafter drafts
    d.draft(st, 1, pick(True), [])
    assert inner.drafts == 1 and not d.foreign(st)
    commit(d, st, [[4, 0]], [0])
    assert inner.commits == [0, 1]


def test_not_the_batch_nor_rounds_that_do_not_ask_nor_a_predicted_row():
    inner = Inner()
    d = PredictionDrafter(inner)
    st = d.start([row(RECURRING)], [None])
    d.draft(st, 2, pick(False), [])  # a round that does not ask (the batch lane's, an explicit K's)
    assert inner.drafts == 1 and not d.foreign(st)
    st = d.start([row(RECURRING), row(RECURRING)], [None, None])
    d.draft(st, 2, pick(True, 2), [])  # two rows: a longer draft would widen both rows' verify
    assert inner.drafts == 2 and not d.foreign(st)
    st = d.start([row(RECURRING, prediction=(40, 41, 42))], [None])
    assert np.array(d.draft(st, 1, pick(True), [])).tolist() == [[40, 41, 42]] and not d.foreign(st)


def test_only_beside_a_drafter_whose_drafts_are_replaceable():
    assert PredictionDrafter(Inner()).lookup is not None
    assert PredictionDrafter(NGramDrafter()).lookup is None  # prompt lookup is this already
    assert PredictionDrafter(None).lookup is None
    draft_model = DraftModelDrafter.__new__(DraftModelDrafter)  # its state holds its own drafts
    assert PredictionDrafter(draft_model).lookup is None


@pytest.fixture
def proposals(monkeypatch):
    """Every proposal the lookup made (the engine's own)."""
    out, propose = [], ContextLookup.propose
    monkeypatch.setattr(ContextLookup, "propose", lambda self, *a: out.append(propose(self, *a)) or out[-1])
    return out


def run_checked(lm, prompt: list[int], params, control: bool, monkeypatch) -> None:
    """One lone request on a fresh engine: its stream equals solo plain decoding, and with the
    control on, every round but the context's taught the control."""
    rounds, learnt, observe, learn = [], [], Speculation.observe, Controller.observe
    monkeypatch.setattr(Speculation, "observe", lambda self, kind, width, t0, results, *a, **kw: (
        rounds.append(any(r.foreign for r in results)), observe(self, kind, width, t0, results, *a, **kw))[1])
    monkeypatch.setattr(Controller, "observe", lambda self, *a, **kw: (learnt.append(a), learn(self, *a, **kw))[1])
    eng = Engine(lm, EngineConfig(prompt_cache_bytes=0), switches=Switches(control=control))
    try:
        matches_solo(lm, prompt, params, eng.generate(prompt, params).tokens)
    finally:
        eng.close()
    if control:
        assert any(rounds) and len(learnt) == rounds.count(False), (rounds, len(learnt))


@pytest.mark.parametrize("control", [False, True], ids=["control-off", "control-on"])
def test_streams_with_context_drafts_equal_plain(lm, proposals, monkeypatch, control, clean):
    run_checked(lm, lm.tokenizer.encode(REPEATING), P(40, seed=3), control, monkeypatch)
    assert any(proposals), "the repeated line recurs: the lookup drafted"


@pytest.mark.parametrize("t", [0.0, 0.8], ids=["greedy", "seeded"])
def test_the_real_model_as_users_load_it_greedy_and_seeded(smollm2, proposals, monkeypatch, t):
    """SmolLM2 as `--model smollm2` loads it: its answer copies the question. (The control off: on
    the suite's prior costs it sends this request plain within a few rounds, before its answer
    reaches the copy; the control's part is the embedded model's test above.)"""
    lm = smollm2.load("q")
    prompt = list(lm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write the word apple ten times, separated by commas."}], add_generation_prompt=True))
    run_checked(lm, prompt, P(32, seed=3, t=t), False, monkeypatch)
    assert any(proposals), "the answer repeats the question: the lookup drafted"


@pytest.mark.parametrize("how", ["explicit-k", "switch-off"])
def test_off_with_an_explicit_k_and_with_the_switch(lm, monkeypatch, how):
    def untouchable(*a):
        raise AssertionError("the context lookup was asked")

    monkeypatch.setattr(ContextLookup, "propose", untouchable)
    config = EngineConfig(prompt_cache_bytes=0, num_draft_tokens=2 if how == "explicit-k" else None)
    eng = Engine(lm, config, switches=Switches(context_lookup=how != "switch-off"))
    try:
        prompt = lm.tokenizer.encode(REPEATING)
        matches_solo(lm, prompt, P(24, seed=1), eng.generate(prompt, P(24, seed=1)).tokens)
    finally:
        eng.close()


def test_the_switch_from_the_environment(monkeypatch):
    monkeypatch.setenv("GMLX_CONTEXT_LOOKUP", "0")
    assert Switches.from_env().context_lookup is False
    monkeypatch.delenv("GMLX_CONTEXT_LOOKUP")
    assert Switches.from_env().context_lookup is True


def test_recurs_reads_what_a_plain_request_emitted_and_its_commit_skips_it():
    lk = ContextLookup()
    st = lk.start(row([9, 1, 2, 3, 4]))  # the prompt; its output so far: nothing
    assert not lk.recurs(st) and not lk.recurs(st, [])
    # decoding plain, it emitted 7 1 2 3: "1 2 3" occurred, 4 after it
    assert lk.recurs(st, [7, 1, 2, 3]) and lk.propose(st, 3) == [4, 7, 1]
    assert st.ahead == 4 and st.index.seq == [9, 1, 2, 3, 4, 7, 1, 2, 3]
    assert lk.recurs(st, [7, 1, 2, 3])  # nothing new emitted: nothing read again
    # the re-arm commits the plain steps (7 1 2 3) and more (5): only 5 is new
    lk.commit(st, np.array([4]), np.array([[7, 1, 2, 3, 5]]))
    assert st.ahead == 0 and st.index.seq == [9, 1, 2, 3, 4, 7, 1, 2, 3, 5]
    assert not lk.recurs(st) and not lk.recurs(lk.start(row([5, 6, 1, 2, 5, 6])))


def test_a_request_the_control_has_plain_re_arms_for_rounds_its_context_drafts(lm, proposals, monkeypatch, clean):
    """After its first rounds the control says plain every time: the request decodes plain, keeps
    its drafter, and re-arms only where its context recurs (no other re-arm is asked for); those
    rounds draft from its context, and the stream is solo plain decoding's."""
    choose, rearms, foreign = Controller.choose, [], []
    calls = iter(range(10 ** 6))

    def plain_after_three(self, *a, **kw):
        c = choose(self, *a, **kw)
        return c if next(calls) < 3 else replace(c, k=0, window=False, exploring=False)

    monkeypatch.setattr(Controller, "choose", plain_after_three)
    monkeypatch.setattr(ScalarLane, "_rearm", lambda self, *a, rearm=ScalarLane._rearm: (
        rearms.append(1), rearm(self, *a))[1])
    monkeypatch.setattr(ScalarLane, "_collect", lambda self, seq, fl, collect=ScalarLane._collect: (
        foreign.append(fl.foreign), collect(self, seq, fl))[1])
    eng = Engine(lm, EngineConfig(prompt_cache_bytes=0), switches=Switches(control=True))
    try:
        prompt, params = lm.tokenizer.encode(REPEATING), P(64, seed=3)
        matches_solo(lm, prompt, params, eng.generate(prompt, params).tokens)
    finally:
        eng.close()
    assert rearms and any(foreign), (rearms, foreign)
