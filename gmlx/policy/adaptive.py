"""Choose the draft length from the acceptance a request is actually getting.

Per-position acceptance alpha is estimated from the rounds so far as a geometric MLE: a round
that drafted k and accepted a contributes a successes and one failure when a < k, so
alpha = sum(a) / sum(a + [a < k]) (with a prior worth a few rounds). A round of k drafts emits
E(k) = (1 - alpha^(k+1)) / (1 - alpha) tokens on average and costs about
1 + VERIFY * k + HEAD * k plain decode steps (a verify of k+1 tokens on a memory-bound CPU costs
little more than one step; each head step ~0.1 of a target step: MODEL_CARD.md and
bench_results/*_scalar.json). The loop drafts the k in [1, max_k] with the best E(k) / cost(k):
at T = 0 with alpha ~ 0.6 that is 3, at T = 0.8 with alpha ~ 0.3 it is 1.
The choice never changes a token: only how many drafts are checked per round.
"""

from __future__ import annotations

from dataclasses import dataclass

VERIFY_COST_PER_TOKEN = 0.05  # extra cost of each verified position, in decode steps
HEAD_COST = 0.08  # one drafter step, in decode steps


def expected_speedup(alpha: float, k: int, draft_cost: float = HEAD_COST) -> float:
    emitted = float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
    return emitted / (1.0 + (VERIFY_COST_PER_TOKEN + draft_cost) * k)


@dataclass(slots=True)
class AcceptanceEstimate:
    successes: float = 1.8  # prior: alpha = 0.6 worth three rounds
    failures: float = 1.2

    @property
    def alpha(self) -> float:
        return self.successes / (self.successes + self.failures)

    def record(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.successes += accepted
            self.failures += accepted < drafted

    def best_k(self, max_k: int, draft_cost: float = HEAD_COST) -> int:
        """draft_cost: one drafter step in decode steps (the drafter's `step_cost`)."""
        a = self.alpha
        return max(range(1, max_k + 1), key=lambda k: expected_speedup(a, k, draft_cost))
