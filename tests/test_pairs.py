"""Paired round costs (gmlx/policy/pairs.Pairs and its use by the online control): the cost of a
speculative round relative to a plain one from periods timed side by side, so the machine's drift
between minutes does not enter the control's prediction."""

import math
import random
from collections import deque

import pytest

from gmlx.policy.width_control import FAR, PLAIN_CHECK_AFTER, PLAIN_WINDOW
from gmlx.policy.control import REFRESH_FIRST, REFRESH_MAX, REFRESH_WINDOW, Acceptance, Controller
from gmlx.policy.costs import Costs, emitted
from gmlx.policy.figures import Times, gain_doubt
from gmlx.policy.pairs import PAIR_SECONDS, PAIR_SPAN, Pairs

COSTS = Costs(verify=(1.0, 1.1, 1.2, 1.3), draft=0.05)


class _Target:
    pass


def drifting_runs(ratio: float, seed: int = 0):
    """Runs of plain and K=1 rounds, alternating, on a machine whose speed drifts 2x over the
    sequence and jitters 5 % per round: yields (k, seconds, now)."""
    rng = random.Random(seed)
    now, speed = 0.0, 1.0
    for run in range(12):
        k = run % 2
        for _ in range(3 if k == 0 else 20):  # short plain windows between long speculative runs
            speed *= 1.0 + 1.0 / 140  # ~2x over the sequence's ~140 rounds
            s = 0.060 * speed * (ratio if k else 1.0) * (1 + 0.05 * rng.uniform(-1, 1))
            now += s
            yield k, s, now


def test_pairs_recover_the_cost_ratio_while_the_machine_drifts():
    pairs = Pairs()
    for k, s, now in drifting_runs(1.25):
        pairs.add(k, s, now)
    assert pairs.ratio(1) == pytest.approx(1.25, rel=0.04)
    assert 0 < pairs.error(1) < 0.05


def test_one_sample_per_boundary_from_the_periods_on_each_side():
    pairs = Pairs()
    for s in (0.010, 0.011, 0.012, 0.013):  # plain
        pairs.add(0, s, 0.0)
    for s in (0.030, 0.020, 0.025, 0.9):  # K=2: the first PAIR_SPAN against the last PAIR_SPAN plain
        pairs.add(2, s, 0.1)
    assert PAIR_SPAN == 3 and list(pairs.logs[2]) == pytest.approx([math.log(0.025 / 0.012)])
    pairs.add(0, 0.010, 0.2)  # back to plain: a run shorter than PAIR_SPAN still pairs when it ends
    pairs.add(3, 0.040, 0.3)
    assert len(pairs.logs[2]) == 2 and pairs.logs[2][-1] == pytest.approx(math.log(0.025 / 0.010))  # median 0.02/0.025/0.9
    assert pairs.ratio(2) is not None and 3 not in pairs.logs  # K=3's run has just begun


def test_runs_further_apart_than_the_horizon_do_not_pair():
    pairs = Pairs()
    for _ in range(3):
        pairs.add(0, 0.010, 0.0)
    for _ in range(3):
        pairs.add(1, 0.012, PAIR_SECONDS + 1.0)  # minutes of drift may lie between them
    assert not pairs.logs


def control_with(plain_then_spec: bool) -> Controller:
    """Width 4: plain rounds timed at 75 ms a minute ago (a slow spell), K=1 rounds now at 72 ms
    each emitting 1.5 tokens per row; the true K=1 cost is 1.25 plain rounds."""
    ctl = Controller(_Target(), "mtp", COSTS)
    wc = ctl.at(4)
    for _ in range(16):
        wc.plain.add(0, 0.075)  # stale: no pair from them
    if plain_then_spec:  # a window: plain rounds (57.6 ms now) side by side with the K=1 ones
        for _ in range(3):
            for s, k in [(0.072, 1)] * 3 + [(0.0576, 0)] * 3:
                wc.add_time(k, s)
    for _ in range(16):
        ctl.observe(4, 1, 0.072, [(1, 1), (1, 1), (1, 0), (1, 0)])  # 1.5 tokens per row and round
    return ctl


def test_the_control_predicts_from_pairs_not_from_stale_medians():
    stale = control_with(False).at(4)
    g_stale = stale.gain(1, COSTS, stale.acceptance)[0]
    paired = control_with(True).at(4)
    g, measured = paired.gain(1, COSTS, paired.acceptance)
    tokens = paired.spec.tokens_per_round(1)
    assert g_stale == pytest.approx(1.5)  # a K=1 round "cheaper" than a plain one (0.96x): taken as 1.0
    assert measured and tokens == pytest.approx(1.5) and g == pytest.approx(1.5 / 1.25, rel=1e-6)  # 1.2x


def test_a_paired_ratio_below_one_is_noise_and_counts_as_one():
    """Pairs taken while the machine's load swung say a K=1 round costs 0.64 plain ones; no verify
    reads fewer weights than a plain step, so the gain is the tokens per round over 1.0 (1.5x), not
    over 0.64 (2.3x), and the reason says 1.00x."""
    ctl = Controller(_Target(), "mtp", COSTS)
    wc = ctl.at(4)
    for _ in range(3):
        for s, k in [(0.064, 1)] * 3 + [(0.100, 0)] * 3:
            wc.add_time(k, s)
    for _ in range(16):
        ctl.observe(4, 1, 0.064, [(1, 1), (1, 1), (1, 0), (1, 0)])
    assert wc.pairs.ratio(1) == pytest.approx(0.64)
    assert wc.gain(1, COSTS, wc.acceptance)[0] == pytest.approx(1.5)
    wc.current, wc.rounds_in_choice = 1, 10
    c = ctl.choose(4, 1)
    assert c.ratio == 1.0 and "round 1.00x a plain one's, paired" in c.reason, c.reason


def test_the_reason_says_the_paired_ratio():
    ctl = control_with(True)
    ctl.at(4).current, ctl.at(4).rounds_in_choice = 1, 10
    c = ctl.choose(4, 1)
    assert c.k == 1 and c.ratio == pytest.approx(1.25) and "round 1.25x a plain one's, paired" in c.reason, c.reason


def test_a_lone_request_with_nothing_paired_uses_the_load_probe():
    ctl = Controller(_Target(), "mtp", COSTS)
    for _ in range(16):  # timed medians exist (a plain engine's rounds; drafting ones), unpaired
        ctl.at(1).plain.add(0, 0.050)
    for i in range(PLAIN_CHECK_AFTER - 1):  # (before the first plain window)
        ctl.observe(1, 1, 0.100, [(1, i % 2)])
    wc = ctl.at(1)
    seen = emitted(0.5, 1)  # its own acceptance's tokens per round (not the width's rounds)
    c = ctl.choose(1, 1, Acceptance(10, 10))
    assert c.probe and "load probe" in c.reason and "ms" not in c.reason, c.reason
    assert c.best_spec[1] == pytest.approx(seen / COSTS.round_cost(1), rel=1e-6)  # not 0.05 / 0.100


def test_a_speculating_width_refreshes_its_pairs_with_a_few_plain_rounds_ever_more_rarely():
    ctl = Controller(_Target(), "mtp", COSTS)
    windows, gaps, since = [], [], 0
    for _ in range(REFRESH_FIRST * 8):
        c = ctl.choose(2, 1)
        if c.window:
            windows.append(c)
            if since:
                gaps.append(since)
            since = 0
            ctl.observe(2, 0, 0.010, [(0, 0)] * 2)
        else:
            since += 1
            ctl.observe(2, c.k, 0.011, [(c.k, 1), (c.k, 0)])  # one row accepts: K=1 pays ~1.35x (< FAR)
    assert ctl.at(2).pairs.ratio(1) == pytest.approx(1.1)
    # the first window after PLAIN_CHECK_AFTER rounds (nothing paired); then every REFRESH_FIRST
    # rounds after the last pair (emitted PAIR_SPAN rounds into the speculative run), doubling
    assert gaps[0] == PLAIN_CHECK_AFTER
    assert [g - (PAIR_SPAN - 1) for g in gaps[1:4]] == [REFRESH_FIRST, 2 * REFRESH_FIRST, 4 * REFRESH_FIRST], gaps
    assert all(g <= REFRESH_MAX for g in gaps)
    plain_share = len(windows) / (REFRESH_FIRST * 8)
    assert plain_share < 0.05 and REFRESH_WINDOW == 3


def test_a_choice_far_above_plain_skips_its_refreshes_until_it_comes_nearer():
    """Every draft accepted, K=1 pays ~1.8x by its pairs and by the medians (>= FAR): after the
    first window no refresh is owed — none could overturn the choice, and each costs a gate, plain
    rounds and a resume. When the rows stop accepting half the time (~1.35x), refreshes return."""
    ctl = Controller(_Target(), "mtp", COSTS)
    windows, rounds = [], 0

    def run(n: int, rows: list) -> None:
        nonlocal rounds
        for _ in range(n):
            c = ctl.choose(2, 1)
            if c.window:
                windows.append(rounds)
            ctl.observe(2, 0 if c.window else c.k, 0.010 if c.window else 0.011, [(0, 0)] * 2 if c.window else rows)
            rounds += 1

    run(REFRESH_FIRST * 6, [(1, 1)] * 2)
    assert len(windows) == PLAIN_WINDOW and ctl.at(2).far and ctl.last[2].gain >= FAR  # the first window only
    run(REFRESH_FIRST * 2, [(1, 1), (1, 0)])
    assert not ctl.at(2).far and len(windows) > PLAIN_WINDOW and windows[-1] > REFRESH_FIRST * 6


def test_tokens_per_round_follow_each_draft_positions_own_acceptance():
    """A head that misses its first draft often but, once that one is accepted, the next ones
    always: rounds of K=3 accept 0 (60 %) or 3 (40 %), 2.2 tokens a round. The geometric model at
    the pooled alpha (0.67) says 2.4 for K=3; the per-position rates give the measured figure."""
    a = Acceptance(decay=1.0)
    for i in range(200):
        a.record(3, 3 if i % 5 < 2 else 0)
    measured = 1 + 0.4 * 3
    assert a.emitted(3) == pytest.approx(measured, rel=0.03)
    assert abs(emitted(a.alpha, 3) - measured) > 0.15  # the geometric model
    assert a.emitted(1) == pytest.approx(1.4, rel=0.03)
    fresh = Acceptance()
    assert fresh.emitted(3) == pytest.approx(emitted(fresh.alpha, 3))  # nothing seen: the geometric prior


def test_a_pair_resets_the_refresh_count_after_the_samples_window_is_full():
    """More boundaries than the 32 samples kept: each still counts as a fresh pair (no refresh
    window is owed while switches keep pairing the two kinds)."""
    ctl = Controller(_Target(), "mtp", COSTS)
    wc = ctl.at(2)
    for _ in range(40):  # 80 runs, 79 boundaries
        for k, s in [(0, 0.010)] * 3 + [(1, 0.011)] * 3:
            ctl.observe(2, k, s, [(k, 1)] * 2 if k else [(0, 0)] * 2)
    assert wc.pairs.samples == 79 and len(wc.pairs.logs[1]) == 32
    assert wc.since_pair < PAIR_SPAN and wc.plain_window == 0  # reset by the last boundary's sample


def test_the_doubt_of_a_k_scaled_from_a_paired_one_is_that_pair_and_the_two_speculative_medians():
    """K=3 not paired, K=1 paired: K=3's ratio is K=1's pairs times T(3) / T(1) (the speculative
    medians), so its doubt holds their errors — not the plain median's, which does not enter."""
    plain, spec, pairs = Times(), Times(), Pairs()
    for i in range(16):
        plain.add(0, 0.100 * (1.0 + (0.5 if i % 2 else -0.4)))  # a plain median spread wide
        spec.add(1, 0.115 * (1.0 + 0.02 * (i % 3 - 1)))
        spec.add(3, 0.140 * (1.0 + 0.02 * (i % 3 - 1)))
        spec.add_tokens(3, 2.0 + 0.1 * (i % 2))
    pairs.logs[1] = deque([math.log(1.15), math.log(1.16), math.log(1.14), math.log(1.15)])
    d = gain_doubt(plain, spec, 3, pairs)
    expected = math.sqrt(pairs.error(1) ** 2 + spec.errors(3)[0] ** 2 + spec.errors(1)[0] ** 2 + spec.errors(3)[1] ** 2)
    assert d == pytest.approx(expected) and d < plain.errors(0)[0]
    assert gain_doubt(plain, spec, 1, pairs) == pytest.approx(math.hypot(pairs.error(1), spec.errors(1)[1]))
    pairs.logs.clear()  # nothing paired: the two medians
    assert gain_doubt(plain, spec, 3, pairs) == pytest.approx(
        math.sqrt(plain.errors(0)[0] ** 2 + spec.errors(3)[0] ** 2 + spec.errors(3)[1] ** 2))


def test_the_rounds_after_a_window_run_the_k_before_it_so_both_sides_pair_one_k():
    """Pairs keys its samples by K: a window between K=3 rounds and K=1 rounds gives one sample to
    each, and neither K is paired (MIN_PAIRS). The rounds after a window run the K in force before
    it (PAIR_SPAN of them), even where the control would try a neighbour now (here K=2: K=1 ran
    last, K=3 before it), so one window pairs."""
    ctl = Controller(_Target(), "mtp", Costs(verify=(1.0, 1.1, 1.2, 1.3), draft=0.0))
    ks = []
    for _ in range(PLAIN_CHECK_AFTER + PLAIN_WINDOW + PAIR_SPAN + 2):
        c = ctl.choose(1, 3, Acceptance(5.0, 5.0, 5))  # the lone request's own acceptance: 0.5
        ks.append(0 if c.window else c.k)
        ctl.observe(1, ks[-1], 0.010 if c.window else 0.012, [(ks[-1], ks[-1] // 2)])
    first = ks.index(0)
    assert ks[first:first + PLAIN_WINDOW] == [0] * PLAIN_WINDOW
    assert ks[first + PLAIN_WINDOW:first + PLAIN_WINDOW + PAIR_SPAN] == [ks[first - 1]] * PAIR_SPAN, ks
    pairs = ctl.at(1).pairs
    assert pairs.paired() == [ks[first - 1]] and pairs.ratio(ks[first - 1]) == pytest.approx(1.2)
    ctl = Controller(_Target(), "mtp", Costs(verify=(1.0, 1.1, 1.2, 1.3), draft=0.0))
    for _ in range(PLAIN_CHECK_AFTER + 2):  # a window starts after K=3 rounds; then a ceiling of 1 (a new request's)
        c = ctl.choose(1, 3, Acceptance(9.0, 1.0, 5))
        ctl.observe(1, 0 if c.window else c.k, 0.012, [(c.k, c.k)])
    assert ctl.at(1).window_k > 1 and ctl.choose(1, 1, Acceptance(9.0, 1.0, 5)).k <= 1
