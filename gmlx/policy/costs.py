"""What a speculative round costs, measured, and what it should gain: the model behind the draft
length, the lone request's plain-or-speculate choice and the "ideal" figures bench and sweep-cap
report. Pure arithmetic: the measurement is gmlx/decode/probe.py.

Costs are in units of one plain decode step t(1) of the target at the same width:
    verify[k] = t(k+1) / t(1)     a verify forward of the bonus and k drafts
    draft     = one drafter step / t(1)
A round of k drafts then costs verify[k] + k * draft, and with per-position acceptance alpha it
emits E(k) = (1 - alpha^(k+1)) / (1 - alpha) tokens (the accepted run plus the bonus), so its
ideal speedup over plain decoding is E(k) / (verify[k] + k * draft). k = 0 is plain decoding
(speedup 1 by definition): a round never pays when every k >= 1 is below it.

At batch width w a round verifies w (k + 1) rows against a plain step's w, and a forward's cost
is mostly its matmuls, whose cost by rows is not linear: on a CPU gmlx's small-M kernel takes up
to 12 rows (8 before 2026-12-07) and OpenBLAS the rest (docs/cpu_kernel.md: a width-4 verify of K = 2 or 3, 12-16 rows,
cost ~2.5 plain rounds where width 1's probe said 1.2-1.3). So the probe also times forwards of
a few longer lengths, `rows` (n tokens -> t(n) / t(1)), and width w's costs are read off them:
    verify_w[k] = t(w (k + 1)) / t(w)
one sequence's n tokens standing for w rows' k + 1 (the same matmuls; the attention differs a
little). The drafter's step keeps its ratio to the target's (both take w rows).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass


def emitted(alpha: float, k: int) -> float:
    """Expected tokens per round of k drafts at per-position acceptance alpha."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass(frozen=True)
class Costs:
    verify: tuple[float, ...]  # verify[k] = t(k+1) / t(1), k = 0..K (verify[0] is 1 by definition)
    draft: float  # one drafter step / t(1)
    source: str = "prior"  # where the figures come from: "prior", "measured ...", "user config ..."
    # (n, t(n) / t(1)) for the lengths timed, ascending, from n = 1; () where only verify is known
    rows: tuple[tuple[int, float], ...] = ()

    def verify_cost(self, k: int) -> float:
        """t(k+1)/t(1); past the measured range, extrapolated linearly from its last step."""
        v = self.verify
        if k < len(v):
            return v[k]
        step = v[-1] - v[-2] if len(v) > 1 else 0.0
        return v[-1] + step * (k - len(v) + 1)

    def row_cost(self, n: int) -> float:
        """t(n) / t(1): interpolated between the lengths timed, past them extrapolated linearly
        from the last two (verify's own figures where no longer length was timed)."""
        pts = self.rows or tuple((k + 1, v) for k, v in enumerate(self.verify))
        if len(pts) == 1 or n <= pts[0][0]:
            return pts[0][1]
        for (n0, v0), (n1, v1) in zip(pts, pts[1:]):
            if n <= n1:
                return v0 + (v1 - v0) * (n - n0) / (n1 - n0)
        (n0, v0), (n1, v1) = pts[-2:]
        return v1 + (v1 - v0) * (n - n1) / (n1 - n0)

    @functools.lru_cache(maxsize=64)  # (asked every round a width decides: the same few widths)
    def at_width(self, width: int) -> "Costs":
        """The costs of a round at this batch width (units: a plain step of the whole batch), read
        off `rows` (see the module's doc); these costs themselves where no longer length was timed."""
        if width <= 1 or not self.rows:
            return self
        step = self.row_cost(width)
        return Costs(tuple(self.row_cost(width * (k + 1)) / step for k in range(len(self.verify))), self.draft,
                     f"{self.source}, at width {width}", self.rows)

    def round_cost(self, k: int) -> float:
        return 1.0 if k == 0 else self.verify_cost(k) + k * self.draft

    def speedup(self, alpha: float, k: int) -> float:
        """The ideal speedup of rounds of k drafts over plain decoding at acceptance alpha."""
        return emitted(alpha, k) / self.round_cost(k)

    def best_k(self, alpha: float, max_k: int) -> int:
        """The k in [0, max_k] with the best ideal speedup (0: plain pays best)."""
        return max(range(0, max_k + 1), key=lambda k: (self.speedup(alpha, k), -k))


# Before anything is measured: a memory-bound target (a verify of a few tokens costs little more
# than one step) and a drafter at a tenth of a step; the engine measures its own (probe.py).
PRIOR = Costs(verify=(1.0, 1.05, 1.10, 1.15, 1.20), draft=0.08)
