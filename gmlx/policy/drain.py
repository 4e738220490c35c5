"""What speculation costs a batch that drains: rows that would finish together decoding plain
finish apart when they speculate, and the batch waits for the last of them.

A row with R tokens of budget left finishes after exactly R plain rounds. Speculating with k drafts
at per-position acceptance alpha, a round emits 1 + A tokens, A the accepted run (truncated
geometric: P(A = a) = alpha^a (1 - alpha) for a < k, P(A = k) = alpha^k), with mean mu = E(alpha, k)
and variance var; the rounds N it needs to emit R have, by the renewal theorem,

    mean R / mu,    sd sqrt(R var / mu^3).

Plain decoding runs max R_i rounds of the batch's period T(0); speculation runs E[max N_i] of
T(k). When no new request takes a finished row's place (the doubt to plain: nothing says one
will), the gain over plain is therefore the steady one, mu T(0) / T(k), times

    drain = (max R_i / mu) / E[max N_i]   (<= 1).

E[max N_i] ~ the leader's mean + its sd x z(m), z(m) the expected largest of m standard normals
and m the rows whose mean is within one sd of the leader's: a batch admitted at once (m = its
width, all with one budget) pays the most — 8 rows of 32 tokens at alpha 0.4, k = 1 lose ~10 % —
and a batch whose rows finish at different times anyway (one row far ahead, m = 1) pays
nothing. The charge grows as the budgets shrink (the sd over the mean goes as 1 / sqrt(R)), so a
draining batch's last rounds decode plain, where speculating could only spread the finish.

Whether a finished row's place is taken is the traffic's, not the model's: `Refills` watches the
batch's rows from step to step, and a row that finishes and is replaced within REFILL_STEPS steps
counts as a refill (a closed loop, a queue), one that is not as a drain; the charge is weighted
by the share of drains, a decayed count starting at one drain (the doubt to plain: a process that
has seen nothing charges fully, so a one-off burst decodes plain, while a server whose clients
send the next request as one ends stops charging after a few). The count (`Tally`) is kept per
target in the process, as the control's figures are: a bench's next cell or a server's next
engine starts from the traffic the last one saw, not from the prior.

Why the tail's narrower rounds being cheaper is not counted: it is the doubt to plain again (and
on a CPU a round of 3 rows costs most of a round of 8). Budgets are upper bounds (a row may stop
at an end-of-sequence token), which both kinds of decoding share. Pure arithmetic.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from statistics import NormalDist

from gmlx.policy.costs import emitted

_UNIT = NormalDist()
REFILL_STEPS = 4  # a finished row replaced within this many steps: its place was taken (a refill)
REFILLED = 0.5  # under this share of drains, finished rows count as refilled (gmlx/policy/admission.py's hold)


def expected_max(m: int) -> float:
    """The expected largest of m standard normals (Blom's approximation; 0 for m = 1)."""
    if m <= 1:
        return 0.0
    return _UNIT.inv_cdf((m - 0.375) / (m + 0.25))


def round_variance(alpha: float, k: int) -> float:
    """The variance of the tokens one round of k drafts emits (1 + the accepted run)."""
    mu = emitted(alpha, k)
    probs = [alpha ** a * (1.0 - alpha) for a in range(k)] + [alpha ** k]
    return sum(p * (1 + a - mu) ** 2 for a, p in enumerate(probs))


def drain(remaining: Sequence[int], alpha: float, k: int, drain_share: float = 1.0) -> float:
    """The share of the steady gain a draining batch keeps when its rows, with `remaining` tokens
    of budget each, speculate with k drafts at acceptance alpha (1.0: nothing lost); with
    `drain_share` (Refills) of finishes not refilled, the loss is weighted by it."""
    live = [r for r in remaining if r > 0]
    if k <= 0 or len(live) < 2 or drain_share <= 0.0:
        return 1.0
    mu, var = emitted(alpha, k), round_variance(alpha, k)
    means = [r / mu for r in live]
    top = max(means)
    sd = math.sqrt(max(live) * var / mu ** 3)
    if sd <= 0.0:  # alpha 0 or 1: every row's rounds are certain
        return 1.0
    m = sum(x >= top - sd for x in means)
    return 1.0 - drain_share * (1.0 - top / (top + sd * expected_max(m)))


class Tally:
    """The decayed counts of refills and drains behind the drain charge's weight; one per target
    in the process (gmlx/policy/control.py), as the control's figures are: the traffic a server
    or a bench sees outlives each engine, so the next engine starts from what the last one saw."""

    def __init__(self, decay: float = 0.9):
        self.refills, self.drains = 0.0, 1.0  # the prior: one drain (nothing says a request will come)
        self.decay = decay

    @property
    def drain_share(self) -> float:
        return self.drains / (self.refills + self.drains)

    def count(self, refill: bool) -> None:
        self.refills *= self.decay
        self.drains *= self.decay
        if refill:
            self.refills += 1.0
        else:
            self.drains += 1.0


class Refills:
    """How often a finished row's place is taken: finishes not followed by an admission within
    REFILL_STEPS steps are drains, seen from one engine's batch rows, counted into a `Tally`."""

    def __init__(self, tally: Tally | None = None):
        self.tally = tally if tally is not None else Tally()
        self._rows: frozenset = frozenset()
        self._open: list[int] = []  # steps since each finish not yet followed by an admission

    @property
    def drain_share(self) -> float:
        return self.tally.drain_share

    def refilled(self, queued: int) -> bool:
        """Whether finished rows' places are mostly taken (under REFILLED drains), counting as
        refills the finishes of the last REFILL_STEPS steps that `queued` waiting requests are
        about to take (a closed loop's first refill is seen as it happens, not after)."""
        t = copy.copy(self.tally)
        for _ in range(min(queued, len(self._open))):
            t.count(refill=True)
        return t.drain_share < REFILLED

    def step(self, rids: frozenset) -> None:
        """The batch's rows at this step (their ids): finishes and admissions since the last."""
        finished, admitted = len(self._rows - rids), len(rids - self._rows)
        self._rows = rids
        self._open = [n + 1 for n in self._open] + [0] * finished
        while self._open and self._open[0] > REFILL_STEPS:  # no one came in time: the batch drained
            self._open.pop(0)
            self.tally.count(refill=False)
        for _ in range(min(admitted, len(self._open))):  # the oldest open finishes are refilled
            self._open.pop(0)
            self.tally.count(refill=True)
