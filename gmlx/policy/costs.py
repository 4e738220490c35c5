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
"""

from __future__ import annotations

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

    def verify_cost(self, k: int) -> float:
        """t(k+1)/t(1); past the measured range, extrapolated linearly from its last step."""
        v = self.verify
        if k < len(v):
            return v[k]
        step = v[-1] - v[-2] if len(v) > 1 else 0.0
        return v[-1] + step * (k - len(v) + 1)

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
