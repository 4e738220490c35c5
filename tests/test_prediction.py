"""Predicted outputs (OpenAI's `prediction`, gmlx/drafters/prediction.py): the alignment rule
(drafts from the pointer, re-alignment after an edit, the budget, the allowance), per-row mixing
with the inner drafter's drafts, the engine's oracle (every stream with a prediction equals its
solo plain stream, greedy and seeded, through scalar, preempt, batch, gate and resume, whatever
drafter it is combined with), the acceptance of the previous answer re-asked, and the counts."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from drafter_fixtures import draft_lm
from engine_helpers import P, check_solo, drive, engine, solo
from gmlx import Engine, EngineConfig, SamplingParams
from gmlx.config import Switches
from gmlx.drafters.ngram import NGramDrafter
from gmlx.drafters.prediction import PredictionDrafter, alignment
from gmlx.drafters.select import available, select_drafter, with_predictions
from gmlx.request_stats import RequestStats
from gmlx.errors import InvalidRequest
from gmlx.engine.oracle import compare_streams, run_scalar

LM_WITHOUT_EOS = True  # budgets alone end the engine tests' requests: see conftest.lm


@dataclass
class FakeRow:
    prompt: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    tokens: list[int] = field(default_factory=list)
    stats: RequestStats = field(default_factory=RequestStats)


def row(prompt, prediction=None, max_tokens=64, tokens=()):
    return FakeRow(list(prompt), SamplingParams(max_tokens=max_tokens, prediction=prediction), list(tokens))


def drafted(d, st, k):
    out = np.array(d.draft(st, k, None, []))
    lengths = d.draft_lengths(st)
    return [list(map(int, r[:n])) for r, n in zip(out, lengths)]


def commit(d, st, per_row: list[list[int]], accepted: list[int]):
    """A verify's result: each row's verified tokens (accepted drafts + bonus), padded."""
    width = max(len(t) for t in per_row)
    targets = np.array([t + [0] * (width - len(t)) for t in per_row])
    d.commit(st, width - 1, np.array(accepted), None, targets)


# ---- the alignment rule ---------------------------------------------------------------------

PRED = (10, 11, 12, 13, 14, 15, 16, 17, 18, 19)


def test_drafts_start_at_the_prediction_and_follow_the_output():
    a = alignment(row([1, 2], PRED), [])
    assert a.propose(4) == [10, 11, 12, 13]
    a.drafted = 4
    a.verified(4, 16)
    a.advance([10, 11, 12, 13, 14], count=True)  # all four accepted, the bonus equals the next
    assert a.pointer == 5 and a.aligned and a.propose(3) == [15, 16, 17]


def test_an_edit_realigns_on_the_outputs_suffix():
    a = alignment(row([1, 2], PRED), [])
    a.advance([10, 11, 99], count=False)  # replaced 12 by 99
    assert not a.aligned and a.propose(4) == []  # 99 is nowhere in the prediction
    a.advance([13], count=False)  # the output goes on with the prediction after the edit
    assert a.aligned and a.pointer == 4 and a.propose(3) == [14, 15, 16]
    a.advance([14, 15, 50, 51, 16, 17], count=False)  # an insertion: [16, 17] found again ahead
    assert a.aligned and a.pointer == 8 and a.propose(9) == [18, 19]


def test_a_deletion_and_the_nearest_occurrence_ahead():
    pred = (5, 6, 7, 1, 2, 3, 8, 9, 1, 2, 3, 4)
    a = alignment(row([0], pred), [])
    a.advance([5, 6, 1, 2, 3], count=False)  # 7 deleted: [1, 2, 3] occurs at 3 and at 8: the first ahead
    assert a.aligned and a.pointer == 6 and a.propose(2) == [8, 9]
    b = alignment(row([0], pred), [5, 6, 7, 1, 2, 3, 8, 9, 1])
    b.advance([42, 2, 3], count=False)  # after the pointer (9) the 2-gram [2, 3] next ends at 11
    assert b.aligned and b.pointer == 11 and b.propose(4) == [4]


def test_a_one_token_suffix_realigns_only_close_ahead():
    pred = tuple(range(100, 130))
    a = alignment(row([0], pred), [])
    a.advance([100, 7, 102], count=False)  # 101 replaced: 102 is right after the pointer
    assert a.aligned and a.pointer == 3
    b = alignment(row([0], pred), [])
    b.advance([100, 7, 125], count=False)  # 125 is 24 tokens ahead: too far for one token
    assert not b.aligned


def test_budget_end_of_prediction_and_allowance():
    a = alignment(row([1], PRED, max_tokens=4), [])
    assert a.propose(16) == [10, 11, 12]  # 4 tokens left: 3 drafts + the round's own token
    a = alignment(row([1], PRED), [10, 11, 12, 13, 14, 15, 16, 17])
    assert a.propose(16) == [18, 19]  # the prediction ends
    a = alignment(row([1], tuple(range(100))), [])
    assert a.propose(16) == list(range(16))
    a.drafted = 16
    a.verified(2, 16)  # 2 of 16 accepted: next time 3
    a.advance([0, 1, 2], count=False)
    assert a.propose(16) == [3, 4, 5]
    a.drafted = 3
    a.verified(3, 16)
    assert a.allowance == 6


def test_text_prediction_is_tokenized_at_intake(lm):
    from gmlx.engine.intake import make_row

    text = "    return x + 1\n"
    r = make_row(lm, [1, 2, 3], SamplingParams(max_tokens=4, prediction=text))
    assert r.params.prediction == tuple(lm.tokenizer.encode(text, add_special_tokens=False))
    assert r.stats.prediction_tokens == len(r.params.prediction)
    assert make_row(lm, [1, 2], SamplingParams(prediction="")).params.prediction is None
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        make_row(lm, [1, 2], SamplingParams(prediction=[lm.target.vocab_size]))
    with pytest.raises(InvalidRequest, match="prediction"):
        SamplingParams(prediction=[1, -2]).validated()
    with pytest.raises(InvalidRequest, match="prediction"):
        SamplingParams(prediction=3.5).validated()
    assert SamplingParams(prediction=[4, 5]).validated().prediction == (4, 5)


# ---- the drafter: per-row mixing, the inner drafter's state -----------------------------------

def test_rows_mix_prediction_and_inner_drafts():
    """Three rows: one predicted, one prompt lookup (the inner ngram drafter), one with neither."""
    d = PredictionDrafter(NGramDrafter(n_min=2, n_max=2), k_max=5)
    rows = [row([1, 2], PRED), row([7, 8, 9, 7, 8]), row([30, 31, 32])]
    st = d.start(rows, [None] * 3)
    assert drafted(d, st, 3) == [[10, 11, 12, 13, 14], [9, 7, 8], []]
    assert st.inner_k == 3
    # row 0 accepted 2 then the target's 77; row 1 accepted 1 and 5; row 2 its own 33
    commit(d, st, [[10, 11, 77], [9, 5], [33]], [2, 1, 0])
    assert rows[0].stats.rejected_prediction_tokens == 3 and rows[0].stats.accepted_prediction_tokens == 2
    # row 1's lookup state saw the verified tokens (the inner drafter's commit): [.., 8, 9, 5]
    assert st.inner.rows[1].seq[-2:] == [9, 5]
    st = d.filter(st, [1, 0])
    assert d.width(st) == 2 and drafted(d, st, 2)[1] == []  # row 0: 77 is not in the prediction


def test_every_row_predicted_skips_the_inner_drafter():
    class Counting(NGramDrafter):
        calls = 0

        def draft(self, *a, **kw):
            Counting.calls += 1
            return super().draft(*a, **kw)

    d = PredictionDrafter(Counting(), k_max=4)
    st = d.start([row([1], PRED), row([2], PRED[3:])], [None] * 2)
    assert drafted(d, st, 2) == [[10, 11, 12, 13], [13, 14, 15, 16]] and Counting.calls == 0
    assert st.inner_k == 0


def test_prediction_alone_drafts_nothing_without_one():
    d = PredictionDrafter()
    assert with_predictions(d) is d and d.kind == "prediction" and not d.needs_hidden and d.step_cost == 0
    st = d.start([row([1, 2, 3]), row([1], PRED)], [None, None])
    assert drafted(d, st, 3) == [[], list(PRED)]


def test_wrapper_forwards_the_inner_drafters_attributes(lm):
    inner = select_drafter(lm, "mtp")
    d = with_predictions(inner)
    assert d.kind == inner.kind == "mtp" and d.needs_hidden and d.head is inner.head
    d.head = "replaced"  # writes go to the inner drafter (tests swap its head)
    assert inner.head == "replaced"
    assert "prediction" in available(lm)


# ---- the engine's oracle --------------------------------------------------------------------

def edited(tokens: list[int], every: int = 7) -> list[int]:
    """The answer with every `every`-th token replaced and a few dropped: an edit to realign on."""
    out = []
    for i, t in enumerate(tokens):
        if i % every == 3:
            out.append((t + 11) % 1000 + 3)
        elif i % (3 * every) != 5:
            out.append(t)
    return out


@pytest.mark.parametrize("t", [0.0, 0.8])
@pytest.mark.parametrize("drafter", [None, "ngram", "prediction"])
def test_schedule_with_predictions_equals_solo(lm, prompts, t, drafter):
    """A scalar start with an exact prediction, preempted by waiters (one with an edited
    prediction, one with none), gated over the cap and resumed: every stream equals its solo
    plain stream, and the exact prediction is accepted."""
    ref = solo(lm, prompts[3], P(96, seed=1, t=t))
    other = solo(lm, prompts[5], P(24, seed=2, t=t))
    eng = engine(lm, 2, drafter=drafter, resume_min_remaining=2)
    arrivals = {0: [("exact", prompts[3], P(96, seed=1, t=t, prediction=tuple(ref)))],
                1: [("edited", prompts[5], P(24, seed=2, t=t, prediction=tuple(edited(other)))),
                    ("none", prompts[8], P(14, seed=3, t=t))],
                4: [("late", prompts[9], P(12, seed=4, t=t, prediction=tuple(prompts[9][:20])))]}
    run = drive(eng, arrivals)
    assert check_solo(lm, run) <= 1
    tr = run.transitions()
    assert "preempt" in tr and "gate" in tr and "resume" in tr, tr
    exact = run.streams["exact"].result.stats
    assert exact["accepted_prediction_tokens"] > 20, exact
    assert exact["num_accepted"] > 20 and "prediction_tokens" not in run.streams["none"].result.stats
    eng.close()


@pytest.mark.parametrize("t", [0.0, 0.8])
def test_scalar_lane_with_a_prediction_equals_plain(lm, prompts, t):
    for i in (2, 20):
        params = SamplingParams(max_tokens=40, temperature=t, seed=i)
        ref = solo(lm, prompts[i], params)
        for pred in (ref, edited(ref), ref[10:], list(reversed(ref))):
            p = SamplingParams(max_tokens=40, temperature=t, seed=i, prediction=tuple(pred))
            got = run_scalar(lm, prompts[i], p, drafter=with_predictions(select_drafter(lm)))
            assert compare_streams(lm, prompts[i], ref, got.tokens, p).ok
        assert got.stats.num_generated == 40


def test_previous_answer_is_accepted_whole(lm, prompts):
    """Re-asked with its own answer as the prediction: every draft is accepted, in rounds of up
    to 16 drafts, and the counts say so (OpenAI: accepted = the prediction's tokens in the output)."""
    params = P(64, seed=0)
    ref = solo(lm, prompts[4], params)
    eng = Engine(lm, EngineConfig())
    rec = eng.generate(prompts[4], P(64, seed=0, prediction=tuple(ref)))
    eng.close()
    assert rec.tokens == ref
    s = rec.stats
    assert s["draft_acceptance_rate"] == 1.0 and s["max_draft_tokens"] == 16 and s["num_rounds"] <= 6, s
    assert s["accepted_prediction_tokens"] == 64 and s["rejected_prediction_tokens"] == 0


def test_with_a_draft_model(lm, prompts, tmp_path_factory):
    """A draft model's state holds its own drafts: the prediction is used in rounds where every row
    has one, the draft model drafts the others; streams stay exact."""
    dm = draft_lm("draft-random", lm, tmp_path_factory)
    eng = Engine(lm, EngineConfig(width_cap=0), draft_model=dm,
                 switches=Switches(preempt=True, resume=True))
    assert eng.drafter.kind == "draft" and not eng.drafter.drafts_replaceable
    ref = solo(lm, prompts[6], P(30, seed=5))
    run = drive(eng, {0: [("p", prompts[6], P(30, seed=5, prediction=tuple(ref)))],
                      2: [("q", prompts[7], P(12, seed=6))]})
    assert check_solo(lm, run) <= 1
    assert run.streams["p"].result.stats["accepted_prediction_tokens"] > 10
    eng.close()


def test_plain_engine_ignores_the_prediction(lm, prompts):
    eng = Engine(lm, EngineConfig(speculative=False))
    ref = solo(lm, prompts[2], P(12, seed=0))
    rec = eng.generate(prompts[2], P(12, seed=0, prediction=tuple(ref)))
    eng.close()
    assert rec.tokens == ref and rec.stats["accepted_prediction_tokens"] == 0


# ---- the CLI --------------------------------------------------------------------------------

def test_cli_generate_with_a_prediction_file(tmp_path):
    import json

    from test_cli import PROMPT, run

    def gen(*args):
        r = run("generate", PROMPT, "--max-tokens", "40", "--seed", "3", "--temp", "0", *args)
        assert r.code == 0, r.stderr
        return r

    plain = json.loads(gen("--json", "--no-speculative").stdout)
    pred = tmp_path / "previous.txt"
    pred.write_text(plain["text"])
    got = json.loads(gen("--json", "--prediction", str(pred)).stdout)
    assert got["tokens"] == plain["tokens"] and got["prediction_tokens"] > 0
    assert got["accepted_prediction_tokens"] == len(got["tokens"]) and got["max_draft_tokens"] > 3
    assert "prediction:" in gen("--prediction", str(pred)).stderr
    r = run("generate", PROMPT, "--no-speculative", "--prediction", str(pred))
    assert r.code == 2 and "--prediction" in r.stderr
    r = run("generate", PROMPT, "--prediction", str(tmp_path / "missing.txt"))
    assert r.code == 1 and "cannot read" in r.stderr


def test_bench_workload_carries_predictions(tmp_path):
    """`gmlx bench --prompts FILE.jsonl` with a "prediction" per prompt (a re-ask workload: the
    previous answers): each request carries it, to the engine and over HTTP."""
    import json

    from gmlx_cli.bench.http_backend import _body
    from gmlx_cli.bench.workload import Arrival, build_requests, load_prompt_specs

    f = tmp_path / "reask.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in [{"prompt": "def f(x):", "prediction": "    return x\n"},
                                                  {"prompt": "import os"}]) + "\n")
    specs = load_prompt_specs(f)
    reqs = build_requests(specs, 3, Arrival(), (8, 8), 0.0, 0)
    assert [r.params.prediction for r in reqs] == ["    return x\n", None, "    return x\n"]
    assert _body(reqs[0], False)[1]["prediction"] == {"type": "content", "content": "    return x\n"}
    assert "prediction" not in _body(reqs[1], False)[1]
    f.write_text(json.dumps({"prompt": "x", "prediction": 3}) + "\n")
    with pytest.raises(InvalidRequest, match="prediction"):
        load_prompt_specs(f)
