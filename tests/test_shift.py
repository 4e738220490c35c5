"""A batch width's rows changing acceptance (gmlx/policy/shift.py): the window's test, and the
control's pooled figures after chat rows follow code rows — reset with the watch, lagging without."""

import numpy as np
import pytest

from gmlx.policy import shift
from gmlx.policy.control import Controller
from gmlx.policy.costs import Costs
from gmlx.policy.shift import WINDOW, ShiftWatch


class _Target:  # the controller keys its shared figures by target: a fresh one per test
    pass


def _window(watch: ShiftWatch, rows) -> None:
    for drafted, accepted in rows:
        watch.record(drafted, accepted)


def test_a_window_far_from_the_pooled_rate_is_a_shift_either_way_and_a_steady_one_rarely():
    w = ShiftWatch()
    _window(w, [(3, 0)] * (WINDOW - 1))
    assert not w.shifted(0.5)  # not before a full window
    w.record(0, 0)  # a row that drafted nothing is no trial
    assert not w.shifted(0.5)
    w.record(3, 0)
    assert w.shifted(0.5) and not w.recent  # sixteen misses against 0.5; the window starts over
    _window(w, [(3, 3)] * WINDOW)
    assert w.shifted(0.4)  # a drafter that starts agreeing
    rng = np.random.default_rng(0)
    said = 0
    for _ in range(300):  # steady rows at the pooled rate: geometric accepted runs, alpha 0.45
        for _ in range(WINDOW):
            a = 0
            while a < 3 and rng.random() < 0.45:
                a += 1
            w.record(3, a)
        said += w.shifted(0.45)
        w.recent.clear()
    assert said <= 3


def _code_then_chat(chat_rounds: int) -> Controller:
    """Width 2: 64 rounds of code-like rows at K = 3 (accepting 3, 1, 0, 2 in turn), then chat-like
    rows accepting nothing."""
    ctl = Controller(_Target(), "mtp", Costs(verify=(1.0, 1.1, 1.2, 1.3), draft=0.05))
    for i in range(64):
        ctl.observe(2, 3, 0.012, [(3, (3, 1, 0, 2)[i % 4])] * 2)
    for _ in range(chat_rounds):
        ctl.observe(2, 3, 0.012, [(3, 0)] * 2)
    return ctl


@pytest.mark.parametrize("watch", [True, False])
def test_chat_rows_after_code_rows_reset_the_pooled_figures_within_a_window(monkeypatch, watch):
    """After WINDOW row-rounds of misses (8 rounds of 2 rows) and 4 rounds more, the width's
    acceptance and K = 3's tokens per round are the chat rows' with the watch; without it they
    still carry the code rows' (alpha above 0.4, ~1.6 tokens a round over the last 32 rounds)."""
    if not watch:
        monkeypatch.setattr(shift, "Z_SHIFT", float("inf"))
    wc = _code_then_chat(WINDOW // 2 + 4).at(2)
    alpha, tokens = wc.acceptance.alpha, wc.spec.tokens_per_round(3)
    if watch:
        assert alpha < 0.25 and tokens == pytest.approx(1.0)  # 4 rounds re-measured: one token each
    else:
        assert alpha > 0.4 and tokens > 1.4
    assert (wc.gain(3, Costs(verify=(1.0, 1.1, 1.2, 1.3), draft=0.05), wc.acceptance)[0] < 0.9) == watch


def test_only_batch_widths_watch_for_a_shift():
    """The lone request's width pools requests on purpose (each request follows its own rounds)."""
    ctl = Controller(_Target(), "mtp", Costs(verify=(1.0, 1.1), draft=0.05))
    assert ctl.at(1).shift is None and isinstance(ctl.at(2).shift, ShiftWatch)
