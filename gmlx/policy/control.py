"""Online control of speculation: what each width and K really buys, measured from the rounds the
engine runs, and the choice that follows — K drafts per round, or plain decoding (K = 0).

Per width w (exact up to 8, then powers of two) the controller keeps the period of recent rounds
(from one round's start to the next's: everything the engine does per round, host work included)
for each k it ran (k = 0: plain rounds), the tokens a row emitted per round at each k, and the
per-position acceptance alpha of the drafts at that width. Its prediction for k drafts, relative
to plain decoding, is

    gain(w, k) = E(w, k) * T(w, 0) / T(w, k)

with E the measured mean tokens per row and round at k (its accepted run plus the bonus), or
before that the geometric model E(alpha, k) = (1 - alpha^(k+1)) / (1 - alpha) (costs.py). The cost
ratio T(w, k) / T(w, 0) is paired (pairs.Pairs): where a run of plain rounds meets a run of k
rounds, the medians of the few periods on each side (seconds apart at most) give one sample of
log T(k) - log T(0), and the ratio is the median of the recent samples. Two medians measured minutes apart are not used where pairs exist:
on a shared machine the same plain round drifts 60 -> 75 ms between minutes, and a K=1 round then
measured cheaper than a plain one (a 1.4x prediction for a 1.08x round). Before any pair, the
lone request (width 1) takes the ratio from the load probe's costs (timed back to back); a batch
width from the medians of the last WINDOW periods (a load spike moves one round, not the median),
a T not measured yet coming from one that is, scaled by the cost model (`Costs.round_cost`: the
probe's verify and drafter costs, or the built-in prior; at a batch width read off the probe's
forwards of the rows that width verifies, `Costs.at_width`). A width where no speculative round is
timed yet takes the ratio from the nearest width where it is (the load probe times one request
at width 1; as rows are added a verify costs relatively more), and a loss predicted from a
narrower width is not tried first. The best k (gain, k = 0 counting 1) runs, with hysteresis giving the
doubt to plain (never lose): speculation is left once predicted under STAY (after MIN_EVIDENCE
rounds; LONE_MIN_EVIDENCE for the lone request), entered only when predicted MARGIN better and above 1 by more than Z standard errors
of its measured figures (the paired ratio or two period medians, the tokens per round); a try
(a new width's first, an exploration) stays after MIN_EVIDENCE rounds only if it passes that; a
batch width's first MIN_EVIDENCE speculative rounds draft K = 1 (FIRST_K1), deeper K's following.
A K not measured lately (untried, or not run for RETRY_AFTER speculative rounds) is measured for a
few rounds when its hope — its deeper draft positions credited as if they always agreed once
reached — could come within TRY_WITHIN of the best: the geometric model errs low for a head whose
later drafts agree once the first does (SmolLM2's EAGLE-3 head: K=3 was never run while it was
the best fixed K), and a few unlucky rounds must not shelve a K for good. Not at the lone request's
width since early dispatch made its K = 1 rounds cheap (LONE_TRY_WITHIN: there a deeper K runs where
the request's own estimate predicts it best).

Keeping the estimates fresh at a bounded cost: a width decided plain tries speculation again
(a width whose rounds shadow: only a K whose hope reaches MARGIN, one that could stay,
thresholds.KEEPABLE_TRIES) after `explore_after` plain rounds there (64, doubling each time the
try confirms plain, up to 1024: at most ~10 % of rounds, then ~1 %; a confirmed try starts it
over) — after EXPLORE_SOON (16) with no back-off while plain is in force only for want of
certainty (the best K predicted MARGIN above plain, within Z standard errors: width_control.py); a
width that speculates with
nothing paired runs PLAIN_WINDOW plain rounds after its first few speculative ones (unless
another width lends its paired ratio: a window costs a gate and a resume, a large share of a
short burst), and one that
has gone REFRESH_FIRST speculative rounds without a pair runs REFRESH_WINDOW plain rounds
(doubling the interval each time, up to REFRESH_MAX: under 1 % of rounds). The rounds after a
window run the K in force before it (Pairs keys its samples by K). The lone request runs its
window mid-request and re-arms after it (its drafter kept, its plain steps' hidden states handed
to it: gmlx/decode/scalar.py), or at its tail when too few tokens remain. A lone request is
decided on its predicted gain alone once its width is paired (LONE_POINT): sent plain, it keeps
its drafter and the control's exploration re-arms it, after EXPLORE_SOON plain rounds where the
gain is within its own acceptance's standard error of plain (width_control.acceptance_doubt). Plain round times are shared by every engine on the same target in the process (a plain
baseline's rounds teach the speculative engine), speculative ones per (target, drafter kind).

A batch is charged for draining (gmlx/policy/drain.py): rows whose budgets end together finish
together decoding plain and apart speculating, and the batch waits for the last; with nothing
saying a new request will take a finished row's place, the gain is the steady one times the
share of rounds that tail leaves (a burst of 8 x 32 tokens at K = 1 keeps ~90 %), weighted by the
share of finished rows the engine has seen stay unreplaced (an engine that has seen none charges
in full; a closed loop or a queue that refills the rows stops being charged).

The lone request (the scalar loop) is decided on its own acceptance: its tokens per round at k are
its own estimate's E(k) (per draft position, started from the pool's rates), so a request that
accepts little goes plain while one that accepts much keeps drafting; decoding plain, it keeps
measuring what its drafts would accept (gmlx/decode/shadow.py). So does a batch width decided
plain: its gated rounds' drafter replays their steps, K = 1 records at that width (`shadowed`,
gmlx/decode/batch_shadow.py), so a width sent plain on its answers' first rounds sees them change.
A batch width whose rounds shadow starts plain (thresholds.SHADOW_FIRST): its shadow records
measure the acceptance a first try would, and it speculates once they predict a gain.

Here: the figures shared per process and the per-engine Controller; one width's decision is
gmlx/policy/width_control.py. Pure arithmetic over host-side figures: nothing here touches the
device. The control never moves a token: it only decides how many drafts a round checks
(docs/design.md §3).
"""

from __future__ import annotations

import weakref

from gmlx.policy.costs import Costs
from gmlx.policy.choice import Choice
from gmlx.policy.drain import Tally
from gmlx.policy.figures import DECAY, LONE_DECAY, LONE_PRIOR_ROUNDS, PRIOR_WEIGHT, Acceptance, Times, bucket, owner
from gmlx.policy.thresholds import (EXPLORE_FIRST, MIN_EVIDENCE, PLAIN_WINDOW, REFRESH_FIRST, REFRESH_MAX,
                                    REFRESH_WINDOW, RETRY_AFTER, TRY_WITHIN)
from gmlx.policy import width_control
from gmlx.policy.width_control import WidthControl

# The rule's figures are named here with it (the per-width arithmetic is gmlx/policy/width_control.py,
# the thresholds with their reasons gmlx/policy/thresholds.py).
__all__ = ["EXPLORE_FIRST", "MIN_EVIDENCE", "PLAIN_WINDOW", "REFRESH_FIRST", "REFRESH_MAX", "REFRESH_WINDOW",
           "RETRY_AFTER", "TRY_WITHIN", "Acceptance", "Choice", "Controller", "WidthControl", "bucket", "forget",
           "record_plain"]

# Figures learnt in this process, shared by every engine on the same target: plain round times per
# target, speculative ones per (target, drafter kind) — a new engine starts from what earlier ones
# (a plain baseline, the previous bench cell, the last request) measured.
# The choice in force, the acceptance and the exploration's back-off are kept per (target,
# drafter kind) too: a new engine (the next bench cell, a new `Engine()` in a server process)
# continues from the process's last decision instead of starting cold; and the drain charge's
# tally of refills per target (drain.Tally), so its next engine is not charged as if new.
_plain: "weakref.WeakKeyDictionary[object, dict[int, Times]]" = weakref.WeakKeyDictionary()
_spec: "weakref.WeakKeyDictionary[object, dict[tuple, Times]]" = weakref.WeakKeyDictionary()
_widths: "weakref.WeakKeyDictionary[object, dict[tuple, WidthControl]]" = weakref.WeakKeyDictionary()
_tallies: "weakref.WeakKeyDictionary[object, Tally]" = weakref.WeakKeyDictionary()  # refills seen (drain.py)
FIGURES = (_plain, _spec, _widths, _tallies)  # everything learnt, per target


# A choice settled at a width (held MIN_EVIDENCE rounds, no try or plain window pending) is
# decided afresh every DECIDE_EVERY rounds there while the same caller asks, and reused between:
# deciding is ~0.15 ms of host arithmetic, ~5 % of the micro model's 3 ms round. A switch it would
# make comes at most DECIDE_EVERY - 1 rounds later (a window or a try is never delayed: the rounds
# counted in `observe` start them, and an unsettled width decides every round).
DECIDE_EVERY = 4


def record_plain(target: object, width: int, seconds: float) -> None:
    """A plain round's time from an engine without a drafter (a plain baseline): the same code
    path as a speculative engine's plain rounds, so its figure counts for every drafter."""
    _plain.setdefault(owner(target), {}).setdefault(bucket(width), Times()).add(0, seconds)


def tally(target: object) -> Tally:
    """The refills seen on this target in this process (drain.Tally), by every engine on it."""
    return _tallies.setdefault(owner(target), Tally())


def forget(target: object) -> None:
    """Drop everything learnt for this target in this process (tests; a changed machine)."""
    for d in FIGURES:
        d.pop(owner(target), None)


class Controller:
    """Per-width control for one engine (the figures underneath are shared, see above)."""

    def __init__(self, target: object, drafter_kind: str | None, costs: Costs):
        self.costs = costs
        target = owner(target)
        self._plain = _plain.setdefault(target, {})
        self._spec = _spec.setdefault(target, {})
        self._shared = _widths.setdefault(target, {})
        self.tally = tally(target)  # the drain charge's weight, shared likewise
        self.drafter_kind = drafter_kind
        self.widths: dict[int, WidthControl] = {}  # this engine's view of the shared per-width state
        self.switches = 0  # times a width's choice changed between plain and speculative
        self.switched: list[tuple[int, str]] = []  # (width, reason) of switches not yet reported
        self.last: dict[int, Choice] = {}
        self._repeat: tuple = (None, None, 0)  # the last decision's (bucket, max_k), acceptance, width's round

    def at(self, width: int) -> WidthControl:
        b = bucket(width)
        if b not in self.widths:
            key = (self.drafter_kind, b)
            if key not in self._shared:
                plain = self._plain.setdefault(b, Times())
                wc = self._shared[key] = WidthControl(plain, self._spec.setdefault(key, Times()), lone=b == 1)
                wc.acceptance = self._nearest_acceptance(b)
            self.widths[b] = self._shared[key]
        return self.widths[b]

    def _nearest_acceptance(self, b: int) -> Acceptance:
        """A new width starts from the acceptance this drafter showed at the nearest width that
        ran (worth the prior's weight), not the generic prior: a drafter that agrees 20 % of the
        time alone agrees about as often beside other rows."""
        seen = [(abs(w - b), wc) for (kind, w), wc in self._shared.items()
                if kind == self.drafter_kind and w != b and wc.acceptance.rounds]
        decay = LONE_DECAY if b == 1 else DECAY  # the lone request's width pools requests (figures.LONE_DECAY)
        if not seen:
            return Acceptance(decay=decay)
        alpha = min(seen, key=lambda x: x[0])[1].acceptance.alpha
        return Acceptance(alpha * PRIOR_WEIGHT, (1 - alpha) * PRIOR_WEIGHT, decay=decay)

    def choose(self, width: int, max_k: int, acceptance: Acceptance | None = None,
               remaining: tuple[int, ...] = (), drain_share: float = 1.0, shadowed: bool = False) -> Choice:
        """The k to run at this width now (at most `max_k`, the configured ceiling). Call once per
        round that runs at this width: the hysteresis and exploration count rounds. `remaining`:
        the rows' budgets left (a batch's), `drain_share`: how often a finished row's place stays
        empty (the drain charge, gmlx/policy/drain.py); `shadowed`: a plain batch of this width can
        shadow (its shadow rounds may be stopped: far_from_paying)."""
        wc = self.at(width)
        asked, (last, last_acc, at_round) = (bucket(width), max_k), self._repeat
        if last == asked and last_acc is acceptance and wc.rounds - at_round < DECIDE_EVERY and wc.settled() \
                and not (prev := self.last[asked[0]]).window and not prev.exploring:
            return prev  # a settled choice, asked again by the same caller
        self._repeat = (asked, acceptance, wc.rounds)
        before = wc.current
        # (a batch width's costs: read off the probe's forwards of its rows, costs.Costs.at_width)
        near = self._nearest_timed(bucket(width))  # (with its costs: its ratio is scaled to this width's)
        stopped, again = shadowed and self.far_from_paying(width), width_control.SHADOW_AGAIN  # (its shadows)
        choice = wc.choose(max_k, self.costs.at_width(bucket(width)), acceptance,
                           near and (*near, self.costs.at_width(near[0])), bucket(width), remaining, drain_share,
                           shadowed and (again or not stopped))
        if stopped and again and not choice.k and wc.plain_run >= wc.explore_after:
            # its exploration: shadow rounds again, not a try predicted under TRY_FIRST (thresholds.SHADOW_AGAIN)
            wc.shadows_from, wc.plain_run = wc.rounds, 0
            wc.explore_after = min(width_control.EXPLORE_MAX, 2 * wc.explore_after)
        if before is not None and (before == 0) != (wc.current == 0):  # a plain window is no switch
            self.switches += 1
            self.switched.append((width, choice.reason))
        self.last[bucket(width)] = wc.last_choice = choice
        return choice

    def _nearest_timed(self, b: int) -> tuple[int, WidthControl] | None:
        """The nearest other width where this drafter's rounds and plain rounds were timed: a width
        with nothing measured yet predicts from its ratio T(k) / T(0) rather than from the load
        probe's (one request at width 1), since a verify's cost relative to a step grows with the
        width (more of the step is arithmetic). Equally near: the wider, whose ratio errs high."""
        timed = [(w, wc) for (kind, w), wc in self._shared.items()
                 if kind == self.drafter_kind and w != b
                 and (wc.pairs.paired() or (wc.plain.median(0) is not None and wc.spec_timed()))]
        return min(timed, key=lambda x: (abs(x[0] - b), -x[0])) if timed else None

    def decided_plain(self, width: int, shadowed: bool = False) -> bool:
        """Whether the choice in force at this width is plain (a query: changes nothing); a batch
        width not decided yet counts as plain where its rounds would shadow: its first choice will
        be plain (thresholds.SHADOW_FIRST), and a batch armed for it would gate after one round."""
        wc = self._shared.get((self.drafter_kind, bucket(width)))
        current = wc.current if wc is not None else None
        return current == 0 or (current is None and width_control.starts_plain(shadowed, lone=width <= 1))

    def far_from_paying(self, width: int) -> bool:
        """Whether this width has been plain SHADOW_SPAN rounds (since its shadows last started) with
        every K predicted under SHADOW_STOP, short of a switch (a query): its shadow rounds, which had
        that long to see the drafts agree more, then cost more than they can change — with the CPU's
        small-M kernel ~7 % of a SmolLM2 float32 batch's CPU time — until its exploration (EXPLORE_FIRST,
        doubling) starts them again, or tries a K predicted at least TRY_FIRST (thresholds.SHADOW_AGAIN)."""
        wc = self._shared.get((self.drafter_kind, bucket(width)))
        c = wc.last_choice if wc is not None else None  # (shared: a new engine's batch starts without them)
        return (wc is not None and c is not None and wc.current == 0 and wc.settled()
                and min(wc.rounds_in_choice, wc.rounds - wc.shadows_from) >= width_control.SHADOW_SPAN
                and (c.best_spec is None or c.best_spec[1] < width_control.SHADOW_STOP))

    def pooled(self, width: int) -> Acceptance:
        """A copy of this width's recent acceptance: a new lone request starts from its rates,
        worth LONE_PRIOR_ROUNDS rounds, and then follows its own rounds at the usual rate (DECAY)."""
        return self.at(width).acceptance.copy(DECAY, LONE_PRIOR_ROUNDS)

    def shadowed(self, width: int, records: list[tuple[int, int]]) -> None:
        """A gated batch's shadow rounds (gmlx/decode/batch_shadow.py): the K = 1 rounds its plain
        steps would have run, one (1, accepted) record per row and step — this width's acceptance,
        and K = 1's tokens per row and round (the mean of each `width` records in turn: a round's
        worth). Neither counts a round here: nothing ran but plain rounds."""
        if not records:
            return
        wc = self.at(width)
        for drafted, accepted in records:
            wc.acceptance.record(drafted, accepted)
        for i in range(0, len(records), width):
            group = records[i:i + width]
            wc.spec.add_tokens(1, 1.0 + sum(a for _, a in group) / len(group))

    def observe(self, width: int, k: int, seconds: float | None, rows: list[tuple[int, int]],
                steady: bool = True) -> None:
        self.at(width).observe(k, seconds, rows, lambda: self._nearest_timed(bucket(width)) is not None, steady)
