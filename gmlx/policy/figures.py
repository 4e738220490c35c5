"""The online control's records (gmlx/policy/control.py): width buckets, the acceptance estimate,
recent round periods and tokens per K, and a choice with its reason. Pure host arithmetic."""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

WINDOW = 16  # rounds per (width, k) in the running median
MIN_SAMPLES = 3  # measured rounds before a median replaces the cost model's figure
PRIOR_WEIGHT = 3.0  # rounds the prior acceptance (alpha 0.6, below) is worth
DECAY = 0.97  # per round: old acceptance fades (a drafter that starts agreeing is seen)
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
    adds a successes and one failure when a < k (alpha = s / (s + f))."""

    successes: float = 1.8  # the prior: alpha 0.6 worth PRIOR_WEIGHT = 3 rounds
    failures: float = 1.2
    rounds: int = 0
    decay: float = DECAY  # per round (1.0: every round counts alike)

    @property
    def alpha(self) -> float:
        return self.successes / (self.successes + self.failures)

    def record(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.successes = self.successes * self.decay + accepted
            self.failures = self.failures * self.decay + (accepted < drafted)
            self.rounds += 1


@dataclass
class Times:
    """Recent round periods (start to next start), per k, at one width; and for speculative k the
    tokens each row emitted per round (measured, so the gain needs no model of acceptance there)."""

    by_k: dict[int, deque] = field(default_factory=dict)
    tokens: dict[int, deque] = field(default_factory=dict)

    def add(self, k: int, seconds: float) -> None:
        self.by_k.setdefault(k, deque(maxlen=WINDOW)).append(seconds)

    def add_tokens(self, k: int, per_row: float) -> None:
        self.tokens.setdefault(k, deque(maxlen=2 * WINDOW)).append(per_row)

    def tokens_per_round(self, k: int) -> float | None:
        d = self.tokens.get(k)
        return sum(d) / len(d) if d is not None and len(d) >= MIN_SAMPLES else None

    def median(self, k: int) -> float | None:
        d = self.by_k.get(k)
        return statistics.median(d) if d is not None and len(d) >= MIN_SAMPLES else None

    def errors(self, k: int) -> tuple[float, float]:
        """Relative standard errors of k's median period and (k >= 1) of its mean tokens per row
        and round; 0 where fewer than MIN_SAMPLES rounds (nothing to say the spread from)."""
        d, t = self.by_k.get(k, ()), self.tokens.get(k, ())
        period = 0.0
        if len(d) >= MIN_SAMPLES:  # the median's error from the MAD (robust to the VM's spikes)
            med = statistics.median(d)
            period = 1.2533 * 1.4826 * statistics.median(abs(x - med) for x in d) / (med * math.sqrt(len(d)))
        tokens = statistics.stdev(t) / (statistics.fmean(t) * math.sqrt(len(t))) if len(t) >= MIN_SAMPLES else 0.0
        return period, tokens


def gain_doubt(plain: Times, spec: Times, k: int) -> float:
    """The relative standard error of k's predicted gain E(k) T(0) / T(k) from the figures measured
    (the two period medians, k's tokens per round; 0 for what is not measured)."""
    p0, _ = plain.errors(0)
    pk, tk = spec.errors(k)
    return (p0 * p0 + pk * pk + tk * tk) ** 0.5


def steady_rate(width: int, periods: list[float], tokens_per_row: list[float]) -> float | None:
    """Aggregate tokens/s of `width` rows as the control estimates it: width x the mean tokens a
    row emits per round / the median round period (so one slow round moves nothing). The
    control's gain for K is this figure at K over the same at plain (E(K) T(0) / T(K));
    `gmlx sweep-cap` ranks its arms by it, so the two agree. None below MIN_SAMPLES rounds."""
    if len(periods) < MIN_SAMPLES or not tokens_per_row:
        return None
    return width * (sum(tokens_per_row) / len(tokens_per_row)) / statistics.median(periods)


@dataclass(frozen=True)
class Choice:
    """What the control runs at a width, and why (said to the user: generate, bench, serve)."""

    k: int  # 0: plain
    gain: float  # predicted tokens/s relative to plain decoding (1.0 for plain)
    alpha: float
    plain_s: float | None  # the plain round time used (measured or derived)
    round_s: float | None  # the chosen k's round time (measured or derived); None: plain
    measured: bool  # both times measured here (not the cost model's figures)
    exploring: bool = False
    window: bool = False  # a plain round of the once-only plain measurement (speculation stays chosen)
    best_spec: tuple[int, float] | None = None  # the best K >= 1 and its predicted gain (why plain)
    from_width: int | None = None  # nothing measured here: predicted from that width's round times
    doubt: float = 0.0  # the best K's predicted gain's relative standard error (measured figures)
    drain: float = 1.0  # the share of the steady gain left once the draining batch's tail is charged

    @property
    def reason(self) -> str:
        src = ("measured" if self.measured else f"width {self.from_width}'s round times" if self.from_width
               else "cost model")
        if self.drain < 0.995:  # the rows' budgets end together: speculating spreads their finish
            src += f", rows finishing apart cost {100 * (1 - self.drain):.0f} %"
        if self.window:
            return "measuring plain rounds once at this width"
        if self.exploring:
            return f"trying K={self.k} again (plain for a while; acceptance {self.alpha:.2f})"
        if self.k == 0:
            alt = ""
            if self.best_spec:
                k, g = self.best_spec
                noise = f" ± {g * self.doubt:.2f} (within noise)" if g >= 1.0 and self.doubt else ""
                alt = f"best K={k} predicted {g:.2f}x{noise}, "
            return f"plain: {alt}acceptance {self.alpha:.2f} ({src})"
        times = (f", round {1e3 * self.round_s:.1f} ms vs plain {1e3 * self.plain_s:.1f} ms"
                 if self.round_s and self.plain_s else "")
        return f"K={self.k}: {self.gain:.2f}x predicted ({src}{times}, acceptance {self.alpha:.2f})"
