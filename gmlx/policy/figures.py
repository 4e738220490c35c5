"""The online control's records (gmlx/policy/control.py): width buckets, the acceptance estimate,
recent round periods and tokens per K, the doubt of a gain (the paired cost ratios: pairs.py; the
choice with its reason: choice.py). Pure host arithmetic."""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

from gmlx.policy.pairs import Pairs

WINDOW = 16  # rounds per (width, k) in the running median
MIN_SAMPLES = 3  # measured rounds before a median replaces the cost model's figure
PRIOR_WEIGHT = 3.0  # rounds the prior acceptance (alpha 0.6, below) is worth
DECAY = 0.97  # per round: old acceptance fades (a drafter that starts agreeing is seen)
# ... slower for the lone request's width (its rounds are one request's at a time): a new lone
# request is decided on the acceptance of the last few requests (~100 rounds), not on the last
# one's end — at 0.97 a SmolLM2 request accepting 0.32 over its last rounds made the next one
# predict 1.02x (K = 1 had measured 1.17x over the requests before) and wait out the back-off.
LONE_DECAY = 0.99
# ... and a new lone request's own estimate starts from that pool worth at most this many rounds:
# the pool's rates, not its weight. Copied at the pool's full steady-state weight (~33 rounds at
# DECAY), a SmolLM2 chat request after code ones (accepting 10-13 % against the pool's ~40 %)
# outweighed it only after ~23 of its own rounds and drafted at a loss through most of a 48-token
# answer (bench_matrix's chat default 0.93x). At 8 its own rounds weigh as much by the time it may
# stop (MIN_ROUNDS_TO_STOP, below). Both side by side: benchmarks/bench_lone_prior.py.
LONE_PRIOR_ROUNDS = 8.0
MIN_ROUNDS_TO_STOP = 8  # rounds of its own before a lone request may give up on its drafter
MARGIN = 1.05  # hysteresis: plain is left for speculation predicted at least 5 % better
# ... and speculation is left when predicted under 3 % better: a steady-state gain that small does
# not pay for what the estimate leaves out (a request's drafter arming, a gate and its resume; a
# draining batch's rows finishing apart is charged in the gain itself, gmlx/policy/drain.py).
STAY = 1.03
Z = 1.0  # ... and above plain by more than this many standard errors of the prediction


def surely_pays(gain: float, doubt: float) -> bool:
    """Whether a predicted gain is worth leaving plain decoding for: MARGIN above plain, and above
    it by more than Z of its standard errors (a gain the machine's noise could make is no gain)."""
    return gain >= MARGIN and gain * (1.0 - Z * doubt) >= 1.0


def owner(target: object) -> object:
    """The model measured figures belong to (the control's round times, the load probe's costs): a
    view of the target (an EAGLE-3 head's AuxTarget, new with each engine) files them under the
    target it wraps (`Target.figures_key`), so the next engine does not measure from nothing."""
    return getattr(target, "figures_key", target)


def bucket(width: int) -> int:
    """Widths pooled for the figures: exact to 8, then the power of two at or below."""
    if width <= 8:
        return max(1, width)
    return 1 << (width.bit_length() - 1)


@dataclass
class Acceptance:
    """Per-position acceptance as a decayed geometric MLE: a round that drafted k and accepted a
    adds a successes and one failure when a < k (alpha = s / (s + f)); and per draft position d
    the decayed count of rounds that reached d and of those that accepted it, for `emitted`."""

    successes: float = 1.8  # the prior: alpha 0.6 worth PRIOR_WEIGHT = 3 rounds
    failures: float = 1.2
    rounds: int = 0
    decay: float = DECAY  # per round (1.0: every round counts alike)
    depth: list = field(default_factory=list)  # per position d: [accepted, reached]
    memo: dict = field(default_factory=dict, repr=False, compare=False)  # emitted(k, hope) until the next round

    @property
    def alpha(self) -> float:
        return self.successes / (self.successes + self.failures)

    def record(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.memo.clear()
            self.successes = self.successes * self.decay + accepted
            self.failures = self.failures * self.decay + (accepted < drafted)
            self.rounds += 1
            for d in self.depth:
                d[0], d[1] = d[0] * self.decay, d[1] * self.decay
            for d in range(min(drafted, accepted + 1)):  # positions reached: the accepted run and the miss
                if d == len(self.depth):
                    self.depth.append([0.0, 0.0])
                self.depth[d][0] += d < accepted
                self.depth[d][1] += 1

    def emitted(self, k: int, hope: bool = False) -> float:
        """Expected tokens per round of k drafts: 1 + sum_j prod_{d <= j} alpha_d, alpha_d the
        conditional acceptance at position d, each shrunk toward the shallower one's (the first
        toward alpha) by PRIOR_WEIGHT rounds. A position never reached is the geometric model at
        the shallower rate (`costs.emitted`); a head whose deeper drafts agree more (or less)
        often once the first did — runs of easy text — is credited with what its rounds show,
        not with one alpha pooled over positions reached at different rates.

        `hope`: the deeper positions (d >= 1) shrunk toward 1 instead — the most a K whose deep
        positions were barely reached could yield, for deciding whether to measure it. The
        geometric model errs low for an EAGLE-3 head: on SmolLM2 float32 a K=1 round accepted
        37 % of its drafts and a K=3 round 0.96 drafts (1.96 tokens, where alpha 0.37 says 1.56),
        so the control, predicting K=3 below K=1, never ran it while fixed K=3 was the best arm."""
        if (k, hope) in self.memo:
            return self.memo[k, hope]
        a, run, total = self.alpha, 1.0, 1.0
        for d in range(k):
            hit, reached = self.depth[d] if d < len(self.depth) else (0.0, 0.0)
            a = (hit + PRIOR_WEIGHT * (1.0 if hope and d else a)) / (reached + PRIOR_WEIGHT)
            run *= a
            total += run
        self.memo[k, hope] = total
        return total

    def copy(self, decay: float, rounds: float | None = None) -> "Acceptance":
        """A copy with its own counts (a new lone request starts from the width's), decaying at
        `decay`; from a slower-decaying pool its counts are scaled to what `decay` keeps in steady
        state, and to at most `rounds` rounds' weight (every round reaches position 0): the same
        rates, their weight against the copy's own rounds bounded."""
        w = min(1.0, (1.0 - self.decay) / (1.0 - decay)) if decay < 1.0 else 1.0
        if rounds is not None and self.depth and self.depth[0][1] * w > rounds:
            w = rounds / self.depth[0][1]
        return Acceptance(self.successes * w, self.failures * w, 0, decay,
                          [[h * w, r * w] for h, r in self.depth])


@dataclass
class Times:
    """Recent round periods (start to next start), per k, at one width; and for speculative k the
    tokens each row emitted per round (measured, so the gain needs no model of acceptance there)."""

    by_k: dict[int, deque] = field(default_factory=dict)
    tokens: dict[int, deque] = field(default_factory=dict)
    # Figures derived per k, kept until k's next round: the control asks for them many times a
    # step (each K's gain, the doubt, the hopes), and on a 2-4 ms round its arithmetic was ~7 %.
    memo: dict = field(default_factory=dict, repr=False, compare=False)  # k -> {figure: value}

    def add(self, k: int, seconds: float) -> None:
        self.by_k.setdefault(k, deque(maxlen=WINDOW)).append(seconds)
        self.memo.pop(k, None)

    def add_tokens(self, k: int, per_row: float) -> None:
        self.tokens.setdefault(k, deque(maxlen=2 * WINDOW)).append(per_row)
        self.memo.pop(k, None)

    def forget(self, k: int) -> None:
        """Drop k's periods and tokens per round (it is measured afresh)."""
        self.by_k.pop(k, None)
        self.tokens.pop(k, None)
        self.memo.pop(k, None)

    def _kept(self, k: int, name: str, compute):
        figures = self.memo.setdefault(k, {})
        if name not in figures:
            figures[name] = compute()
        return figures[name]

    def tokens_per_round(self, k: int) -> float | None:
        d = self.tokens.get(k, ())
        return self._kept(k, "tokens", lambda: sum(d) / len(d) if len(d) >= MIN_SAMPLES else None)

    def median(self, k: int) -> float | None:
        d = self.by_k.get(k, ())
        return self._kept(k, "median", lambda: statistics.median(d) if len(d) >= MIN_SAMPLES else None)

    def errors(self, k: int) -> tuple[float, float]:
        """Relative standard errors of k's median period and (k >= 1) of its mean tokens per row
        and round; 0 where fewer than MIN_SAMPLES rounds (nothing to say the spread from)."""
        return self._kept(k, "errors", lambda: self._errors(k))

    def _errors(self, k: int) -> tuple[float, float]:
        d, t, med = self.by_k.get(k, ()), self.tokens.get(k, ()), self.median(k)
        # the median's error from the MAD (robust to the VM's spikes)
        period = (1.2533 * 1.4826 * statistics.median(abs(x - med) for x in d) / (med * math.sqrt(len(d)))
                  if med is not None else 0.0)
        # plain float arithmetic: statistics.stdev is exact (slow)
        tokens = _sd(t) / (sum(t) / len(t) * math.sqrt(len(t))) if len(t) >= MIN_SAMPLES else 0.0
        return period, tokens


def _sd(xs) -> float:
    """The sample standard deviation."""
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def gain_doubt(plain: Times, spec: Times, k: int, pairs: Pairs | None = None, probe: bool = False) -> float:
    """The relative standard error of k's predicted gain E(k) T(0) / T(k) from the figures measured,
    as the ratio was formed (WidthControl.ratio): the two period medians; or, where paired, the
    pairs' ratio — k's own, or the nearest paired j's scaled by the speculative medians T(k) / T(j)
    (their errors, not the plain median's, which does not enter) or by the cost model (no error);
    `probe`: the load probe's ratio, no period enters. Plus k's tokens per round; 0 for what is
    not measured."""
    p0, _ = plain.errors(0)
    pk, tk = spec.errors(k)
    j = pairs.nearest(k) if pairs is not None else None
    if probe:
        p0 = pk = 0.0
    elif j == k:
        p0, pk = pairs.error(k), 0.0
    elif j is not None:
        scaled = spec.median(j) is not None and spec.median(k) is not None
        p0, pk = pairs.error(j), math.hypot(pk, spec.errors(j)[0]) if scaled else 0.0
    return (p0 * p0 + pk * pk + tk * tk) ** 0.5


def steady_rate(width: int, periods: list[float], tokens_per_row: list[float]) -> float | None:
    """Aggregate tokens/s of `width` rows as the control estimates it: width x the mean tokens a
    row emits per round / the median round period (so one slow round moves nothing). The
    control's gain for K is this figure at K over the same at plain (E(K) T(0) / T(K));
    `gmlx sweep-cap` ranks its arms by it, so the two agree. None below MIN_SAMPLES rounds."""
    if len(periods) < MIN_SAMPLES or not tokens_per_row:
        return None
    return width * (sum(tokens_per_row) / len(tokens_per_row)) / statistics.median(periods)
