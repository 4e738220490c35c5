"""Choose the draft length from the acceptance a request is actually getting.

Per-position acceptance alpha is estimated from the rounds so far as a geometric MLE: a round
that drafted k and accepted a contributes a successes and one failure when a < k, so
alpha = sum(a) / sum(a + [a < k]) (with a prior worth a few rounds). The round's k is the one
with the best ideal speedup under the measured costs of this model on this machine
(gmlx/policy/costs.py): at T = 0 with alpha ~ 0.6 and a cheap verify that is 3, at T = 0.8 with
alpha ~ 0.3 it is 1, and where a verify costs about as much as k+1 steps (a quantized target on
a CPU) it is 0: the request decodes plain. The choice never changes a token: only how many
drafts are checked per round.
"""

from __future__ import annotations

from dataclasses import dataclass

from gmlx.policy.costs import Costs
from gmlx.policy.figures import Acceptance


@dataclass
class AcceptanceEstimate(Acceptance):
    """One request's acceptance (the prior: alpha = 0.6 worth three rounds), every round alike."""

    decay: float = 1.0

    def best_k(self, max_k: int, costs: Costs) -> int:
        """The k in [0, max_k] with the best ideal speedup at the acceptance seen so far."""
        return costs.best_k(self.alpha, max_k)
