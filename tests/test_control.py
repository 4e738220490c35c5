"""The online control of speculation (gmlx/policy/control.py): its arithmetic, and the engine
with it on — unpinned (real round times) and forced both ways (round times replaced by chosen
figures) — where every stream still equals its solo plain stream."""

import re

import pytest

from engine_helpers import P, check_solo, drive
from gmlx import Engine, EngineConfig
from gmlx.config import Switches
from gmlx.engine import speculation
from gmlx.engine.metrics import EventKind
from gmlx.policy import control, thresholds, width_control
from gmlx.policy.control import EXPLORE_FIRST, MIN_EVIDENCE, PLAIN_WINDOW, Acceptance, Controller
from gmlx.policy.thresholds import LONE_MIN_EVIDENCE
from gmlx.policy.width_control import EXPLORE_SOON
from gmlx.policy.costs import Costs
from gmlx.policy.figures import DECAY, LONE_PRIOR_ROUNDS, MARGIN, MIN_ROUNDS_TO_STOP

LM_WITHOUT_EOS = True  # budgets alone end these requests: see conftest.lm
COSTS = Costs(verify=(1.0, 1.1, 1.2, 1.3), draft=0.05)


class _Target:  # the controller keys its shared figures by target: a fresh one per test
    pass


def fresh(costs=COSTS) -> Controller:
    return Controller(_Target(), "mtp", costs)


def feed(ctl, width, k, seconds, accepted, n=1):
    for _ in range(n):
        ctl.observe(width, k, seconds, [(k, accepted)] * width if k else [(0, 0)] * width)


def test_before_any_round_the_cost_model_decides():
    ctl = fresh()
    c = ctl.choose(1, 3)
    assert c.k > 0 and not c.measured and c.gain == pytest.approx(COSTS.speedup(0.6, c.k))
    slow = fresh(Costs(verify=(1.0, 2.0, 3.0, 4.0), draft=0.3))  # a quantized CPU verify: k+1 steps
    assert slow.choose(1, 3).k == 0


def test_measured_rounds_replace_the_cost_model_and_plain_wins_when_speculation_is_slow():
    """Every draft accepted, but a round of drafts takes 5x a plain step: only a plain figure shows
    that speculation loses, so a speculating width measures plain rounds beside its speculative
    ones (a window: gate, plain rounds, resume), then goes plain."""
    ctl = fresh()
    for _ in range(8):
        c = ctl.choose(2, 3)
        if c.window:
            break
        feed(ctl, 2, c.k, 0.050, accepted=c.k)
    assert c.k == 0 and c.window and "plain rounds" in c.reason
    feed(ctl, 2, 0, 0.010, accepted=0, n=PLAIN_WINDOW)
    for _ in range(MIN_EVIDENCE + 2):
        c = ctl.choose(2, 3)
        feed(ctl, 2, c.k, 0.010 if c.k == 0 else 0.050, accepted=c.k)
    assert c.k == 0 and not c.window and "plain" in c.reason
    assert ctl.decided_plain(2) and not ctl.decided_plain(3)


def test_no_acceptance_goes_plain_on_the_cost_model_alone():
    ctl = fresh()
    for _ in range(MIN_EVIDENCE + 4):
        c = ctl.choose(2, 3)
        feed(ctl, 2, c.k, 0.012 if c.k else 0.010, accepted=0)
    assert c.k == 0


def test_speculation_stays_while_it_pays():
    ctl = fresh()
    feed(ctl, 1, 0, 0.010, accepted=0, n=5)
    for _ in range(20):
        c = ctl.choose(1, 3)
        feed(ctl, 1, c.k, 0.012 if c.k else 0.010, accepted=c.k)  # every draft accepted
    assert c.k > 0 and c.gain > 1.5 and c.measured and ctl.switches == 0


def test_a_settled_choice_is_decided_afresh_every_few_rounds_and_a_change_is_seen_within_them(monkeypatch):
    """Once settled, a width's choice is reused by the same caller for DECIDE_EVERY - 1 rounds (the
    arithmetic is a few % of a short round); a try, a window or a new caller decides every time.
    (Its rounds run the K chosen from the prior's first round on: FIRST_K1 off.)"""
    monkeypatch.setattr(width_control, "FIRST_K1", False)
    ctl = fresh()
    feed(ctl, 1, 0, 0.010, accepted=0, n=5)
    for _ in range(20):
        c = ctl.choose(1, 3)
        feed(ctl, 1, c.k, 0.012 if c.k else 0.010, accepted=c.k)
    assert c.k > 0 and ctl.at(1).settled()
    decided = []
    real = control.WidthControl.choose
    monkeypatch.setattr(control.WidthControl, "choose", lambda self, *a, **kw: decided.append(1) or real(self, *a, **kw))
    for _ in range(4 * control.DECIDE_EVERY):
        assert ctl.choose(1, 3).k == c.k
        feed(ctl, 1, c.k, 0.012, accepted=c.k)
    assert len(decided) == 4
    ctl.choose(1, 2)  # another ceiling (another caller): decided now
    ctl.choose(1, 3, Acceptance())  # a request's own acceptance: decided now
    assert len(decided) == 6
    # speculation stops paying (every draft rejected, rounds 3x plain's): plain within DECIDE_EVERY
    # rounds of the first that could show it, as if decided every round
    for n in range(1, 40):
        c = ctl.choose(1, 3)
        if c.k == 0:
            break
        feed(ctl, 1, c.k, 0.030, accepted=0)
    monkeypatch.setattr(control, "DECIDE_EVERY", 1)
    ref = fresh()
    feed(ref, 1, 0, 0.010, accepted=0, n=5)
    for _ in range(20 + 4 * 4):
        r = ref.choose(1, 3)
        feed(ref, 1, r.k, 0.012 if r.k else 0.010, accepted=r.k)
    for m in range(1, 40):
        if ref.choose(1, 3).k == 0:
            break
        feed(ref, 1, 3, 0.030, accepted=0)
    assert c.k == 0 and m <= n < m + 4, (m, n)


def settled(choice: int, spec_periods: list[float], width=2) -> Controller:
    """Width 2 with figures measured: plain rounds 10 ms; K=1 rounds at the given periods, each
    emitting 1.5 tokens per row (one row accepts its draft, one does not); `choice` in force for
    MIN_EVIDENCE rounds."""
    ctl = fresh()
    for s in spec_periods:  # interleaved: every speculative period pairs with a plain one
        ctl.observe(width, 1, s, [(1, 1), (1, 0)])
        feed(ctl, width, 0, 0.010, accepted=0)
    wc = ctl.at(width)
    wc.current, wc.rounds_in_choice = choice, MIN_EVIDENCE
    return ctl


def test_the_doubt_goes_to_plain_speculation_is_left_without_margin_and_entered_with_one():
    """Asymmetric hysteresis (never lose): speculating at a predicted 0.97x is left at once (the
    old symmetric 5 % margin kept it); from plain, a 1.03x prediction is not worth leaving for,
    a steady 1.10x is."""
    losing = settled(1, [0.0155] * 8)  # 1.5 * 10 / 15.5 = 0.97
    assert losing.choose(2, 1).k == 0
    near = settled(0, [0.01456] * 8)  # 1.03x
    c = near.choose(2, 1)
    assert c.k == 0 and c.best_spec[1] == pytest.approx(1.03, abs=0.01)
    steady = settled(0, [0.0136] * 8)  # 1.10x, every period alike
    c = steady.choose(2, 1)
    assert c.k == 1 and c.gain == pytest.approx(1.10, abs=0.01) and c.measured


@pytest.mark.parametrize("period, stays", [(0.0148, False), (0.0144, True)])  # 1.01x, 1.04x
def test_speculation_predicted_barely_above_plain_is_left(period, stays):
    """A steady gain under STAY (3 %) does not pay for what the steady estimate leaves out (arming,
    a gate and resume, rows finishing apart): left for plain; 4 % stays."""
    ctl = settled(1, [period] * 8)
    assert (ctl.choose(2, 1).k == 1) is stays


def test_an_exploration_stays_only_if_its_gain_is_sure():
    """Plain at a width, then an exploration of K=1 measuring 1.04x: above STAY (speculation in
    force at 1.04x stays), but a try must pass the entry test (5 %, above the noise) to stay, so
    plain comes back after MIN_EVIDENCE rounds."""
    ctl = settled(0, [0.0144] * 8)
    wc = ctl.at(2)
    wc.plain_run = wc.explore_after
    c = ctl.choose(2, 1)
    assert c.k == 1 and c.exploring
    ks = []
    for _ in range(MIN_EVIDENCE + 1):
        ctl.observe(2, 1, 0.0144, [(1, 1), (1, 0)])
        ks.append(ctl.choose(2, 1).k)
    assert ks[:MIN_EVIDENCE - 1] == [1] * (MIN_EVIDENCE - 1) and ks[-1] == 0, ks


@pytest.mark.parametrize("doubt, ms, gaps", [(0.3, 12.0, [EXPLORE_SOON] * 3),  # 1.25x +- 0.38: again soon
                                              (0.3, 15.5, [EXPLORE_FIRST, 2 * EXPLORE_FIRST]),  # 0.97x: back off
                                              (0.0, 12.0, [])])  # 1.25x, sure: stays
def test_a_width_plain_for_want_of_certainty_tries_again_soon(monkeypatch, doubt, ms, gaps):
    """Width 2, K=1 rounds emit 1.5 tokens per row against plain's 1 at 10 ms. At 12 ms (1.25x) a
    try whose doubt is 0.3 is not sure and goes plain; the expected gain of another try is positive
    and evidence is what is missing, so it comes after EXPLORE_SOON plain rounds, every time. At
    15.5 ms (0.97x) plain is no want of certainty: the back-off doubles. Sure: no plain at all."""
    monkeypatch.setattr(width_control, "gain_doubt", lambda *a, **k: doubt)
    ctl = fresh()
    feed(ctl, 2, 0, 0.010, accepted=0, n=8)
    tries = []
    for _ in range(EXPLORE_FIRST * 3 + 60):
        plain_run = ctl.at(2).plain_run
        c = ctl.choose(2, 1)
        if c.exploring:
            tries.append(plain_run)
        ctl.observe(2, c.k, 0.010 if c.k == 0 else ms / 1e3, [(1, 1), (1, 0)] if c.k else [(0, 0)] * 2)
    # (a settled plain choice is decided afresh every DECIDE_EVERY rounds: a try may come that much later)
    assert len(tries) >= len(gaps) and all(g <= t < g + control.DECIDE_EVERY for t, g in zip(tries, gaps)), tries
    assert bool(tries) is bool(gaps)
    assert ctl.decided_plain(2) is bool(doubt)


def test_a_confirmed_try_starts_the_back_off_over():
    """An exploration (after 256 plain rounds, say) that measures a sure 1.25x stays, and the next
    time the width goes plain it tries again after EXPLORE_FIRST rounds, not 512: speculation won."""
    ctl = settled(1, [0.012] * 8)
    wc = ctl.at(2)
    wc.tentative, wc.explore_after = True, 4 * EXPLORE_FIRST
    c = ctl.choose(2, 1)
    assert c.k == 1 and not wc.tentative and wc.explore_after == EXPLORE_FIRST


def test_a_new_lone_request_starts_from_the_requests_before_not_the_last_ones_end():
    """Width 1's pool decays at LONE_DECAY: 60 rounds accepting half their drafts, then 20 accepting
    none (the end of one request) leave the pool well above what the per-round DECAY would
    leave; a request's copy follows its own rounds at DECAY, its rates worth LONE_PRIOR_ROUNDS rounds."""
    ctl = fresh()
    for i in range(60):
        ctl.observe(1, 1, None, [(1, i % 2)])
    for _ in range(20):
        ctl.observe(1, 1, None, [(1, 0)])
    quick = Acceptance()
    for i in range(60):
        quick.record(1, i % 2)
    for _ in range(20):
        quick.record(1, 0)
    pool, own = ctl.at(1).acceptance, ctl.pooled(1)
    assert pool.alpha > quick.alpha + 0.05 and own.alpha == pytest.approx(pool.alpha), (pool.alpha, quick.alpha)
    assert own.decay == DECAY and own.depth[0][1] == pytest.approx(LONE_PRIOR_ROUNDS)  # the pool's 100 rounds, worth 8
    assert ctl.at(2).acceptance.decay == DECAY  # batch widths keep the per-round rate


def _lone_request_after_a_pool(accepts, rounds=60):
    """Width 1 after 100 K=3 rounds accepting 1 draft a round on average (2 tokens in 1.4 plain
    steps: 1.43x, paired with plain rounds); then one request whose round r accepts accepts(r) of
    its drafts, stopped as the scalar lane stops it (gmlx/decode/scalar.py). The round it went
    plain at, or None."""
    ctl = fresh()
    for i in range(100):
        ctl.observe(1, 3, 0.014, [(3, (1, 1, 2, 0)[i % 4])])
        if i % 6 == 0:
            feed(ctl, 1, 0, 0.010, accepted=0)
    wc = ctl.at(1)
    wc.current, wc.rounds_in_choice = 3, MIN_EVIDENCE
    return _lone_request(ctl, 3, accepts, rounds, lambda k: 0.010 + 0.004 * k / 3)


def _lone_request(ctl: Controller, max_k: int, accepts, rounds: int, period) -> int | None:
    """One lone request on `ctl` whose round r accepts accepts(r) of its drafts (a round of k
    drafts takes period(k) s), stopped as the scalar lane stops it: the round it went plain at,
    or None."""
    own = ctl.pooled(1)
    for r in range(1, rounds + 1):
        c = ctl.choose(1, max_k, own)
        if own.rounds >= MIN_ROUNDS_TO_STOP and c.k == 0:
            return r
        k = max(1, c.k)  # before it may stop, a plain choice still drafts one (ScalarLane.round_k)
        a = min(k, accepts(r))
        own.record(k, a)
        ctl.observe(1, k, period(k), [(k, a)])
    return None


def test_a_lone_request_unlike_the_pool_goes_plain_on_its_own_rounds():
    """A request that accepts nothing after requests that accepted well (a chat answer after code
    ones) starts from the pool's rates worth LONE_PRIOR_ROUNDS rounds, so its own rounds decide:
    plain by round 25 (its prior's 8 rounds at 0.75 decay behind its own; until 2026-12-05 its
    rounds were also counted in the width's tokens per round that its acceptance then scaled,
    which sent it plain by 13 but also sent plain one whose K = 1 paid — the next case). One that
    accepts a quarter of its drafts at K = 1 (1.25 tokens in 1.13 plain steps: 1.10x) drafts on,
    as does one that accepts like the pool, and one whose first MIN_ROUNDS_TO_STOP rounds accept
    nothing (a code answer's prose before its code)."""
    assert 13 <= _lone_request_after_a_pool(lambda r: 0) <= 25
    assert _lone_request_after_a_pool(lambda r: 1 if r % 4 == 0 else 0) is None
    assert _lone_request_after_a_pool(lambda r: (1, 1, 2, 0)[r % 4]) is None
    assert _lone_request_after_a_pool(lambda r: 0 if r <= 8 else (1, 1, 2, 0)[r % 4]) is None


def _plain_pool(alpha_sixths: int, ctl: Controller | None = None, rounds: int = 48) -> Controller:
    """Width 1 of `ctl` (default: a fresh one), plain in force (the last request went plain): K=1
    rounds at 12 ms accepting alpha_sixths / 6 of their drafts, paired with 10 ms plain rounds."""
    ctl = ctl or fresh()
    for i in range(rounds):
        ctl.observe(1, 1, 0.012, [(1, int(i % 6 < alpha_sixths))])
        if i % 6 == 5:
            feed(ctl, 1, 0, 0.010, accepted=0, n=3)
    wc = ctl.at(1)
    wc.current, wc.rounds_in_choice, wc.plain_run = 0, 4 * MIN_EVIDENCE, 0
    return ctl


def test_a_new_lone_request_tries_k1_unless_the_pool_predicts_a_clear_loss(monkeypatch):
    """Plain in force, K=1 predicted ~0.97x on the pool (1.17 tokens in 1.2 plain steps): a new
    request tries K=1 (width_control.LONE_TRY) — requests differ, and decided on the pool a code
    request after chat ones decoded plain throughout. The try stays only if the request's own
    gain is sure: one accepting every draft keeps drafting, one like the pool goes plain as soon
    as it may. A pool accepting nothing (0.83x predicted, under TRY_FIRST) starts no try; without
    the rule the plain pool's hysteresis keeps a new request plain."""
    ctl = _plain_pool(1)
    c = ctl.choose(1, 1, ctl.pooled(1))
    assert c.k == 1 and ctl.at(1).tentative and "trying K=1 on this request's own rounds" in c.reason, c.reason
    assert _lone_request(_plain_pool(1), 1, lambda r: 1, 30, lambda k: 0.012) is None
    assert _lone_request(_plain_pool(1), 1, lambda r: int(r % 6 == 0), 30, lambda k: 0.012) == MIN_ROUNDS_TO_STOP + 1
    ctl = _plain_pool(0)
    assert ctl.choose(1, 1, ctl.pooled(1)).k == 0
    monkeypatch.setattr(width_control, "LONE_TRY", False)
    ctl = _plain_pool(1)
    assert ctl.choose(1, 1, ctl.pooled(1)).k == 0


@pytest.mark.parametrize("own, speculates", [(0.1, False), (0.5, True)])
def test_a_lone_request_is_decided_on_its_own_acceptance(own, speculates):
    """Width 1: K=1 rounds pooled over requests emit 1.5 tokens (alpha 0.5) in 12.5 ms against
    10 ms plain: 1.2x. A request that accepts 10 % of its drafts is predicted E(0.1) * 10 / 12.5 =
    0.88x (its own tokens per round, not the pool's) and goes plain; one at 0.5 keeps K=1."""
    ctl = fresh()
    for i in range(16):  # plain rounds between: the two costs paired
        ctl.observe(1, 1, 0.0125, [(1, i % 2)])
        feed(ctl, 1, 0, 0.010, accepted=0)
    wc = ctl.at(1)
    wc.current, wc.rounds_in_choice, pool = 1, MIN_EVIDENCE, wc.acceptance.alpha
    assert pool == pytest.approx(0.5, abs=0.05)
    c = ctl.choose(1, 1, Acceptance(own * 20, (1 - own) * 20))
    assert (c.k == 1) is speculates, c
    assert wc.spec.tokens_per_round(1) == pytest.approx(1.5)  # the pool's, not used for the lone request
    assert c.best_spec[1] == pytest.approx((1 + own) * 10 / 12.5, rel=1e-6)


@pytest.mark.parametrize("point", [True, False])
def test_a_lone_requests_try_is_kept_on_its_predicted_gain_once_paired(monkeypatch, point):
    """Width 1 paired (K=1 rounds at 9.5 or 15.5 ms beside 10 ms plain ones: ratio 1.21, its error
    0.08); a request's try of K=1 at acceptance 0.35 is predicted 1.11x, within Z standard errors of
    plain. With LONE_POINT (the request re-arms if sent plain: gmlx/decode/scalar.py) the predicted
    gain keeps it; without, the doubt sends it plain."""
    monkeypatch.setattr(width_control, "LONE_POINT", point)
    ctl = fresh()
    for i in range(16):
        ctl.observe(1, 1, (0.0095, 0.0155)[i % 2], [(1, i % 2)])
        feed(ctl, 1, 0, 0.010, accepted=0)
    wc = ctl.at(1)
    assert wc.pairs.ratio(1) == pytest.approx(1.21, abs=0.01) and wc.pairs.error(1) > 0.05
    wc.current, wc.rounds_in_choice, wc.tentative = 1, MIN_EVIDENCE, True
    c = ctl.choose(1, 1, Acceptance(0.35 * 20, 0.65 * 20, 10))
    assert c.best_spec[1] == pytest.approx(1.11, abs=0.01)
    assert (c.k == 1) is point and ("within noise" in c.reason) is not point, c.reason


@pytest.mark.parametrize("own, soon", [((2.0, 14.0), True), ((0.0, 60.0), False)])
def test_a_lone_request_sent_plain_near_even_tries_again_soon(own, soon):
    """Width 1 paired (K=1 rounds 1.2x a plain one's, 1.5 tokens a round pooled), plain in force for
    a request whose own drafts agreed 2 times in 16 (K=1 predicted 0.94x): within its acceptance's
    standard error of plain (width_control.acceptance_doubt), so it tries again after EXPLORE_SOON
    plain rounds, not the back-off's EXPLORE_FIRST. One that agreed 0 times in 60 (0.83x) waits."""
    ctl = fresh()
    for i in range(16):
        ctl.observe(1, 1, 0.012, [(1, i % 2)])
        feed(ctl, 1, 0, 0.010, accepted=0)
    wc = ctl.at(1)
    wc.current, wc.rounds_in_choice, wc.plain_run = 0, 4 * MIN_EVIDENCE, 0
    acc, ks = Acceptance(*own, 10), []
    for _ in range(EXPLORE_SOON + 1):
        c = ctl.choose(1, 1, acc)
        ks.append(c.k)
        feed(ctl, 1, c.k, 0.012 if c.k else 0.010, accepted=0)
    assert ks[:EXPLORE_SOON] == [0] * EXPLORE_SOON and (ks[-1] == 1) is soon, ks
    assert EXPLORE_SOON < EXPLORE_FIRST


def test_a_gain_within_the_machines_noise_does_not_leave_plain():
    """The same 1.10x median gain, but the speculative periods swing 8 ms either way (a noisy VM):
    its standard error exceeds its margin over plain, so plain stays, said with the noise."""
    noisy = settled(0, [0.0096, 0.0136, 0.0176] * 3)
    c = noisy.choose(2, 1)
    assert c.k == 0 and c.doubt > 0.1
    assert "within noise" in c.reason and "best K=1 predicted 1.10x" in c.reason, c.reason


def test_an_untried_k_that_could_not_win_is_not_measured():
    """K=1 measured at 1.05x with acceptance ~0.16; K=2's round costs 1.4 plain ones: even if its
    second draft always agreed once the first did (its hope) it would lose, so the control does
    not spend rounds measuring it; K=3 (2.2) likewise."""
    ctl = fresh(Costs(verify=(1.0, 1.05, 1.47, 2.2), draft=0.0))
    for i in range(8):
        ctl.observe(1, 1, 0.0105, [(1, 0)] if i % 10 else [(1, 1)])
    feed(ctl, 1, 0, 0.010, accepted=0, n=8)
    wc = ctl.at(1)
    wc.current = 1
    g1 = wc.gain(1, ctl.costs, wc.acceptance)[0]
    hopes = [wc.gain(k, ctl.costs, wc.acceptance, hope=True)[0] for k in (2, 3)]
    assert g1 > 1.0 and max(hopes) < 1.0, (g1, hopes)
    tried = {ctl.choose(1, 3).k for _ in range(4)}
    assert tried == {1}, tried


def test_a_deep_k_the_geometric_model_undervalues_is_tried_and_kept():
    """SmolLM2 float32 with its EAGLE-3 head (bench_results/20261202T152833Z): K=1 rounds accept
    37 % of drafts, a K=3 round costs ~1.6 plain ones; geometric at 0.37, K=3 would yield 1.56
    tokens (0.97x) and was never run, yet its rounds accepted 0.96 drafts (1.96 tokens, ~1.2x)
    as the deeper drafts agree once the first does. Its hope (deeper positions as if they always
    agreed) is worth a try, the try measures it, and a K whose few rounds were unlucky is measured
    again later (RETRY_AFTER). Simulated rounds, 8 seeds: always K=1 earns 1.17x, K=2 1.24x, K=3
    1.32x; the control must earn more than K=1 (the geometric model's pick) — it earned 1.16x
    (median) before the hope and the retry, 1.26x with them."""
    import random
    import statistics

    cost = (1.0, 1.17, 1.4, 1.6)
    earned = []
    for seed in range(8):
        rng = random.Random(seed)
        ctl = fresh(Costs(verify=cost, draft=0.0))
        for i in range(60):  # plain and K=1 runs side by side: K=1's ratio paired
            k = (i // 6) % 2
            feed(ctl, 1, k, 0.010 * cost[k], accepted=int(rng.random() < 0.37))
        wc = ctl.at(1)
        wc.current, wc.rounds_in_choice = 1, 6
        if seed == 0:
            assert wc.gain(3, ctl.costs, wc.acceptance)[0] < 1.0 < wc.gain(3, ctl.costs, wc.acceptance, hope=True)[0]
        tokens = seconds = 0.0
        ran = set()
        for _ in range(400):  # the control decides each round
            c = ctl.choose(1, 3)
            k = 0 if c.window else c.k
            first = rng.random() < 0.37  # once the first draft agrees, the rest do
            ctl.observe(1, k, 0.010 * cost[k], [(k, k if first else 0)] if k else [(0, 0)])
            tokens, seconds, ran = tokens + 1 + (k if first else 0), seconds + cost[k], ran | {k}
        assert 3 in ran
        earned.append(tokens / seconds)
    assert statistics.median(earned) > 1.2, earned


def test_tokens_per_round_count_steady_rounds_only():
    """Right after an admission the new rows' drafters have little history: those rounds' tokens
    are not what a K buys in steady state and do not count (as their times do not). The micro
    model's K=3, measured only there at 1.5 tokens a round, was never tried again (3.8 later)."""
    ctl = fresh()
    for _ in range(4):
        ctl.observe(8, 3, None, [(0, 0)] * 8, steady=False)  # drafts found nothing yet
    assert ctl.at(8).spec.tokens_per_round(3) is None
    for _ in range(4):
        ctl.observe(8, 3, None, [(3, 3)] * 8)
    assert ctl.at(8).spec.tokens_per_round(3) == 4.0


def test_a_width_decided_plain_tries_speculation_again_after_a_run_of_plain_rounds():
    ctl = fresh(Costs(verify=(1.0, 3.0, 4.0, 5.0), draft=0.5))
    assert ctl.choose(4, 3).k == 0
    tries = 0
    for _ in range(EXPLORE_FIRST * 3 + 2):
        c = ctl.choose(4, 3)
        tries += c.exploring
        feed(ctl, 4, c.k, 0.03 if c.k else 0.01, accepted=0)
    assert 1 <= tries <= 2  # after 64 plain rounds, then after 128 more (the wait doubles)


def test_a_new_engine_continues_from_what_this_process_learnt_about_the_target():
    t = _Target()
    first = Controller(t, "mtp", COSTS)
    for _ in range(MIN_EVIDENCE + 4):
        c = first.choose(2, 3)
        feed(first, 2, c.k, 0.012 if c.k else 0.010, accepted=0)
    assert first.decided_plain(2)
    second = Controller(t, "mtp", COSTS)  # the next bench cell, another Engine on the same model
    assert second.decided_plain(2) and second.choose(2, 3).k == 0
    assert not Controller(t, "ngram", COSTS).decided_plain(2)  # another drafter decides for itself
    control.record_plain(t, 3, 0.004)  # a plain baseline's rounds count for every drafter
    assert Controller(t, "draft", COSTS).at(3).plain.by_k[0][-1] == 0.004


def test_a_new_width_starts_from_the_acceptance_the_drafter_showed_nearby():
    ctl = fresh()
    for _ in range(20):
        feed(ctl, 1, 3, 0.01, accepted=0)
    assert ctl.at(2).acceptance.alpha < 0.2 and ctl.at(2).acceptance.rounds == 0
    assert Controller(_Target(), "mtp", COSTS).at(2).acceptance.alpha == pytest.approx(0.6)  # nothing seen: the prior


def test_a_new_width_predicts_from_the_nearest_timed_widths_round_times():
    """The load probe (width 1) says drafts are nearly free; width 4's rounds say K=3 costs two
    plain rounds. Width 8, with nothing timed yet, starts from width 4's ratio (plain: no K pays
    within 10 %), not from the probe (K=3); once its own rounds are timed, they decide."""
    probe = Costs(verify=(1.0, 1.02, 1.04, 1.06), draft=0.01)
    first = fresh(probe).choose(8, 3)  # nothing timed anywhere: the cost model speculates, deeply ...
    assert first.best_spec[0] >= 2 and first.k == 1  # ... after its first rounds measure K=1 (FIRST_K1)
    ctl = fresh(probe)
    feed(ctl, 4, 0, 0.010, accepted=0, n=4)
    feed(ctl, 4, 3, 0.020, accepted=1, n=4)
    c = ctl.choose(8, 3)
    assert c.k == 0 and "width 4's round times" in c.reason, c.reason
    feed(ctl, 8, 0, 0.010, accepted=0, n=4)
    feed(ctl, 8, 1, 0.0105, accepted=1, n=4)  # width 8's own: K=1 costs 1.05 plain rounds and pays
    c = ctl.choose(8, 3)
    assert c.k >= 1 and c.from_width is None, c


def test_a_width_with_a_timed_neighbour_borrows_its_plain_ratio_instead_of_a_plain_window():
    """Width 2 timed both ways (plain 10 ms, K=2 15 ms). Width 3 speculates with no plain round of
    its own: no gate-and-resume window to measure plain there; its plain time is its K=2 time
    (18 ms) through width 2's ratio, 12 ms. Alone (no neighbour), the window runs."""
    ctl = fresh()
    feed(ctl, 2, 0, 0.010, accepted=0, n=4)
    feed(ctl, 2, 2, 0.015, accepted=2, n=4)
    for _ in range(8):
        ctl.observe(3, 2, 0.018, [(2, 2)] * 3)
        c = ctl.choose(3, 2)
        assert not c.window
    assert c.k == 2 and c.plain_s == pytest.approx(0.012) and c.gain == pytest.approx(3 * 12 / 18)
    alone = fresh()
    windows = []
    for _ in range(8):
        alone.observe(3, 2, 0.018, [(2, 2)] * 3)
        windows.append(alone.choose(3, 2).window)
    assert any(windows)


@pytest.mark.parametrize("rows", [True, False])
def test_a_borrowed_ratio_is_scaled_by_the_probes_rows_costs(rows):
    """Width 2 timed both ways: K = 1 costs 1.2 plain rounds there and accepts 0.4 of its drafts
    (1.4 tokens a round: 1.17x). Width 4, nothing timed, borrows width 2's ratio — scaled by the
    probe's rows, where width 4's K = 1 (8 rows) costs 2.0 / 1.3 = 1.54 plain rounds against width
    2's 1.3 / 1.1 = 1.18: 1.2 x 1.30 = 1.56 there, a loss, so width 4 decodes plain and says why. With
    no rows (width 1's costs at every width) the ratio is borrowed as it is, and width 4 speculates."""
    costs = Costs(verify=(1.0, 1.1, 1.3, 1.3), draft=0.0,
                  rows=((1, 1.0), (2, 1.1), (3, 1.3), (4, 1.3), (8, 2.0), (16, 3.0)) if rows else ())
    ctl = fresh(costs)
    feed(ctl, 2, 0, 0.010, accepted=0, n=4)
    feed(ctl, 2, 1, 0.012, accepted=0, n=6)
    for _ in range(4):
        ctl.observe(2, 1, 0.012, [(1, 1), (1, 0)])
    c = ctl.choose(4, 1)
    assert c.from_width == 2 and "width 2's round times" in c.reason, c
    lift = costs.at_width(4).round_cost(1) / costs.at_width(2).round_cost(1)
    assert ctl.at(4).lift == {1: pytest.approx(lift)} and (lift > 1.25) is rows
    assert (c.k == 0) is rows, c.reason


def test_acceptance_decays_so_a_drafter_that_starts_agreeing_is_seen():
    a = Acceptance()
    for _ in range(30):
        a.record(3, 0)
    low = a.alpha
    for _ in range(30):
        a.record(3, 3)
    assert low < 0.1 and a.alpha > 0.8


# ---- the engine with the control on --------------------------------------------------------
def forced(monkeypatch, spec_cost: float):
    """Round times replaced: plain rounds 10 ms, speculative ones spec_cost x 10 ms."""
    real = speculation.Speculation.record_time

    def record_time(self, width, k, seconds):
        return real(self, width, k, 0.010 * (spec_cost if k else 1.0))

    monkeypatch.setattr(speculation.Speculation, "record_time", record_time)


def on(lm, cap=0, **kw):
    return Engine(lm, EngineConfig(width_cap=cap, **kw), switches=Switches(control=True))


def schedule(prompts, n=48):
    return {0: [("a", prompts[0], P(n)), ("b", prompts[1], P(n, seed=2, t=0.8))],
            3: [("c", prompts[2], P(n)), ("d", prompts[3], P(n, seed=4, t=0.8))]}


def test_the_refills_an_engine_saw_carry_to_the_next_on_the_same_target(lm, prompts, clean):
    """A closed loop (each finished request's place taken by the next at once) on one engine: the
    drain charge's weight falls from the prior (1.0, every finish a drain). A new engine on the
    same target (a bench's next cell, a server's next engine) starts from that share, not from the
    prior; `forget` drops it with the rest of the target's figures."""
    first = on(lm)
    assert first.spec.refills.drain_share == 1.0
    todo, live = [prompts[i % len(prompts)] for i in range(8)], []
    while todo or live:
        while todo and len(live) < 2:
            live.append(first.submit(todo.pop(0), P(6 + 3 * len(todo)), start=False))  # finishes apart
        first.step()
        live = [s for s in live if not s.done]
    seen = first.spec.refills.drain_share
    assert seen < 0.6
    assert on(lm).spec.refills.drain_share == seen
    control.forget(lm.target)
    assert on(lm).spec.refills.drain_share == 1.0


def test_forced_plain_the_batch_gates_and_every_stream_equals_solo(lm, prompts, clean, monkeypatch):
    forced(monkeypatch, spec_cost=6.0)  # a round of drafts costs six plain rounds: never pays
    eng = on(lm)
    run = drive(eng, schedule(prompts))
    check_solo(lm, run)
    reasons = [e.reason or "" for _, e in run.events() if e.transition == "gate"]
    assert any("plain" in r for r in reasons), reasons  # the window's plain rounds, or the decision's
    assert eng.spec.control.decided_plain(4)
    said = [e for _, e in run.events() if e.kind is EventKind.DECISION]  # said out loud, once per switch
    assert any("plain: best K=" in e.reason and "(measured)" in e.reason for e in said), [e.reason for e in said]
    assert said and eng.counters.control_switches == len(said) and any("plain" in e.reason for e in said)
    from gmlx.serve.prometheus import EngineCollector

    text = {m.name: m for m in EngineCollector(eng, "m").collect()}
    assert text["gmlx:control_switches"].samples[0].value == len(said)
    drafting = sum(any(r[1] for r in e.rows) for _, e in run.rounds())  # rounds that checked drafts
    assert 0 < eng.counters.speculative_rounds == drafting < eng.counters.rounds
    assert text["gmlx:speculative_rounds"].samples[0].value == drafting
    assert any(s.labels["width"] == "4" and s.value == 0 for s in text["gmlx:speculation_k"].samples)
    eng.close()


def test_forced_speculative_the_batch_keeps_speculating_and_every_stream_equals_solo(lm, prompts, clean,
                                                                                      monkeypatch):
    forced(monkeypatch, spec_cost=1.05)  # drafts nearly free: speculation pays whenever one is accepted
    eng = on(lm)
    run = drive(eng, schedule(prompts, n=96))
    check_solo(lm, run)
    spec = [e for _, e in run.rounds() if e.round == "speculative"]
    plain = [e for _, e in run.rounds() if e.round == "plain"]
    assert len(spec) > len(plain)
    tr = run.transitions()  # the once-only plain measurement at a width: gate, then resume
    reasons = [e.reason or "" for _, e in run.events() if e.transition == "gate"]
    assert "resume" in tr[tr.index("gate"):] and "measuring plain rounds" in reasons[0], (tr, reasons)
    eng.close()


@pytest.mark.parametrize("first_k1", [True, False])
def test_a_widths_first_speculative_rounds_measure_k1(monkeypatch, first_k1):
    """Width 2, nothing measured: the prior (alpha 0.6) predicts the ceiling K=3 best. Its first
    MIN_EVIDENCE speculative rounds run K=1 (thresholds.FIRST_K1: the cheapest measurement of the
    acceptance; a first try at K=3 that went badly sent SmolLM2 code at c = 4 plain for 102 of 118
    rounds in the simulated engine, benchmarks/sim_control.py), then the best predicted K; without
    the rule K=3 runs from the first round."""
    monkeypatch.setattr(width_control, "FIRST_K1", first_k1)
    ctl = fresh()
    ks = []
    for _ in range(3 * MIN_EVIDENCE):
        ks.append(ctl.choose(2, 3).k)
        feed(ctl, 2, ks[-1], 0.010 * COSTS.round_cost(ks[-1]), accepted=ks[-1], n=1)  # every draft agrees
    drafting = [k for k in ks if k]
    if first_k1:
        assert drafting[:MIN_EVIDENCE] == [1] * MIN_EVIDENCE and drafting[-1] == 3, ks
    else:
        assert drafting[0] == 3, ks


@pytest.mark.parametrize("first_k1", [True, False])
def test_a_new_batchs_first_round_drafts_the_controls_choice(lm, prompts, clean, monkeypatch, first_k1):
    """Two requests submitted together form an armed batch in the step that plans it, before any
    choice at width 2: its first round drafts what the control chooses there now (K=1 under
    FIRST_K1), not the ceiling (gmlx before 2026-12-05); every stream equals its solo plain one."""
    monkeypatch.setattr(width_control, "FIRST_K1", first_k1)
    forced(monkeypatch, spec_cost=1.05)
    chosen = []  # per speculative batch round: the control's choice in force when its K was set
    real = speculation.Speculation.batch_k

    def batch_k(self, width, rows):
        k = real(self, width, rows)
        chosen.append(self.choice and self.choice.k)
        return k

    monkeypatch.setattr(speculation.Speculation, "batch_k", batch_k)
    eng = on(lm)
    run = drive(eng, {0: [("a", prompts[0], P(32)), ("b", prompts[1], P(32, seed=2, t=0.8))]})
    check_solo(lm, run)
    first = next(e for _, e in run.rounds() if e.round == "speculative")
    drafted = {d for _rid, d, _a, _n in first.rows}
    assert drafted == {chosen[0]}, (drafted, chosen)
    assert chosen[0] == 1 if first_k1 else 1 <= chosen[0] <= eng.k, chosen
    eng.close()


@pytest.mark.parametrize("spec_cost, plain_at_end", [(6.0, True), (1.05, False)])
def test_a_lone_request_follows_the_measured_choice_and_its_stream_holds(lm, prompts, clean, monkeypatch,
                                                                         spec_cost, plain_at_end):
    """Nothing paired yet: the first lone request speculates on the load probe's costs and runs the
    control's plain window mid-request (it keeps its drafter and re-arms after it: thresholds.REARM_MIN),
    which pairs the two kinds of round; from then on it, and the next request, are decided on the
    paired cost (6x: plain; 1.05x: they keep drafting)."""
    forced(monkeypatch, spec_cost)
    eng = on(lm)
    params = P(64, seed=9, t=0.8)
    run = drive(eng, {0: [("a", prompts[5], params)], 100: [("b", prompts[4], params)]})  # one after the other
    check_solo(lm, run)
    first, second = run.streams["a"].result, run.streams["b"].result
    kinds = [d > 0 for *_, d, _e in run.rounds_of("a")]
    assert True in kinds[kinds.index(False):]  # the window ran mid-request: drafting resumed after it
    pairs = eng.spec.control.at(1).pairs  # the window's plain rounds paired with the drafting ones
    assert pairs.paired() and all(pairs.ratio(k) == pytest.approx(spec_cost) for k in pairs.paired())
    for req in (first, second):
        assert req.stats["speculation"].startswith("plain") is plain_at_end, req.stats["speculation"]
    eng.close()


def _lone_try_run(lm, prompt, monkeypatch, lone_try: bool) -> dict:
    """The engine's width 1 decided plain on earlier requests with K=1 predicted ~0.98x (1.18
    tokens a round at 1.2 plain steps, paired); then one request: its stats, its stream checked
    against its solo plain decode."""
    monkeypatch.setattr(width_control, "LONE_TRY", lone_try)
    forced(monkeypatch, 1.2)
    eng = on(lm)
    _plain_pool(1, eng.spec.control, rounds=60)  # earlier requests: K=1 accepting 1 in 6, paired with plain rounds
    run = drive(eng, {0: [("a", prompt, P(32, seed=9, t=0.8))]})
    check_solo(lm, run)
    eng.close()
    return run.streams["a"].result.stats


@pytest.mark.parametrize("lone_try", [True, False])
def test_a_new_lone_request_tries_k1_where_plain_is_in_force_and_its_stream_holds(lm, prompts, clean, monkeypatch,
                                                                                   lone_try):
    """A new request drafts K=1 on its own rounds where plain is in force (width_control's
    LONE_TRY); without it, it decodes plain throughout. Either way its stream is plain's."""
    stats = _lone_try_run(lm, prompts[5], monkeypatch, lone_try)
    assert (stats["num_drafted"] > 0) is lone_try, stats


@pytest.mark.parametrize("lone_try", [True, False])
def test_smollm2_a_new_lone_request_tries_k1_where_plain_is_in_force(smollm2, monkeypatch, lone_try):
    """The same on the real model with its shipped head (the try branch and its absence)."""
    lm = smollm2.load("float32")
    control.forget(lm.target)
    stats = _lone_try_run(lm, lm.tokenizer.encode("def fibonacci(n):\n"), monkeypatch, lone_try)
    control.forget(lm.target)
    assert (stats["num_drafted"] > 0) is lone_try, stats


def test_unpinned_real_round_times_every_stream_equals_solo(lm, prompts, clean):
    eng = on(lm)
    run = drive(eng, schedule(prompts, n=40))
    check_solo(lm, run)
    assert all(r.result.stats["speculation"] for r in run.streams.values())
    eng.close()


def test_a_lone_request_under_cap_off_says_what_the_scalar_loop_ran(lm, prompts, clean):
    """The cap governs batches only: a lone request under cap "off" still speculates, and says so."""
    eng = on(lm, cap="off")
    run = drive(eng, {0: [("a", prompts[5], P(24))]})
    check_solo(lm, run)
    rec = run.streams["a"].result
    assert "over the cap" not in rec.stats["speculation"] and rec.stats["num_drafted"] > 0, rec.stats
    eng.close()


def test_a_drafter_familys_guessed_cap_is_no_ceiling_under_the_control(lm, prompts, clean, monkeypatch):
    """The ngram drafter's family default (cap 2) is a guess for engines that cannot measure: with
    the control on, nothing caps it (said in the cap's source) and a batch of 4 speculates when
    that pays; with the control off, or an explicit K, the family default stays the ceiling."""
    monkeypatch.delenv("GMLX_MTP_WIDTH_CAP", raising=False)
    static = Engine(lm, EngineConfig(drafter="ngram"), switches=Switches(control=False)).cap_in_force
    explicit = Engine(lm, EngineConfig(drafter="ngram", num_draft_tokens=2), switches=Switches(control=True))
    assert (static.cap, static.source) == (2, "family default: ngram drafter") == (
        explicit.cap_in_force.cap, explicit.cap_in_force.source)
    forced(monkeypatch, spec_cost=1.05)  # drafts nearly free: speculation pays at every width
    eng = Engine(lm, EngineConfig(drafter="ngram"), switches=Switches(control=True))
    assert eng.cap_in_force.cap == 0 and "online control decides" in eng.cap_in_force.source
    assert "family default: ngram drafter 2 not applied" in eng.cap_in_force.source
    run = drive(eng, schedule(prompts, n=40))
    check_solo(lm, run)
    assert any(e.round == "speculative" and e.width == 4 for _, e in run.rounds())
    eng.close()


def test_an_explicit_k_is_obeyed_and_the_switch_turns_the_control_off(lm, clean):
    assert on(lm, num_draft_tokens=2).spec.control is None
    assert Engine(lm, EngineConfig(), switches=Switches(control=False)).spec.control is None
    assert on(lm).spec.control is not None


def test_an_explicit_k_drafts_k_every_round_of_a_lone_request(lm, prompts, clean):
    """`--num-draft-tokens 3` means 3 drafts a round, as in mlx-lm and vLLM, for the lone request
    too, even where the cost model would pick fewer (K = 1 here: a 3-draft verify made to cost 5
    steps); only the request's last rounds draft fewer (never past its budget)."""
    eng = on(lm, num_draft_tokens=3)
    eng.scalar.costs = Costs(verify=(1.0, 1.1, 5.0, 6.0), draft=0.01, source="test")
    assert eng.scalar.costs.best_k(0.6, 3) == 1  # what the request would run if K were a ceiling
    rec = eng.generate(prompts[0], P(30, seed=0, ignore_eos=True))
    s = rec.stats
    assert s["max_draft_tokens"] == 3 and s["num_rounds"] > 3, s
    assert s["num_drafted"] >= 3 * s["num_rounds"] - 3, s  # at most two short rounds at the end (3 - 1, 3 - 2)
    eng.close()


@pytest.mark.parametrize("spec_cost", [6.0, 1.05])
def test_smollm2_with_its_head_forced_both_ways_every_stream_equals_solo(smollm2, monkeypatch, spec_cost):
    """The real model with its shipped head, the control forced to plain and to speculation: a lone
    request, then a batch of three (greedy and seeded), every stream equals its solo plain decode."""
    lm = smollm2.load("float32")
    control.forget(lm.target)
    forced(monkeypatch, spec_cost)
    tok = lm.tokenizer
    code, other = tok.encode("def fibonacci(n):\n"), tok.encode("import os\nimport sys\n")
    eng = on(lm)
    run = drive(eng, {0: [("a", code, P(20, seed=1))], 2: [("b", other, P(14, seed=2, t=0.8)),
                                                          ("c", code[:4], P(14, seed=3))]})
    check_solo(lm, run)
    recs = [s.result for s in run.streams.values()]
    assert all(r.stats["speculation"] for r in recs)
    eng.close()


def test_steady_rate_is_the_controls_estimator():
    """sweep-cap's cell figure: width x mean tokens per row and round / median period; one slow
    round does not move it, and the ratio of two rates is the control's E(K) T(0) / T(K)."""
    from gmlx.policy.figures import steady_rate

    assert steady_rate(2, [0.1, 0.1], [2.0, 2.0]) is None  # fewer than MIN_SAMPLES rounds
    assert steady_rate(2, [0.1, 0.1, 10.0], [2.0, 2.0, 2.0]) == pytest.approx(40.0)
    plain, spec = steady_rate(4, [0.05] * 5, [1.0] * 5), steady_rate(4, [0.08] * 5, [2.4] * 5)
    assert spec / plain == pytest.approx(2.4 * 0.05 / 0.08)


@pytest.mark.parametrize("within, tries", [(None, False), (1.0, False), (0.9, True)])
def test_a_lone_request_tries_no_deeper_k_on_its_hope(monkeypatch, within, tries):
    """Width 1, K=1 paired at 1.15 plain rounds; a request accepting 0.3 of its first drafts and,
    once one agreed, 0.3 of its second: K=1 predicted 1.13x, K=2's hope (its second draft counted
    toward always agreeing) 1.07x. The lone request does not try K=2 (LONE_TRY_WITHIN, infinite
    since early dispatch: such tries recur within a request, and a deeper K runs only where its
    own estimate predicts it best — the next test); nor did it under the rule before (its hope had
    to reach the best's gain); at the batch widths' TRY_WITHIN (0.9 of the best) it would."""
    if within is not None:
        monkeypatch.setattr(width_control, "LONE_TRY_WITHIN", within)
    ctl = fresh(Costs(verify=(1.0, 1.15, 1.35), draft=0.0))
    for i in range(48):  # plain and K=1 runs side by side: K=1's ratio paired
        k = (i // 6) % 2
        feed(ctl, 1, k, 0.010 * (1.0, 1.15)[k], accepted=i % 3 == 0)
    wc = ctl.at(1)
    wc.current, wc.rounds_in_choice = 1, MIN_EVIDENCE
    assert wc.pairs.ratio(1) == pytest.approx(1.15)
    own = Acceptance(3.0, 7.0, rounds=10, depth=[[3.0, 10.0], [3.0, 10.0]])
    gain, hope = wc.gain(1, ctl.costs, own, lone=True)[0], wc.gain(2, ctl.costs, own, lone=True, hope=True)[0]
    assert 0.9 * gain < hope < gain
    ks = []
    for _ in range(8):
        ks.append(ctl.choose(1, 2, own).k)
        ctl.observe(1, ks[-1], 0.010 * (1.0, 1.15, 1.35)[ks[-1]], [(ks[-1], 0)])
    assert (2 in ks) is tries, ks


def _lone_paired(ratio: float = 1.10) -> Controller:
    """Width 1 with K=1's ratio paired at `ratio` plain rounds (plain and K=1 runs side by side)."""
    ctl = fresh(Costs(verify=(1.0, ratio, 1.35), draft=0.0))
    for i in range(48):
        k = (i // 6) % 2
        feed(ctl, 1, k, 0.010 * (1.0, ratio)[k], accepted=i % 3 == 0)
    assert ctl.at(1).pairs.ratio(1) == pytest.approx(ratio)
    return ctl


def test_a_lone_request_runs_a_deeper_k_its_own_estimate_predicts_best():
    """No hope needed: a request whose first drafts agree half the time and its second ones 0.9 of
    the time once the first did (K=1 1.36x, K=2 about 1.44x) runs K=2, its best by its own estimate."""
    ctl = _lone_paired()
    wc = ctl.at(1)
    wc.current, wc.rounds_in_choice = 1, MIN_EVIDENCE
    own = Acceptance(5.0, 5.0, rounds=10, depth=[[5.0, 10.0], [9.0, 10.0]])
    assert wc.gain(2, ctl.costs, own, lone=True)[0] > wc.gain(1, ctl.costs, own, lone=True)[0] > 1.0
    assert ctl.choose(1, 2, own).k == 2


def test_a_lone_request_leaves_a_choice_after_lone_min_evidence_rounds():
    """K=1 paired at 1.10 plain rounds: a request whose acceptance falls to 0.05 goes plain, and
    once its (shadow) records say 0.5 again it comes back after LONE_MIN_EVIDENCE plain rounds,
    not a batch width's MIN_EVIDENCE: its estimate is its own and current while plain."""
    assert LONE_MIN_EVIDENCE < MIN_EVIDENCE
    ctl = _lone_paired()
    wc = ctl.at(1)
    wc.current, wc.rounds_in_choice = 1, MIN_EVIDENCE
    poor, good = Acceptance(0.5, 9.5, rounds=10), Acceptance(5.0, 5.0, rounds=10)
    assert ctl.choose(1, 1, poor).k == 0
    ks = []
    for _ in range(MIN_EVIDENCE):
        feed(ctl, 1, 0, 0.010, accepted=0)
        ks.append(ctl.choose(1, 1, good).k)
    assert ks == [0] * (LONE_MIN_EVIDENCE - 1) + [1] * (MIN_EVIDENCE - LONE_MIN_EVIDENCE + 1), ks


ROWS = Costs(verify=(1.0, 1.1, 1.3, 1.3), draft=0.04, rows=((1, 1.0), (2, 1.1), (4, 1.3), (8, 2.4), (16, 3.2)))


def test_a_batch_width_is_decided_on_the_costs_of_its_rows():
    """The probe's forwards of the rows a width verifies (Costs.at_width): at width 1 K = 1 costs
    1.14 steps and the prior's acceptance (0.6) predicts a gain; at width 4 it verifies 8 rows
    against 4 (2.4 / 1.3 + the draft: 1.89 steps), a loss the control predicts before any round."""
    ctl = fresh(ROWS)
    assert ctl.choose(1, 3).k > 0
    c = ctl.choose(4, 3)
    assert c.k == 0 and c.best_spec[1] < width_control.TRY_FIRST, c.reason
    assert fresh(ROWS).choose(4, 3, shadowed=True).best_spec[1] == pytest.approx(c.best_spec[1])


@pytest.mark.parametrize("shadow_first", [True, False])
def test_a_batch_width_whose_rounds_shadow_starts_plain_and_speculates_once_they_show_a_gain(monkeypatch,
                                                                                              shadow_first):
    """thresholds.SHADOW_FIRST: a batch width not decided yet, whose plain rounds would shadow
    (their drafter replays the steps, K = 1 records), starts plain — counted plain before its
    first choice too, so admission forms it gated — and speculates once its shadow records (every
    draft agreeing here) predict a gain, after MIN_EVIDENCE rounds; without the rule, or where
    nothing shadows, its first rounds try speculation on the prior. The lone request is no batch."""
    monkeypatch.setattr(width_control, "SHADOW_FIRST", shadow_first)
    ctl = fresh()
    assert ctl.decided_plain(2, shadowed=True) is shadow_first and not ctl.decided_plain(2)
    assert not ctl.decided_plain(1, shadowed=True)
    assert fresh().choose(2, 3).k > 0  # nothing shadows: the first try
    ks = []
    for _ in range(2 * MIN_EVIDENCE):
        ks.append(ctl.choose(2, 3, shadowed=True).k)
        feed(ctl, 2, ks[-1], 0.010 * COSTS.round_cost(ks[-1]), accepted=ks[-1])
        if ks[-1] == 0:
            ctl.shadowed(2, [(1, 1)] * 2)
    if shadow_first:
        assert ks[:MIN_EVIDENCE] == [0] * MIN_EVIDENCE and ks[-1] > 0, ks
    else:
        assert ks[0] > 0, ks


@pytest.mark.parametrize("shadowed", [True, False])
def test_a_shadowed_width_explores_only_a_k_that_could_be_near_plain(shadowed):
    """A width decided plain tries speculation again after EXPLORE_FIRST plain rounds — unless its
    plain rounds shadow and the acceptance they measure predicts every K under TRY_FIRST: the try
    would measure only the round's cost, which the rows' costs already say is a loss (an
    exploration at SmolLM2 chat's 0.82x in the simulated engine cost 1 % of a 64-token burst)."""
    ctl = fresh(ROWS)
    tries = 0
    for _ in range(EXPLORE_FIRST * 2):
        c = ctl.choose(4, 3, shadowed=shadowed)
        tries += c.exploring
        feed(ctl, 4, c.k, 0.03 if c.k else 0.01, accepted=0)
        if shadowed and c.k == 0:
            ctl.shadowed(4, [(1, 0)] * 4)  # no draft would agree
    assert (tries == 0) is shadowed, tries


@pytest.mark.parametrize("shadow_first", [True, False])
def test_a_new_batch_forms_gated_with_shadows_and_every_stream_equals_solo(lm, prompts, clean, monkeypatch,
                                                                           shadow_first):
    """Two requests submitted together, nothing decided at width 2: under SHADOW_FIRST the batch
    forms gated (admission reads the width as plain), its plain rounds shadow, and it speculates
    once they predict a gain; without the rule its first round drafts. Every stream equals solo."""
    monkeypatch.setattr(width_control, "SHADOW_FIRST", shadow_first)
    forced(monkeypatch, spec_cost=1.05)
    eng = on(lm, drafter="mtp")  # (the embedded model's assistant replays no batch: nothing shadows)
    shadowing = []
    real = eng.lanes.run

    def run(kind, width):
        shadowing.append(eng.lanes.batch.shadow is not None)
        return real(kind, width)

    monkeypatch.setattr(eng.lanes, "run", run)
    run_ = drive(eng, {0: [("a", prompts[0], P(48)), ("b", prompts[1], P(48, seed=2, t=0.8))]})
    check_solo(lm, run_)
    drafted = [sum(d for _, d, _, _ in e.rows) for _, e in run_.rounds() if len(e.rows) == 2]
    if shadow_first:
        assert drafted[:MIN_EVIDENCE] == [0] * MIN_EVIDENCE and shadowing[0] and any(drafted), drafted
    else:
        assert drafted[0] > 0, drafted
    eng.close()


@pytest.mark.parametrize("stop", ["SHADOW_STOP", "TRY_FIRST"])
def test_a_width_far_from_paying_stops_its_shadows_after_their_span(monkeypatch, stop):
    """A plain width whose shadow records keep every K under SHADOW_STOP (short of a switch) drops
    its shadows after SHADOW_SPAN rounds (control.far_from_paying: with the CPU's kernel they cost
    ~7 % of a batch's CPU time), and explores again instead; one whose shadows predict a switch
    keeps them. Three drafts in four agreeing predict K = 3 at ~1.04x: stopped at SHADOW_STOP,
    kept at the level before it (TRY_FIRST)."""
    monkeypatch.setattr(width_control, "SHADOW_STOP", getattr(width_control, stop))
    for pattern, far in (([0], True), ([1, 1, 1, 0], stop == "SHADOW_STOP"), ([1], False)):
        ctl = fresh(ROWS)
        for i in range(width_control.SHADOW_SPAN + MIN_EVIDENCE):
            c = ctl.choose(4, 3, shadowed=True)  # (it can shadow; whether it does now: far_from_paying)
            if c.k:  # (every draft agreeing: the width speculates, and is no longer plain)
                break
            assert ctl.far_from_paying(4) is (far and i >= width_control.SHADOW_SPAN), (pattern, i)
            feed(ctl, 4, 0, 0.01, accepted=0)
            ctl.shadowed(4, [(1, a) for a in (pattern * 4)[:4]])
        assert ctl.far_from_paying(4) is far, pattern
        if pattern == [1, 1, 1, 0]:
            assert c.k == 0 and thresholds.TRY_FIRST <= c.best_spec[1] < thresholds.SHADOW_STOP, c


@pytest.mark.parametrize("pattern", [[0], [1, 1, 1, 0]])
def test_a_width_far_from_paying_explores_by_shadowing_again_unless_a_k_is_near_paying(pattern):
    """thresholds.SHADOW_AGAIN: a plain width whose shadows stopped (far_from_paying) explores after
    EXPLORE_FIRST plain rounds (doubling) by starting its shadows again for SHADOW_SPAN rounds, not
    by a try, where every K is predicted under TRY_FIRST (no draft agreeing): its shadows measure
    the acceptance a try would, for a fraction of a try's loss. Where one is predicted at least
    TRY_FIRST (three drafts in four agreeing: K = 3 at ~1.04x), the exploration tries it."""
    ctl = fresh(ROWS)
    far, ks = [], []
    for _ in range(EXPLORE_FIRST * 4):
        c = ctl.choose(4, 3, shadowed=True)
        ks.append(c.k)
        if c.k:
            break
        far.append(ctl.far_from_paying(4))
        feed(ctl, 4, 0, 0.01, accepted=0)
        if not far[-1]:  # (the lane's shadow records, while it shadows)
            ctl.shadowed(4, [(1, a) for a in (pattern * 4)[:4]])
    said = "".join(".S"[not f] for f in far)
    if pattern == [0]:
        span = width_control.SHADOW_SPAN
        assert not any(ks), ks
        # shadows, stopped, started again after EXPLORE_FIRST plain rounds, stopped; then after twice that
        assert re.fullmatch(rf"S{{{span}}}\.+S{{{span}}}\.+S+\.*", said), said
        stops = [m.start() for m in re.finditer(r"S\.", said)]
        starts = [m.end() - 1 for m in re.finditer(r"\.S", said)]
        assert starts[0] - span <= EXPLORE_FIRST + control.DECIDE_EVERY, said  # (plain_run counts from the start)
        assert starts[1] - starts[0] >= 2 * EXPLORE_FIRST and len(stops) >= 2, said
    else:
        assert ks[-1] > 0 and ctl.last[4].exploring and "S." in said, (ks, said)


@pytest.mark.parametrize("keepable", [True, False])
def test_an_exploration_tries_no_k_that_could_not_stay(monkeypatch, keepable):
    """thresholds.KEEPABLE_TRIES: a plain width whose rounds shadow explores (EXPLORE_FIRST plain rounds)
    by a try only of a K whose hope (deeper drafts credited as always agreeing) reaches MARGIN, the gain a
    try must show to stay. Here one draft in two agrees at width 2 (4 rows verify against 2 at 1.5x): K = 1
    predicted 0.97x (over TRY_FIRST), K = 2 / 3 hoped 1.03x / 1.02x. Kept (the default) the width tries
    nothing and starts its stopped shadows again; with the rule off it tries K = 1 at its 0.97x."""
    monkeypatch.setattr(width_control, "KEEPABLE_TRIES", keepable)
    costs = Costs(verify=(1.0, 1.1, 1.3, 1.3), draft=0.04,
                  rows=((1, 1.0), (2, 1.0), (4, 1.5), (6, 1.85), (8, 2.3), (16, 3.2)))
    ctl = fresh(costs)
    far, c = [], None
    for _ in range(EXPLORE_FIRST * 4):
        c = ctl.choose(2, 3, shadowed=True)
        if c.k:
            break
        far.append(ctl.far_from_paying(2))
        feed(ctl, 2, 0, 0.01, accepted=0)
        if not far[-1]:
            ctl.shadowed(2, [(1, 1), (1, 0)])
    wc, at2 = ctl.at(2), costs.at_width(2)
    hopes = {k: wc.gain(k, at2, wc.acceptance, hope=True)[0] for k in (1, 2, 3)}
    assert thresholds.TRY_FIRST <= c.best_spec[1] < MARGIN and max(hopes.values()) < MARGIN, (c, hopes)
    said = "".join(".S"[not f] for f in far)
    if keepable:
        assert c.k == 0 and re.fullmatch(r"S+\.+S+\.+S+\.*", said), said  # shadows again, never a try
    else:
        assert c.k > 0 and c.exploring and "S." in said, (c, said)


def test_a_new_engine_s_batch_starts_without_shadows_where_the_width_is_far_from_paying():
    """far_from_paying reads the width's shared figures, not the engine's: the next engine on the
    same target (the next bench cell, a server's next Engine) does not shadow its batch again for
    SHADOW_SPAN rounds before the choice it inherits is confirmed (in bench_control's sequence on
    the simulated clock every repeat's first ~25 rounds at width 4 shadowed where nothing pays)."""
    target = _Target()
    ctl = Controller(target, "mtp", ROWS)
    for _ in range(width_control.SHADOW_SPAN + MIN_EVIDENCE):
        assert ctl.choose(4, 3, shadowed=True).k == 0
        feed(ctl, 4, 0, 0.01, accepted=0)
        ctl.shadowed(4, [(1, 0)] * 4)
    assert ctl.far_from_paying(4)
    nxt = Controller(target, "mtp", ROWS)  # a new engine: its own `last`, the width's figures shared
    assert nxt.last == {} and nxt.far_from_paying(4) and nxt.decided_plain(4)
    assert not Controller(target, "ngram", ROWS).far_from_paying(4)  # (another drafter's figures: none yet)


def _far_batch(lm, prompts, monkeypatch, explore_first: int, n: int) -> str:
    """Two requests of n tokens on an engine whose speculative rounds are timed at 6 plain ones
    (every K far under plain once measured), streams checked against solo plain decoding; its batch
    rounds said in turn: x speculative, S plain with shadows, . plain without."""
    forced(monkeypatch, spec_cost=6.0)
    monkeypatch.setattr(width_control, "EXPLORE_FIRST", explore_first)
    eng = on(lm, drafter="mtp")
    kinds = []  # per batch round: (kind, a shadow kept)
    real = eng.lanes.run

    def run(kind, width):
        kinds.append((kind.value, eng.lanes.batch.shadow is not None))
        return real(kind, width)

    monkeypatch.setattr(eng.lanes, "run", run)
    check_solo(lm, drive(eng, {0: [("a", prompts[0], P(n)), ("b", prompts[1], P(n, seed=2, t=0.8))]}))
    eng.close()
    return "".join("x" if k == "speculative" else "S" if sh else "." for k, sh in kinds)


def test_a_batch_far_from_paying_drops_its_shadows_and_every_stream_equals_solo(lm, prompts, clean, monkeypatch):
    """A speculative round timed at 6 plain ones: once width 2 has measured that, its plain
    stretch is predicted far under plain, and after SHADOW_SPAN rounds its batch decodes plain
    without shadows (their replays' cost buys nothing); every stream equals its solo plain one."""
    said = _far_batch(lm, prompts, monkeypatch, 10 ** 6, 120)
    last_spec = said.rfind("x")
    tail = said[last_spec + 1:]  # the plain stretch after the last speculative round
    assert last_spec >= 0 and "S" in tail and tail.endswith("." * 16), said
    assert len(tail.rstrip(".")) >= width_control.SHADOW_SPAN - 8, said  # the shadows had their span first


def test_a_far_batch_explores_by_shadowing_again_and_every_stream_equals_solo(lm, prompts, clean, monkeypatch):
    """As above with explorations due: where the width's shadows stopped and every K is predicted
    far under TRY_FIRST, its exploration starts the gated batch's shadow rounds again (a plain
    step's hidden states arm the drafter: Lanes.run, BatchLoop.shadow_again) instead of trying a
    K; every stream equals its solo plain one."""
    said = _far_batch(lm, prompts, monkeypatch, 16, 160)
    tail = said[said.rfind("x") + 1:]
    assert re.search(r"S+\.+S+", tail), said  # stopped, then started again, with no try between


def test_unpinned_a_batch_is_decided_on_its_measured_rows_costs_and_every_stream_equals_solo(lm, prompts, clean,
                                                                                             monkeypatch):
    """As on a user's machine (the suite pins the prior: measured here): the load probe times the
    rows widths 2 and 4 verify, the width-2 batch (the MTP head: it shadows, so it starts plain)
    decides on the costs read off them, and every stream equals its solo plain one."""
    monkeypatch.delenv("GMLX_ROUND_COSTS", raising=False)
    eng = on(lm, drafter="mtp")
    costs = eng.spec.control.costs
    assert costs.source.startswith("measured") and [n for n, _ in costs.rows][-1] == 4 * (eng.k + 1)
    run = drive(eng, {0: [("a", prompts[0], P(40)), ("b", prompts[1], P(40, seed=2, t=0.8))]})
    check_solo(lm, run)
    assert eng.spec.control.last[2].best_spec is not None  # width 2 was decided (on costs.at_width(2))
    eng.close()
