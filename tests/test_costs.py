"""The cost model behind the draft length and the lone request's plain-or-speculate choice, and
the probe that measures it (behaviour only: what the measurement returns and what the lane does
with given costs; no timing is asserted)."""

import math

import pytest

from engine_helpers import P, drive, engine
from gmlx.decode import probe
from gmlx.decode.scalar import MIN_ROUNDS_TO_STOP, ScalarLane
from gmlx.drafters.select import select_drafter
from gmlx.policy.costs import PRIOR, Costs, emitted
from gmlx.engine.oracle import decode_alone, make_row
from numerics import same_stream

LM_WITHOUT_EOS = True

CHEAP = Costs(verify=(1.0, 1.05, 1.1, 1.15), draft=0.05, source="test")
DEAR = Costs(verify=(1.0, 2.0, 3.0, 4.0), draft=0.1, source="test")  # a quantized target on a CPU


def test_emitted_and_speedup():
    assert emitted(0.0, 3) == 1.0 and emitted(1.0, 3) == 4.0
    assert math.isclose(emitted(0.5, 2), 1.75)
    assert CHEAP.speedup(0.6, 0) == 1.0
    assert math.isclose(CHEAP.speedup(0.6, 3), emitted(0.6, 3) / (1.15 + 3 * 0.05))
    assert CHEAP.verify_cost(6) == pytest.approx(1.3)  # extrapolated past the measured range


ROWS = Costs(verify=(1.0, 1.1, 1.3, 1.3), draft=0.04, source="test",
             rows=((1, 1.0), (2, 1.1), (3, 1.3), (4, 1.3), (8, 2.0), (16, 3.0)))


def test_a_width_s_costs_are_read_off_the_forwards_of_its_rows():
    """Width w's round of k drafts verifies w (k + 1) rows against a plain step's w: its cost is
    t(w (k + 1)) / t(w), interpolated between the lengths the probe timed (a width-4 verify of K = 2,
    12 rows, between 8 and 16), extrapolated past them; the drafter's step keeps its ratio."""
    assert ROWS.at_width(1) is ROWS and CHEAP.at_width(4) is CHEAP  # nothing longer timed: the same costs
    assert ROWS.row_cost(6) == pytest.approx(1.65) and ROWS.row_cost(32) == pytest.approx(5.0)
    w2, w4 = ROWS.at_width(2), ROWS.at_width(4)
    assert w2.verify == pytest.approx((1.0, 1.3 / 1.1, 1.65 / 1.1, 2.0 / 1.1)) and w2.draft == ROWS.draft
    assert w4.verify == pytest.approx((1.0, 2.0 / 1.3, 2.5 / 1.3, 3.0 / 1.3))
    assert w4.round_cost(2) > ROWS.round_cost(2) and "at width 4" in w4.source
    assert ROWS.at_width(8).verify[1] == pytest.approx(3.0 / 2.0)  # 16 rows over 8
    # a width's round is dearer than the lone request's: the speedup the model predicts is lower
    assert w4.speedup(0.5, 1) < ROWS.speedup(0.5, 1)


def test_best_k():
    assert CHEAP.best_k(0.6, 3) == 3
    assert CHEAP.best_k(0.2, 3) == 1
    assert DEAR.best_k(0.6, 3) == 0  # no draft length pays: plain
    assert DEAR.best_k(0.99, 3) == 0  # a verify of k+1 tokens at k+1 steps never pays
    assert Costs((1.0, 1.5, 2.0, 2.5), 0.0).best_k(0.99, 3) == 3  # at half that, near-total acceptance does
    assert PRIOR.best_k(0.6, 0) == 0


def lane(lm, costs, **kw):
    ln = ScalarLane(lm.target, select_drafter(lm), 3, **kw)
    ln.costs = costs
    return ln


def test_a_lone_request_decodes_plain_where_no_k_pays(lm, prompts):
    row = decode_alone(lane(lm, DEAR), make_row(lm, prompts[5], P(24, seed=1)))
    assert row.stats.num_drafted == 0 and len(row.tokens) == 24
    row = decode_alone(lane(lm, CHEAP), make_row(lm, prompts[5], P(24, seed=1)))
    assert row.stats.num_drafted > 0
    # an explicit request to speculate (may_go_plain=False) speculates whatever the costs
    row = decode_alone(lane(lm, DEAR, may_go_plain=False), make_row(lm, prompts[5], P(24, seed=1)))
    assert row.stats.num_drafted > 0


def test_a_measurement_that_says_plain_is_taken_again_before_a_lone_request_gives_up(lm, monkeypatch):
    """One probe inflated by another process's load must not switch speculation off: a second
    measurement is taken; the cheaper of the two stands (and stays), and only two that agree make
    a lone request plain."""
    dear = Costs(DEAR.verify, DEAR.draft, "measured (test)")
    cheap = Costs(CHEAP.verify, CHEAP.draft, "measured (test)")
    for second, want in ((cheap, 3), (dear, 0)):
        ln = ScalarLane(lm.target, select_drafter(lm), 3)
        calls = []
        monkeypatch.setattr(probe, "_measured", type(probe._measured)())
        monkeypatch.setattr(probe, "measure", lambda *a, s=second: calls.append(a) or (dear if len(calls) == 1 else s))
        monkeypatch.delenv("GMLX_ROUND_COSTS", raising=False)
        assert ln.decide() == want and len(calls) == 2
        assert ln.decide() == want and len(calls) == 2  # measured twice per process, never more
    ln = lane(lm, DEAR)  # figures someone set (a calibration, a test) are not measured again
    assert ln.decide() == 0 and ln.costs is DEAR


def test_it_stops_drafting_once_rounds_show_it_loses(lm, prompts):
    """Costs where the prior acceptance just pays; a drafter that is always wrong: after
    MIN_ROUNDS_TO_STOP rounds the request continues plain, with the same tokens."""
    from gmlx.engine.oracle import run_scalar
    from doubles import ScriptedDrafter

    edge = Costs(verify=(1.0, 1.2, 1.4, 1.6), draft=0.1, source="test")
    wrong = ScriptedDrafter(lm.head, lm.target, lambda pos, k: [0] * k)
    ln = ScalarLane(lm.target, wrong, 3)
    ln.costs = edge
    params = P(48, seed=2)
    row = decode_alone(ln, make_row(lm, prompts[6], params))
    ref = run_scalar(lm, prompts[6], params, speculative=False)
    same_stream(lm, prompts[6], ref.tokens, row.tokens, params)
    assert 0 < row.stats.num_rounds <= MIN_ROUNDS_TO_STOP + 1  # it drafted, then gave up


def test_the_engine_follows_a_calibrated_plain_width_one(lm, prompts, monkeypatch, tmp_path):
    """num_draft_tokens_by_width {1 = 0} (sweep-cap measured that a lone request loses): lone
    requests decode plain; a batch still speculates within the cap."""
    from gmlx.policy.user_config import DEFAULT_MODEL_KEY, write_cap

    monkeypatch.setenv("GMLX_CONFIG", str(tmp_path / "config.toml"))
    write_cap(DEFAULT_MODEL_KEY, 0, k_by_width={1: 0, 2: 3})  # as sweep-cap --write would
    eng = engine(lm, 0)
    assert [eng.spec.ceiling(w) for w in (1, 2)] == [0, 3]
    run = drive(eng, {0: [("a", prompts[8], P(12, seed=1))]})
    assert all(d == 0 for _, e in run.rounds() for _, d, _, _ in e.rows)
    eng.close()


def test_probe_measures_every_length(lm, monkeypatch):
    monkeypatch.delenv("GMLX_ROUND_COSTS", raising=False)
    costs = probe.measure(lm.target, select_drafter(lm), 3)
    assert len(costs.verify) == 4 and costs.verify[0] == 1.0
    assert all(b >= a for a, b in zip(costs.verify, costs.verify[1:]))  # a longer verify never costs less
    assert costs.draft >= 0 and costs.source.startswith("measured")
    # and the rows widths 2 and 4 verify at K = 1-3 (Costs.rows), the verify's lengths among them
    assert [n for n, _ in costs.rows] == [1, 2, 3, 4, 6, 8, 12, 16]
    assert [v for _, v in costs.rows][:4] == list(costs.verify)
    assert all(b >= a for (_, a), (_, b) in zip(costs.rows, costs.rows[1:]))
    assert [n for n, _ in probe.measure(lm.target, select_drafter(lm), 1).rows] == [1, 2, 4, 8]  # K = 1
    monkeypatch.setenv("GMLX_ROUND_COSTS", "prior")
    assert probe.round_costs(lm.target, select_drafter(lm), 3).verify == PRIOR.verify
