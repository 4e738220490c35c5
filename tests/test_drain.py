"""The drain charge (gmlx/policy/drain.py): rows whose budgets end together finish apart when
they speculate. Its arithmetic against a direct simulation of speculative rounds, and the
control's use of it: a synchronised batch near break-even decodes plain where a staggered one
keeps drafting, and a width too short-lived to judge a try does not try."""

import numpy as np
import pytest

from gmlx.policy.control import MIN_EVIDENCE, Controller
from gmlx.policy.costs import Costs, emitted
from gmlx.policy.drain import REFILL_STEPS, Refills, drain, expected_max, round_variance


def simulated_drain(remaining: list[int], alpha: float, k: int, trials: int = 4000, seed: int = 0) -> float:
    """The same quantity by brute force: rows draw accepted runs (each draft accepted with
    probability alpha until the first rejection, at most k) until their budget is spent; the
    batch lasts as long as its slowest row. Returns (max R / mu) / mean over trials of that."""
    rng = np.random.default_rng(seed)
    mu = emitted(alpha, k)
    lasts = []
    for _ in range(trials):
        slowest = 0
        for r in remaining:
            left, rounds = r, 0
            while left > 0:
                run = 0
                while run < k and rng.random() < alpha:
                    run += 1
                left -= 1 + run
                rounds += 1
            slowest = max(slowest, rounds)
        lasts.append(slowest)
    return (max(remaining) / mu) / float(np.mean(lasts))


def test_expected_max_of_normals():
    assert expected_max(1) == 0.0
    assert expected_max(2) == pytest.approx(0.5642, abs=0.03)  # 1 / sqrt(pi)
    assert expected_max(8) == pytest.approx(1.4236, abs=0.03)


@pytest.mark.parametrize("alpha, k", [(0.4, 1), (0.6, 3), (0.9, 2)])
def test_round_variance_is_the_accepted_runs(alpha, k):
    rng = np.random.default_rng(1)
    draws = []
    for _ in range(20000):
        run = 0
        while run < k and rng.random() < alpha:
            run += 1
        draws.append(1 + run)
    assert np.mean(draws) == pytest.approx(emitted(alpha, k), rel=0.02)
    assert np.var(draws) == pytest.approx(round_variance(alpha, k), rel=0.06)


@pytest.mark.parametrize("remaining, alpha, k", [([32] * 8, 0.41, 1), ([32] * 4, 0.6, 3), ([16] * 2, 0.5, 2),
                                                 ([64] * 8, 0.7, 3)])
def test_the_charge_matches_a_simulation_of_the_rounds(remaining, alpha, k):
    """The renewal estimate against brute force, within a few percent (the simulation's rounds
    are integers, the estimate's a normal's)."""
    assert drain(remaining, alpha, k) == pytest.approx(simulated_drain(remaining, alpha, k), abs=0.04)
    assert drain(remaining, alpha, k) < 0.97


def test_a_row_far_ahead_or_a_lone_row_pays_nothing():
    assert drain([32], 0.4, 1) == 1.0  # the lone request: no one to wait for
    assert drain([60, 10], 0.4, 1) == 1.0  # the batch lasts as long as its leader anyway
    assert drain([32] * 8, 0.4, 0) == 1.0  # plain decoding spreads nothing


def test_the_charge_grows_with_synchronised_rows_and_shrinking_budgets():
    assert drain([32] * 8, 0.4, 1) < drain([32] * 2, 0.4, 1) < 1.0
    assert drain([8] * 4, 0.4, 1) < drain([32] * 4, 0.4, 1) < drain([256] * 4, 0.4, 1)


class _Target:
    pass


def measured_width8(choice: int) -> Controller:
    """Width 8 with figures measured: plain rounds 10 ms, K=1 rounds 12.7 ms in which 3 of the 8
    rows accept their draft (1.375 tokens a row: a steady 1.08x), `choice` in force and settled."""
    ctl = Controller(_Target(), "mtp", Costs(verify=(1.0, 1.1, 1.2), draft=0.05))
    for _ in range(12):
        ctl.observe(8, 1, 0.0127, [(1, 1)] * 3 + [(1, 0)] * 5)
        ctl.observe(8, 0, 0.010, [(0, 0)] * 8)
    wc = ctl.at(8)
    wc.current, wc.rounds_in_choice = choice, MIN_EVIDENCE
    return ctl


def test_a_synchronised_batch_near_break_even_decodes_plain_a_staggered_one_drafts():
    """The same steady 1.08x: eight rows admitted together with 32 tokens each would finish ~10 %
    apart, so speculation is left for plain (and the reason says why); eight rows at staggered
    budgets (one leader, the others finishing before it anyway) keep K=1."""
    synced = measured_width8(1).choose(8, 1, remaining=(32,) * 8)
    assert synced.k == 0 and synced.best_spec[1] < 1.0
    staggered = measured_width8(1).choose(8, 1, remaining=(64, 40, 32, 24, 20, 16, 8, 4))
    assert staggered.k == 1 and staggered.gain == pytest.approx(1.08, abs=0.02)
    entering = measured_width8(0).choose(8, 1, remaining=(32,) * 8)
    assert entering.k == 0 and "rows finishing apart cost" in entering.reason


def test_a_try_needs_room_before_the_width_changes():
    """A new width with nothing measured, the cost model predicting a small loss (0.94x at the
    prior alpha 0.6): it tries speculation when every row has budget for the try's rounds, and
    not when a row finishes within them (the width changes before the try is judged; the leader
    far ahead, so no drain charge decides this)."""
    costs = Costs(verify=(1.0, 1.6), draft=0.1)
    assert Controller(_Target(), "mtp", costs).choose(3, 1, remaining=(80, 20, 12)).k == 1
    assert Controller(_Target(), "mtp", costs).choose(3, 1, remaining=(80, 5, 5)).k == 0


def test_refills_learn_whether_a_finished_rows_place_is_taken():
    """Nothing seen: a finish is assumed a drain (full charge). A closed loop (each finished row
    replaced a step or two later) soon stops being charged; a burst whose rows are never
    replaced keeps the full charge."""
    loop, burst = Refills(), Refills()
    assert loop.drain_share == burst.drain_share == 1.0
    rows, nxt = set(range(4)), 4
    for step in range(60):
        if step % 5 == 0:  # a row finishes ...
            rows.discard(min(rows))
        if step % 5 == 2:  # ... and the client's next request joins two steps later
            rows.add(nxt)
            nxt += 1
        loop.step(frozenset(rows))
    assert loop.drain_share < 0.3
    rows = set(range(8))
    for step in range(40):
        if step % 4 == 0 and rows:
            rows.discard(min(rows))
        burst.step(frozenset(rows))
    assert burst.drain_share > 0.9
    late = Refills()  # replaced only after REFILL_STEPS steps: the slot stood empty, a drain
    for rid_set in [{0, 1}, {1}] + [{1}] * REFILL_STEPS + [{1, 2}]:
        late.step(frozenset(rid_set))
    assert late.drain_share == 1.0


def test_a_refilled_batch_is_not_charged_for_draining():
    """The synchronised batch of the test above, in an engine whose finished rows have always
    been replaced: the steady 1.08x keeps K=1."""
    c = measured_width8(1).choose(8, 1, remaining=(32,) * 8, drain_share=0.0)
    assert c.k == 1 and c.gain == pytest.approx(1.08, abs=0.02)
    half = measured_width8(1).choose(8, 1, remaining=(32,) * 8, drain_share=0.5)
    assert half.drain == pytest.approx(1 - 0.5 * (1 - drain([32] * 8, 0.375, 1)), abs=0.01)
