"""One width's online control (gmlx/policy/control.py has the whole rule): the figures measured at a width
bucket, the choice in force, and the hysteresis, tries and exploration that move it (their thresholds,
each with why: gmlx/policy/thresholds.py). Pure arithmetic over host figures; it never moves a token."""

from __future__ import annotations

import time
from collections.abc import Callable

from gmlx.policy.costs import Costs, emitted
from gmlx.policy.drain import drain
from gmlx.policy.choice import Choice
from gmlx.policy.figures import MARGIN, MIN_SAMPLES, STAY, Z, Acceptance, Times, gain_doubt, surely_pays
from gmlx.policy.pairs import PAIR_SPAN, STEADY_WARM, Pairs
from gmlx.policy.thresholds import (EXPLORE_FIRST, EXPLORE_MAX, EXPLORE_SOON, FAR, FIRST_K1, KEEPABLE_TRIES,
                                    LONE_MIN_EVIDENCE, LONE_POINT, LONE_TRY, LONE_TRY_WITHIN, MIN_EVIDENCE, MIN_RATIO,
                                    PLAIN_CHECK_AFTER, PLAIN_WINDOW, REFRESH_FIRST, REFRESH_MAX, REFRESH_WINDOW,
                                    RETRY_AFTER, SHADOW_FIRST, SHADOW_AGAIN, SHADOW_SPAN, SHADOW_STOP, STEADY_PAIRS,
                                    TRY_FIRST, TRY_WITHIN)

# The thresholds are read here by name (tests and benchmarks patch them on this module).


def acceptance_doubt(acc: Acceptance) -> float:
    """The relative standard error of a round's tokens from the acceptance's own count of drafts (binomial,
    first position): a lone request sent plain with a gain this near 1 explores again soon (EXPLORE_SOON)."""
    n, a = acc.successes + acc.failures, acc.alpha
    return (a * (1.0 - a) / n) ** 0.5 / (1.0 + a) if n > 0 else 0.0


def starts_plain(shadowed: bool, lone: bool) -> bool:
    """Whether a width not decided yet starts plain: a batch's whose rounds would shadow (SHADOW_FIRST)."""
    return SHADOW_FIRST and shadowed and not lone


class WidthControl:
    """The figures and the choice in force at one width bucket."""

    def __init__(self, plain: Times, spec: Times, lone: bool = False):
        self.plain, self.spec = plain, spec  # shared per target / per (target, drafter)
        self.acceptance = Acceptance()
        self.current: int | None = None  # the k in force (None: not decided yet)
        self.rounds_in_choice, self.rounds = 0, 0  # (rounds: observed here)
        self.plain_run = 0  # consecutive plain rounds while the choice is plain
        self.explore_after, self.shadows_from = EXPLORE_FIRST, 0  # (shadows_from: control.far_from_paying)
        self.spec_rounds = 0
        self.last_run: dict[int, int] = {}  # k -> spec_rounds when it last ran here
        self.plain_window = 0  # plain rounds still owed to a window (pairs.Pairs: its rounds pair)
        # the K in force when the window started, and the speculative rounds after it that still run
        # it: Pairs keys its samples by K, so the window pairs one K on both sides
        self.window_k, self.after_window = 0, 0
        self.pairs = Pairs(warm=STEADY_WARM if lone and STEADY_PAIRS else 0)  # T(k) / T(0): pairs.Pairs
        self.since_pair = 0  # speculative rounds since the last pair
        self.refresh_after = PLAIN_CHECK_AFTER
        self.exploring = False
        self.tentative = False  # speculation tried (first, or exploring), not yet sure to pay
        self.far = False  # the choice in force is predicted at least FAR (no plain window is owed)
        self.lift: dict[int, float] = {}  # per k: this width's round cost over the nearest timed width's (`choose`)
        self.last_choice: Choice | None = None  # the last choice made here, by any engine (Controller.choose)

    def settled(self) -> bool:
        """The choice in force held MIN_EVIDENCE rounds, nothing pending (the Controller may reuse it)."""
        return (self.current is not None and self.rounds_in_choice >= MIN_EVIDENCE and not self.tentative
                and not self.exploring and self.plain_window == 0)

    def times(self, k: int, costs: Costs, near: "WidthControl | None" = None) -> tuple[float | None, float | None, bool]:
        """(plain seconds, k's seconds, both measured): medians where measured, else derived through
        the cost model from the nearest measured kind (another speculative k before plain rounds: a
        period holds host work a forward-only ratio does not), or a plain time from k's through the
        ratio measured at `near` (`lift`ed here). (None, None) before any round."""
        med = {j: self._median(j) for j in self._known()}
        med = {j: v for j, v in med.items() if v is not None}
        if not med:
            return None, None, False
        tk = med[k] if k in med else self._derived(k, med, costs)
        t0 = med[0] if 0 in med else self._derived(0, med, costs)
        if 0 not in med and near is not None:
            n0, nk, _ = near.times(k, costs)
            t0 = tk * n0 / (nk * self.lift.get(k, 1.0))
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

    def ratio(self, k: int, costs: Costs, lone: bool = False) -> tuple[float | None, str]:
        """T(k) / T(0) without the machine's drift, and where it comes from: "paired" (pairs.Pairs; a k not
        paired itself from the nearest paired k, scaled by the two speculative medians or the cost model),
        "probe" (the lone request before any pair: the load probe's costs), or (None, "") — the medians then."""
        j = self.pairs.nearest(k)
        if j is not None:
            mj, mk = self.spec.median(j), self.spec.median(k)
            scale = mk / mj if mj and mk else costs.round_cost(k) / costs.round_cost(j)
            return self.pairs.ratio(j) * (1.0 if j == k else scale), "paired"
        if lone:
            return costs.round_cost(k), "probe"
        return None, ""

    def gain(self, k: int, costs: Costs, acc: Acceptance, nearby: "WidthControl | None" = None,
             lone: bool = False, hope: bool = False) -> tuple[float, bool]:
        """k's predicted gain over plain at acceptance `acc`, and whether its cost ratio is measured here.
        `lone`: `acc` is one request's own (`_seen`). `hope`: the most its deeper positions could accept."""
        if k == 0:
            return 1.0, True
        r, src = self.ratio(k, costs, lone)
        measured = src == "paired"
        if r is None and nearby is not None and not self.spec_timed():  # the nearest timed width's
            r = nearby.ratio(k, costs)[0]
            if r is None:
                t0, tk = nearby.times(k, costs)[:2]
                r = tk / t0 if t0 else None
            r = r * self.lift.get(k, 1.0) if r is not None else None  # (scaled to this width's rows)
        elif r is None:  # this width's medians (its plain time through nearby's ratio when not measured here)
            t0, tk, measured = self.times(k, costs, nearby)
            r = tk / t0 if t0 is not None else None
        if r is None:  # nothing measured anywhere: the cost model alone
            return acc.emitted(k, hope) / costs.round_cost(k), False
        return (acc.emitted(k, hope) if hope else self._seen(k, acc, lone)) / max(r, MIN_RATIO), measured

    def choose(self, max_k: int, costs: Costs, acceptance: Acceptance | None = None, nearby: tuple | None = None,
               width: int = 0, remaining: tuple[int, ...] = (), drain_share: float = 1.0,
               shadowed: bool = False) -> Choice:
        """The k to run now (0: plain), kept by hysteresis; the tries, exploration and plain window
        of the module's doc. `nearby`: (width, its control, its costs), the nearest timed width.
        `remaining`, `drain_share`: the drain charge's (policy/drain.py); a try needs room for its
        rounds. `shadowed`: thresholds.SHADOW_FIRST."""
        acc = acceptance or self.acceptance
        alpha = acc.alpha
        ratio = nearby[1] if nearby is not None else None  # its T(0) / T(k) where this width lacks one
        # ... scaled by the probe's rows' costs here over there: a verify costs relatively more as
        # rows are added (SmolLM2 float32, K = 1: 1.25 plain rounds at width 2, 1.57 at width 4)
        self.lift = {k: costs.round_cost(k) / nearby[2].round_cost(k) for k in range(1, max_k + 1)} \
            if nearby is not None and len(nearby) > 2 else {}
        near = ratio if not self.spec_timed() else None  # ... or both
        lone = acceptance is not None  # the scalar loop's request (its own acceptance; the pool's is this width's)
        drains = {k: drain(remaining, alpha, k, drain_share) for k in range(0, max_k + 1)}
        gains = {k: self.gain(k, costs, acc, ratio, lone)[0] * drains[k] for k in range(0, max_k + 1)}
        best = argmax = max(gains, key=lambda k: (gains[k], -k))
        best_spec = max(range(1, max_k + 1), key=lambda k: (gains[k], -k)) if max_k else 0
        cur = self.current
        # the noise matters only to a gain >= 1 (entry test): not computed otherwise, nor lone once paired (LONE_POINT)
        point = lone and LONE_POINT and bool(self.pairs.paired())
        doubt = (gain_doubt(self.plain, self.spec, best_spec, self.pairs, probe=lone and not self.pairs.paired())
                 if best_spec and near is None and not point and gains[best_spec] >= 1.0 else 0.0)
        unsure = bool(doubt) and gains[best_spec] >= MARGIN and not surely_pays(gains[best_spec], doubt)
        if point and best_spec:  # what is uncertain is the request's own acceptance (LONE_POINT)
            unsure = gains[best_spec] < MARGIN and gains[best_spec] * (1.0 + Z * acceptance_doubt(acc)) >= 1.0
        if first_shadowed := cur is None and starts_plain(shadowed, lone):
            best = 0  # plain: its shadow rounds measure what a try would (thresholds.SHADOW_FIRST)
        if cur is not None and cur in gains:  # hysteresis, the doubt to plain (see the module's doc)
            settled = self.rounds_in_choice >= (LONE_MIN_EVIDENCE if lone else MIN_EVIDENCE)
            sure = best > 0 and surely_pays(gains[best], doubt)
            if (cur == 0) != (best == 0) and not settled:
                best = cur
            elif (cur == 0 and best and not sure) or (cur and best and settled and (
                    gains[best] < STAY or (self.tentative and not sure))):
                best = 0  # a try (first, or exploring) stays only if its measured gain is sure
            elif cur and best and settled:
                if self.tentative:  # a try confirmed: speculation won again, the back-off starts over
                    self.explore_after = EXPLORE_FIRST
                self.tentative = False
        self.exploring = False
        # A narrower width's ratio errs low (a verify costs relatively more as rows are added): a
        # loss it predicts is no reason to try.
        trusted = near is not None and nearby[0] < width
        # A try needs room: its rounds must run here before a row finishes and the width changes.
        room = not remaining or min(remaining) >= MIN_EVIDENCE * emitted(alpha, max(best_spec, 1))
        # A new lone request (none of its own rounds yet) where plain is in force (see LONE_TRY)
        trying = LONE_TRY and lone and max_k > 0 and acc.rounds == 0 and best == 0 and gains[1] >= TRY_FIRST
        if trying:
            best = 1
        elif cur is None and best == 0 and best_spec and gains[best_spec] >= TRY_FIRST and not self._known() \
                and not trusted and room and not first_shadowed:
            best = best_spec  # nothing decided here yet and no clear loss predicted: measure it
        elif best == 0 and cur == 0 and best_spec and self.plain_run >= (EXPLORE_SOON if unsure else self.explore_after) \
                and room and (not shadowed or gains[best_spec] >= TRY_FIRST) \
                and (pick := self._explored(max_k, costs, acc, ratio, lone, drains, gains, best_spec, shadowed)):
            best = self._retry(pick)
            if not unsure:
                self.explore_after = min(EXPLORE_MAX, self.explore_after * 2)
            self.exploring = True
        elif best > 0 and best == argmax and gains[best] > 1.0:
            best = self._neighbour_to_try(best, gains, self._hopes(max_k, costs, acc, ratio, lone, drains),
                                          LONE_TRY_WITHIN if lone else TRY_WITHIN)
        if best > 1 and not lone and FIRST_K1 and self.spec_rounds < MIN_EVIDENCE:
            best = 1  # a width's first speculative rounds measure K = 1 (thresholds.FIRST_K1)
        if best and 0 < self.window_k <= max_k and (self.plain_window or self.after_window):
            best = self.window_k  # (within this caller's ceiling: a new request may have a lower one)
        if cur is None or (best == 0) != (cur == 0):
            self.rounds_in_choice, self.tentative = 0, best > 0 and (cur is None or self.exploring or trying)
            if best > 0 and cur == 0 and not self.exploring and not trying:
                self.explore_after = EXPLORE_FIRST  # speculation won again: try sooner next time
        self.current = best
        t0, tk, measured = self.times(best, costs, ratio)
        # far: by the choice's own figures and by the medians where both are timed here; with neither
        # pairs nor a plain median (the probe's or the cost model's ratio alone) a window still runs.
        self.far = best > 0 and not self.tentative and gains[best] >= FAR and (
            self._seen(best, acc, lone) * t0 / tk >= FAR if measured else bool(self.pairs.paired()))
        if best > 0 and self.plain_window > 0:  # an overlay: the choice in force stays `best` (said in best_spec)
            return Choice(0, 1.0, alpha, t0, None, measured, window=True, best_spec=(best, gains[best]))
        alt = (best_spec, gains[best_spec]) if best_spec else None
        r, src = self.ratio(best or best_spec, costs, lone) if best or best_spec else (None, "")
        return Choice(best, gains[best], alpha, t0, tk if best else None, src == "paired" or (measured and not src),
                      self.exploring, best_spec=alt, from_width=nearby[0] if near is not None and not src else None,
                      doubt=doubt, drain=drains[best or best_spec], ratio=r and max(r, MIN_RATIO), probe=src == "probe",
                      tried=trying)

    def _seen(self, k: int, acc: Acceptance, lone: bool) -> float:
        """k's tokens per row and round: measured here (the width's last rounds at k), else the
        acceptance's model; the lone request's, its own acceptance's model (not width 1's rounds
        scaled by it: they counted its streak twice, docs/speculation.md)."""
        if lone:
            return acc.emitted(k)
        seen = self.spec.tokens_per_round(k)
        return acc.emitted(k) if seen is None else seen

    def _hopes(self, max_k: int, costs: Costs, acc: Acceptance, nearby, lone: bool,
               drains: dict[int, float]) -> dict[int, float]:
        """The gain each k untried (under MIN_SAMPLES rounds) or stale (not run for RETRY_AFTER rounds:
        bad luck must not shelve a K for good) could have, deeper drafts credited as always agreeing."""
        return {k: self.gain(k, costs, acc, nearby, lone, hope=True)[0] * drains[k]
                for k in range(1, max_k + 1) if len(self.spec.by_k.get(k, ())) < MIN_SAMPLES
                or self.spec_rounds - self.last_run.get(k, 0) > RETRY_AFTER}

    def _explored(self, max_k: int, costs: Costs, acc: Acceptance, nearby, lone: bool, drains: dict[int, float],
                  gains: dict[int, float], best_spec: int, shadowed: bool) -> int:
        """The K an exploration tries: an untried (or stale) one hoped above the best K's gain, else the best K;
        none (0) where the width shadows and even its hope is under MARGIN (thresholds.KEEPABLE_TRIES)."""
        hopes = self._hopes(max_k, costs, acc, nearby, lone, drains)  # an untried K may be the one
        k = max(hopes, key=lambda j: (hopes[j], -j)) if hopes and max(hopes.values()) > gains[best_spec] else best_spec
        return 0 if shadowed and KEEPABLE_TRIES and max(hopes.get(k, 0.0), gains[k]) < MARGIN else k

    def _neighbour_to_try(self, best: int, gains: dict[int, float], hopes: dict[int, float], within: float) -> int:
        """The k nearest the best, untried, whose hope is `within` (TRY_WITHIN; LONE_TRY_WITHIN) of the best and
        no loss: a few rounds measure it rather than trust the models (a deep draft may agree more, or less)."""
        untried = [k for k, h in hopes.items() if k != best and h >= max(1.0, within * gains[best])]
        return self._retry(min(untried, key=lambda k: (abs(k - best), -k))) if untried else best

    def _retry(self, k: int) -> int:
        """k is measured afresh: its old periods and tokens per round go (its paired ratio stays)."""
        if len(self.spec.by_k.get(k, ())) >= MIN_SAMPLES:
            self.spec.forget(k)
        return k

    def add_time(self, k: int, seconds: float) -> None:
        """A steady round's period at this width with k drafts (0: plain)."""
        (self.plain if k == 0 else self.spec).add(k, seconds)
        self._pair(k, seconds)

    def _pair(self, k: int, seconds: float) -> None:
        before = self.pairs.samples
        self.pairs.add(k, seconds, time.perf_counter())
        if self.pairs.samples > before:
            self.since_pair, self.refresh_after = 0, max(self.refresh_after, REFRESH_FIRST)

    def observe(self, k: int, seconds: float | None, rows: list[tuple[int, int]],
                ratio_lent: Callable[[], bool] = lambda: False, steady: bool = True) -> None:
        """A round ran at this width with k drafts (0: plain) in `seconds` (None: timed later, or not a
        steady-state round, e.g. a capture round); `rows`: (drafted, accepted) per row. `ratio_lent()`:
        whether another width has both times (asked only when the plain window would start). `steady`: no
        admission or transition just before it — only such rounds count in the tokens per round."""
        if seconds is not None:
            self.add_time(k, seconds)
        if k and rows and steady:
            self.spec.add_tokens(k, sum(min(a, d) + 1 for d, a in rows) / len(rows))
        for drafted, accepted in rows:
            self.acceptance.record(drafted, accepted)
        self.rounds_in_choice, self.rounds = self.rounds_in_choice + 1, self.rounds + 1
        if k == 0:
            self.plain_run += 1
            self.plain_window = max(0, self.plain_window - 1)
        else:
            self.plain_run = 0
            self.after_window = max(0, self.after_window - (self.plain_window == 0))
            self.spec_rounds += 1
            self.last_run[k] = self.spec_rounds
            self.since_pair += 1
            if self.plain_window == 0 and self.since_pair >= self.refresh_after:
                # No pair for a while: a few plain rounds pair with the speculative ones around them. The first
                # (nothing paired) is skipped where another width lends its ratio (a window costs a gate and a
                # resume); then every REFRESH_FIRST rounds, doubling. None while the choice is predicted FAR.
                first = not self.pairs.paired()
                self.plain_window = (0 if self.far or (first and ratio_lent()) else PLAIN_WINDOW if first
                                     else REFRESH_WINDOW)
                self.since_pair = 0
                self.window_k, self.after_window = (k, PAIR_SPAN) if self.plain_window else (0, 0)
                self.refresh_after = REFRESH_FIRST if first else min(REFRESH_MAX, 2 * self.refresh_after)
