"""Steady samples of the lone request's cost ratio (gmlx/policy/pairs.Pairs with `warm`): a speculative
run's first periods after plain ones run dear (the re-arm's catch-up), so the periods next to a boundary
overstate what a K round costs mid-run; steady samples read the two sorts away from that."""

import random

import pytest

from gmlx.policy import thresholds
from gmlx.policy.control import Controller
from gmlx.policy.costs import Costs
from gmlx.policy.pairs import STEADY_SECONDS, STEADY_WARM, Pairs

COSTS = Costs(verify=(1.0, 1.1, 1.2, 1.3), draft=0.05)
TRUE = 1.18  # a K = 1 round's steady cost in plain rounds


class _Target:
    pass


def switching_runs(plain_len: int = 12, spec_len: int = 20, runs: int = 12, seed: int = 0, gap: float = 0.0):
    """Plain and K = 1 runs alternating; a speculative run's first 6 periods after plain ones cost 10 %
    more (the switch cost measured on SmolLM2, docs/speculation.md), each period jittered 3 %:
    yields (k, seconds, now). `gap`: seconds of nothing between runs."""
    rng, now = random.Random(seed), 0.0
    for run in range(runs):
        k = run % 2
        for i in range(spec_len if k else plain_len):
            s = 0.030 * (TRUE * (1.10 if i < 6 else 1.0) if k else 1.0) * (1 + 0.03 * rng.uniform(-1, 1))
            now += s
            yield k, s, now
        now += gap


def test_boundary_pairs_read_the_switch_cost_and_steady_samples_do_not():
    boundary, steady = Pairs(), Pairs(warm=STEADY_WARM)
    for k, s, now in switching_runs():
        boundary.add(k, s, now)
        steady.add(k, s, now)
    # plain -> K = 1 boundaries read the dear first periods (1.30), K = 1 -> plain ones the steady tail
    assert boundary.ratio(1) > TRUE * 1.04
    assert steady.steady[1] and steady.ratio(1) == pytest.approx(TRUE, rel=0.02)
    assert 0 < steady.error(1) < 0.02 and steady.paired() == [1]


def test_without_steady_periods_the_boundary_pairs_stand():
    """Speculative runs too short to pass their dear first periods give no steady sample."""
    pairs = Pairs(warm=STEADY_WARM)
    for k, s, now in switching_runs(spec_len=STEADY_WARM):
        pairs.add(k, s, now)
    assert not pairs.steady and pairs.ratio(1) == pytest.approx(_boundary(STEADY_WARM).ratio(1))


def _boundary(spec_len: int) -> Pairs:
    pairs = Pairs()
    for k, s, now in switching_runs(spec_len=spec_len):
        pairs.add(k, s, now)
    return pairs


def test_steady_periods_further_apart_than_the_horizon_do_not_pair():
    pairs = Pairs(warm=STEADY_WARM)
    for k, s, now in switching_runs(gap=STEADY_SECONDS + 1.0):  # minutes of drift may lie between runs
        pairs.add(k, s, now)
    assert not pairs.steady


def test_only_the_lone_width_takes_steady_samples(monkeypatch):
    ctl = Controller(_Target(), "mtp", COSTS)
    for width in (1, 2):
        wc = ctl.at(width)
        for k, s, now in switching_runs():
            wc.pairs.add(k, s, now)
    assert ctl.at(1).pairs.ratio(1) == pytest.approx(TRUE, rel=0.02)
    assert not ctl.at(2).pairs.steady and ctl.at(2).pairs.ratio(1) > TRUE * 1.04
    monkeypatch.setattr("gmlx.policy.width_control.STEADY_PAIRS", False)  # the rule before, forced
    assert thresholds.STEADY_PAIRS
    off = Controller(_Target(), "mtp", COSTS).at(1)
    for k, s, now in switching_runs():
        off.pairs.add(k, s, now)
    assert not off.pairs.steady and off.pairs.ratio(1) > TRUE * 1.04
