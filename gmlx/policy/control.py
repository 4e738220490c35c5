"""Online control of speculation: what each width and K really buys, measured from the rounds the
engine runs, and the choice that follows — K drafts per round, or plain decoding (K = 0).

Per width w (exact up to 8, then powers of two) the controller keeps the period of recent rounds
(from one round's start to the next's: everything the engine does per round, host work included)
for each k it ran (k = 0: plain rounds), the tokens a row emitted per round at each k, and the
per-position acceptance alpha of the drafts at that width. Its prediction for k drafts, relative
to plain decoding, is

    gain(w, k) = E(w, k) * T(w, 0) / T(w, k)

with E the measured mean tokens per row and round at k (its accepted run plus the bonus), or
before that the geometric model E(alpha, k) = (1 - alpha^(k+1)) / (1 - alpha) (costs.py). T is
the median of the last WINDOW periods of that kind — a load spike moves one round, not the median.
A T not measured yet comes from one that is, scaled by the cost model (`Costs.round_cost`: the
probe's verify and drafter costs, or the built-in prior): before any round, the prediction is the
cost model's; after a few, it is the machine's. A width where no speculative round is timed yet
takes T(0) / T(k) from the nearest width where both are (the load probe times one request at
width 1; as rows are added a verify costs relatively more), and a loss predicted from a narrower
width is not tried first. The best k (gain, k = 0 counting 1) runs, with hysteresis giving the
doubt to plain (never lose): speculation is left once predicted under STAY (after MIN_EVIDENCE
rounds), entered only when predicted MARGIN better and above 1 by more than Z standard errors
of its measured figures (two period medians from a noisy machine, the tokens per round); a try
(a new width's first, an exploration) stays after MIN_EVIDENCE rounds only if it passes that.

Keeping the estimates fresh at a bounded cost: a width decided plain tries speculation again
after `explore_after` plain rounds there (64, doubling each time the try confirms plain, up to
1024: at most ~10 % of rounds, then ~1 %), and a width that speculates without a plain
measurement runs PLAIN_WINDOW plain rounds once, so its "1.0x" is measured, not assumed — unless
another width has both timed: then its plain time is this width's k time through that width's
ratio T(0) / T(k) (a window costs a gate and a resume, a large share of a short burst's rounds). Plain
round times are shared by every engine on the same target in the process (a plain baseline's
rounds teach the speculative engine), speculative ones per (target, drafter kind).

Pure arithmetic over host-side figures: nothing here touches the device. The control never moves
a token: it only decides how many drafts a round checks (docs/design.md §3).
"""

from __future__ import annotations

import weakref

from gmlx.policy.costs import Costs, emitted
from gmlx.policy.figures import (MIN_SAMPLES, PRIOR_WEIGHT, STAY, Acceptance, Choice, Times, bucket, gain_doubt,
                                 surely_pays)

TRY_FIRST = 0.9  # before any measurement, speculation is tried unless predicted below this
TRY_WITHIN = 0.9  # an unmeasured K predicted at least this fraction of the best is measured
MIN_EVIDENCE = 6  # rounds of a choice before the control may leave it (its figures must exist)
EXPLORE_FIRST, EXPLORE_MAX = 64, 1024  # plain rounds at a width before speculation is tried again
PLAIN_WINDOW = 5  # plain rounds a speculating width runs once, when it has no plain measurement
PLAIN_CHECK_AFTER = 4  # speculative rounds at a width before that plain window


class WidthControl:
    """The figures and the choice in force at one width bucket."""

    def __init__(self, plain: Times, spec: Times):
        self.plain, self.spec = plain, spec  # shared per target / per (target, drafter)
        self.acceptance = Acceptance()
        self.current: int | None = None  # the k in force (None: not decided yet)
        self.rounds_in_choice = 0
        self.plain_run = 0  # consecutive plain rounds while the choice is plain
        self.explore_after = EXPLORE_FIRST
        self.spec_rounds = 0
        self.plain_window = 0  # plain rounds still owed to the once-only plain measurement
        self.plain_checked = False
        self.exploring = False
        self.tentative = False  # speculation tried (first, or exploring), not yet sure to pay

    def times(self, k: int, costs: Costs, near: "WidthControl | None" = None) -> tuple[float | None, float | None, bool]:
        """(plain seconds, k's seconds, both measured): medians where measured, else derived
        through the cost model's ratio from the nearest measured kind — another speculative k
        before plain rounds (a period holds host work a forward-only ratio does not) — or, for a
        plain time, from k's through the ratio measured at `near` (both timed there). (None,
        None) before any round."""
        med = {j: self._median(j) for j in self._known()}
        med = {j: v for j, v in med.items() if v is not None}
        if not med:
            return None, None, False
        tk = med[k] if k in med else self._derived(k, med, costs)
        t0 = med[0] if 0 in med else self._derived(0, med, costs)
        if 0 not in med and near is not None:
            n0, nk, _ = near.times(k, costs)
            t0 = tk * n0 / nk
        return t0, tk, 0 in med and k in med

    @staticmethod
    def _derived(k: int, med: dict[int, float], costs: Costs) -> float:
        """k's period from the nearest measured kind of the same sort (speculative for k >= 1)."""
        same = [j for j in med if (j > 0) == (k > 0)] or list(med)
        j = min(same, key=lambda j: (abs(j - k), j))
        return med[j] * costs.round_cost(k) / costs.round_cost(j)

    def spec_timed(self) -> bool:
        """Whether a speculative round's period is measured here (enough rounds for a median)."""
        return any(self.spec.median(k) is not None for k in self.spec.by_k)

    def _known(self) -> set[int]:
        return set(self.plain.by_k) | set(self.spec.by_k)

    def _median(self, k: int) -> float | None:
        return (self.plain if k == 0 else self.spec).median(k)

    def gain(self, k: int, costs: Costs, alpha: float, nearby: "WidthControl | None" = None) -> tuple[float, bool]:
        if k == 0:
            return 1.0, True
        if nearby is not None and not self.spec_timed():  # the nearest timed width's T(0) / T(k)
            t0, tk, measured = (*nearby.times(k, costs)[:2], False)
        else:  # this width's times (its plain time through nearby's ratio when not measured here)
            t0, tk, measured = self.times(k, costs, nearby)
        if t0 is None:  # nothing measured anywhere: the cost model alone
            return costs.speedup(alpha, k), False
        seen = self.spec.tokens_per_round(k)  # measured tokens per row and round, else the model's E
        return (seen if seen is not None else emitted(alpha, k)) * t0 / tk, measured

    def choose(self, max_k: int, costs: Costs, acceptance: Acceptance | None = None,
               nearby: tuple[int, "WidthControl"] | None = None, width: int = 0) -> Choice:
        """The k to run now (0: plain): the best predicted, kept by hysteresis; speculation tried
        first at a width with nothing measured unless the cost model predicts a clear loss; an
        unmeasured k tried when predicted close to the best (the cost model's ratios come
        from one probe); speculation tried again after a run of plain rounds; the plain window."""
        alpha = (acceptance or self.acceptance).alpha
        near = nearby[1] if nearby is not None and not self.spec_timed() else None
        ratio = nearby[1] if nearby is not None else None
        gains = {k: self.gain(k, costs, alpha, ratio)[0] for k in range(0, max_k + 1)}
        best = argmax = max(gains, key=lambda k: (gains[k], -k))
        best_spec = max(range(1, max_k + 1), key=lambda k: (gains[k], -k)) if max_k else 0
        cur = self.current
        doubt = gain_doubt(self.plain, self.spec, best_spec) if best_spec and near is None else 0.0
        if cur is not None and cur in gains:  # hysteresis, the doubt to plain (see the module's doc)
            settled, sure = self.rounds_in_choice >= MIN_EVIDENCE, best > 0 and surely_pays(gains[best], doubt)
            if (cur == 0) != (best == 0) and not settled:
                best = cur
            elif (cur == 0 and best and not sure) or (cur and best and settled and (
                    gains[best] < STAY or (self.tentative and not sure))):
                best = 0  # a try (first, or exploring) stays only if its measured gain is sure
            elif cur and best and settled:
                self.tentative = False
        self.exploring = False
        # A narrower width's ratio errs low (a verify costs relatively more as rows are added): a
        # loss it predicts is no reason to try.
        trusted = near is not None and nearby[0] < width
        if cur is None and best == 0 and best_spec and gains[best_spec] >= TRY_FIRST and not self._known() \
                and not trusted:
            best = best_spec  # nothing decided here yet and no clear loss predicted: measure it
        elif best == 0 and cur == 0 and best_spec and self.plain_run >= self.explore_after:
            best = best_spec
            self.explore_after = min(EXPLORE_MAX, self.explore_after * 2)
            self.exploring = True
        elif best > 0 and best == argmax and gains[best] > 1.0:
            best = self._neighbour_to_try(best, max_k, gains)
        if cur is None or (best == 0) != (cur == 0):
            self.rounds_in_choice, self.tentative = 0, best > 0 and (cur is None or self.exploring)
            if best > 0 and cur == 0 and not self.exploring:
                self.explore_after = EXPLORE_FIRST  # speculation won again: try sooner next time
        self.current = best
        t0, tk, measured = self.times(best, costs, ratio)
        if best > 0 and self.plain_window > 0:  # an overlay: the choice in force stays `best`
            return Choice(0, 1.0, alpha, t0, None, measured, window=True)
        alt = (best_spec, gains[best_spec]) if best_spec else None
        return Choice(best, gains[best], alpha, t0, tk if best else None, measured, self.exploring, best_spec=alt,
                      from_width=nearby[0] if near is not None else None, doubt=doubt)

    def _neighbour_to_try(self, best: int, max_k: int, gains: dict[int, float]) -> int:
        """The k nearest the best that has fewer than MIN_SAMPLES rounds measured and is predicted
        within TRY_WITHIN of the best and not a loss: a few rounds measure it instead of trusting the cost
        model's ratio (one probe at width 1; a deep draft position agrees less than the geometric
        model says), so every plausible k up to the ceiling is soon a measurement."""
        untried = [k for k in range(1, max_k + 1) if k != best and len(self.spec.by_k.get(k, ())) < MIN_SAMPLES
                   and gains[k] >= max(1.0, TRY_WITHIN * gains[best])]
        return min(untried, key=lambda k: (abs(k - best), -k)) if untried else best

    def add_time(self, k: int, seconds: float) -> None:
        """A steady round's period at this width with k drafts (0: plain)."""
        (self.plain if k == 0 else self.spec).add(k, seconds)

    def observe(self, k: int, seconds: float | None, rows: list[tuple[int, int]]) -> None:
        """A round ran at this width with k drafts (0: plain) in `seconds` (None: not a steady-state
        round, e.g. a capture round); `rows`: (drafted, accepted) per row."""
        if seconds is not None:
            (self.plain if k == 0 else self.spec).add(k, seconds)
        if k and rows:
            self.spec.add_tokens(k, sum(min(a, d) + 1 for d, a in rows) / len(rows))
        for drafted, accepted in rows:
            self.acceptance.record(drafted, accepted)
        self.rounds_in_choice += 1
        if k == 0:
            self.plain_run += 1
            self.plain_window = max(0, self.plain_window - 1)
        else:
            self.plain_run = 0
            self.spec_rounds += 1
            if (not self.plain_checked and self.spec_rounds >= PLAIN_CHECK_AFTER
                    and self.plain.median(0) is None):
                self.plain_checked, self.plain_window = True, PLAIN_WINDOW


# Figures learnt in this process, shared by every engine on the same target: plain round times per
# target, speculative ones per (target, drafter kind) — a new engine starts from what earlier ones
# (a plain baseline, the previous bench cell, the last request) measured.
# The choice in force, the acceptance and the exploration's back-off are kept per (target,
# drafter kind) too: a new engine (the next bench cell, a new `Engine()` in a server process)
# continues from the process's last decision instead of starting cold.
_plain: "weakref.WeakKeyDictionary[object, dict[int, Times]]" = weakref.WeakKeyDictionary()
_spec: "weakref.WeakKeyDictionary[object, dict[tuple, Times]]" = weakref.WeakKeyDictionary()
_widths: "weakref.WeakKeyDictionary[object, dict[tuple, WidthControl]]" = weakref.WeakKeyDictionary()


def _key(target: object) -> object:
    """The model the figures belong to: a view of the target (an EAGLE-3 head's, new with each
    engine) files them under the target it wraps, so the next engine does not start cold."""
    return getattr(target, "figures_key", target)


def record_plain(target: object, width: int, seconds: float) -> None:
    """A plain round's time from an engine without a drafter (a plain baseline): the same code
    path as a speculative engine's plain rounds, so its figure counts for every drafter."""
    _plain.setdefault(_key(target), {}).setdefault(bucket(width), Times()).add(0, seconds)


def forget(target: object) -> None:
    """Drop everything learnt for this target in this process (tests; a changed machine)."""
    for d in (_plain, _spec, _widths):
        d.pop(_key(target), None)


class Controller:
    """Per-width control for one engine (the figures underneath are shared, see above)."""

    def __init__(self, target: object, drafter_kind: str | None, costs: Costs):
        self.costs = costs
        target = _key(target)
        self._plain = _plain.setdefault(target, {})
        self._spec = _spec.setdefault(target, {})
        self._shared = _widths.setdefault(target, {})
        self.drafter_kind = drafter_kind
        self.widths: dict[int, WidthControl] = {}  # this engine's view of the shared per-width state
        self.switches = 0  # times a width's choice changed between plain and speculative
        self.switched: list[tuple[int, str]] = []  # (width, reason) of switches not yet reported
        self.last: dict[int, Choice] = {}

    def at(self, width: int) -> WidthControl:
        b = bucket(width)
        if b not in self.widths:
            key = (self.drafter_kind, b)
            if key not in self._shared:
                plain = self._plain.setdefault(b, Times())
                wc = self._shared[key] = WidthControl(plain, self._spec.setdefault(key, Times()))
                wc.acceptance = self._nearest_acceptance(b)
            self.widths[b] = self._shared[key]
        return self.widths[b]

    def _nearest_acceptance(self, b: int) -> Acceptance:
        """A new width starts from the acceptance this drafter showed at the nearest width that
        ran (worth the prior's weight), not the generic prior: a drafter that agrees 20 % of the
        time alone agrees about as often beside other rows."""
        seen = [(abs(w - b), wc) for (kind, w), wc in self._shared.items()
                if kind == self.drafter_kind and w != b and wc.acceptance.rounds]
        if not seen:
            return Acceptance()
        alpha = min(seen, key=lambda x: x[0])[1].acceptance.alpha
        return Acceptance(alpha * PRIOR_WEIGHT, (1 - alpha) * PRIOR_WEIGHT)

    def choose(self, width: int, max_k: int, acceptance: Acceptance | None = None) -> Choice:
        """The k to run at this width now (at most `max_k`, the configured ceiling). Call once per
        round that runs at this width: the hysteresis and exploration count rounds."""
        wc = self.at(width)
        before = wc.current
        choice = wc.choose(max_k, self.costs, acceptance, self._nearest_timed(bucket(width)), bucket(width))
        if before is not None and (before == 0) != (wc.current == 0):  # a plain window is no switch
            self.switches += 1
            self.switched.append((width, choice.reason))
        self.last[bucket(width)] = choice
        return choice

    def _nearest_timed(self, b: int) -> tuple[int, WidthControl] | None:
        """The nearest other width where this drafter's rounds and plain rounds were timed: a width
        with nothing measured yet predicts from its ratio T(k) / T(0) rather than from the load
        probe's (one request at width 1), since a verify's cost relative to a step grows with the
        width (more of the step is arithmetic). Equally near: the wider, whose ratio errs high."""
        timed = [(w, wc) for (kind, w), wc in self._shared.items()
                 if kind == self.drafter_kind and w != b and wc.plain.median(0) is not None and wc.spec_timed()]
        return min(timed, key=lambda x: (abs(x[0] - b), -x[0])) if timed else None

    def decided_plain(self, width: int) -> bool:
        """Whether the choice in force at this width is plain (a query: changes nothing)."""
        wc = self._shared.get((self.drafter_kind, bucket(width)))
        return wc is not None and wc.current == 0

    def pooled(self, width: int) -> Acceptance:
        """A copy of this width's recent acceptance: a new lone request starts from it."""
        a = self.at(width).acceptance
        return Acceptance(a.successes, a.failures, 0)

    def observe(self, width: int, k: int, seconds: float | None, rows: list[tuple[int, int]]) -> None:
        wc = self.at(width)
        wc.observe(k, seconds, rows)
        if wc.plain_window and wc.plain_window == PLAIN_WINDOW and self._nearest_timed(bucket(width)):
            wc.plain_window = 0  # a width where both are timed lends its ratio: no gate, no resume
