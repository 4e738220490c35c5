"""A change in the rows' acceptance that the pooled figures would take many rounds to see.

A width's acceptance is pooled over its rows' rounds with a slow decay, and its tokens per round
are the mean of the last 2 x WINDOW rounds (gmlx/policy/figures.py): right for a steady workload,
slow when the workload changes. On SmolLM2 float32 (bench_matrix, c = 2, chat after code) chat
rows accepted 8 % of K = 3's drafts against the ~43 % the code rows had left in the pool, and the
batch kept drafting at ~0.8x plain until the pooled figures caught up, ~20 rounds. Here the last
WINDOW row-rounds are tested against the pooled rate: under the geometric model every draft
position reached is a Bernoulli(alpha) trial (a round's accepted drafts are successes, a miss one
failure), so the window's successes have mean alpha n and variance alpha (1 - alpha) n over its n
trials; a count Z_SHIFT standard deviations off says the rows changed, not the luck of a few
rounds. Both directions count: a drafter that starts agreeing is seen sooner too.

Pure arithmetic on host-side counts; WidthControl applies what it says.
"""

from __future__ import annotations

import math
from collections import deque

WINDOW = 16  # row-rounds tested (c = 2: 8 rounds; a lone request: 16 of its rounds)
Z_SHIFT = 3.0  # standard deviations: ~1 in 700 windows of a steady workload
KEEP_ROUNDS = 4.0  # the pooled acceptance's weight after a shift, in rounds: its rates, not its history


class ShiftWatch:
    """The last WINDOW row-rounds' successes and trials, tested against a pooled rate."""

    def __init__(self):
        self.recent: deque[tuple[int, int]] = deque(maxlen=WINDOW)  # (successes, trials) per row-round

    def record(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.recent.append((accepted, accepted + (accepted < drafted)))

    def shifted(self, alpha: float) -> bool:
        """Whether the window's successes are Z_SHIFT standard deviations from alpha's expectation
        (a full window only; it starts over after a shift is said)."""
        if len(self.recent) < WINDOW or not 0.0 < alpha < 1.0:
            return False
        s = sum(a for a, _ in self.recent)
        n = sum(t for _, t in self.recent)
        if abs(s - alpha * n) <= Z_SHIFT * math.sqrt(alpha * (1.0 - alpha) * n):
            return False
        self.recent.clear()
        return True
