"""The speculation in force: the configured ceilings (cap, K per width) and the online control's
choice within them, applied by the engine; said out loud for generate, bench, serve and doctor.

Precedence: `--no-speculative` (no drafter) > an explicit K (`--num-draft-tokens`: obeyed every
round, no control) > GMLX_CONTROL=0 (the cap and K per width alone, as configured) > the online
control (gmlx/policy/control.py), which may run fewer drafts than the ceiling, or none, at any
width within the cap. The cap (CLI, GMLX_MTP_WIDTH_CAP, user config, model default) stays a
ceiling: the control never speculates over it.
"""

from __future__ import annotations

from gmlx.decode import batch_shadow
from gmlx.policy.admission import Round
from gmlx.policy.control import Choice, Controller, bucket, record_plain, tally
from gmlx.policy.costs import Costs
from gmlx.policy.drain import Refills

# Rounds whose wall time is a steady-state round of their kind (a capture round, or a plain round
# that consumes its lookahead without dispatching the next, is not).
_TIMED = frozenset({Round.SPECULATIVE, Round.PLAIN, Round.SCALAR})


class Speculation:
    def __init__(self, target, drafter, caps, explicit_k: int | None, costs: Costs | None, control: bool):
        self.drafter = drafter
        self.target = target
        self.caps = caps  # gmlx.engine.cap_watch.CapWatch: the ceilings
        self.explicit_k = explicit_k
        on = control and drafter is not None and explicit_k is None and costs is not None
        self.control = Controller(target, drafter.kind, costs) if on else None
        self.choice: Choice | None = None  # this step's choice at the batch's width
        self._chosen_at = 0  # the width (bucket) it was made for
        self._pending: tuple | None = None  # (width, k, start) of the last round, until the next starts
        self._asked = 0  # the K the last speculative batch round was asked for
        # whether finished rows' places are taken (the drain charge's weight, admission's hold),
        # counted per target, by every engine (a plain one's holds too: gmlx/policy/admission.py)
        self.refills = Refills(tally(target))

    def ceiling(self, width: int) -> int:
        """The most drafts per round at this width (explicit K, else calibrated, else default)."""
        return self.caps.k_for(width)

    def plain_widths(self, batch_width: int, rows: list, queued: int) -> frozenset[int]:
        """Widths the control has decided plain, among those admission may ask about this step
        (the batch's, the widths an admission would reach). For the batch's own width the choice
        is made now (once per step, on the live `rows`' budgets left); the others are only read.
        Every engine counts the step's finishes and admissions here (`refills`)."""
        self.refills.step(frozenset(r.rid for r in rows))
        if self.control is None:
            return frozenset()
        self.choice = None
        if batch_width >= 1:
            self._choose(batch_width, rows)
        live = len(rows)
        asked = {live, live + queued, 1 + queued, queued} - {0}
        return frozenset(w for w in asked | ({batch_width} - {0})
                         if (w == batch_width and self.choice.k == 0)
                         or (w != batch_width and self.control.decided_plain(w, self.can_shadow(w, rows))))

    def _choose(self, width: int, rows: list) -> None:
        self.choice = self.control.choose(width, self.ceiling(width), remaining=tuple(r.remaining for r in rows),
                                          drain_share=self.refills.drain_share, shadowed=self.can_shadow(width, rows))
        self._chosen_at = bucket(width)

    @property
    def plain_why(self) -> str:
        """Why the batch's width decodes plain now (the control's reason), for the plan's reason."""
        return self.choice.reason if self.choice is not None and self.choice.k == 0 else "plain pays better"

    def batch_k(self, width: int, rows: list) -> int:
        """Drafts this speculative batch round (the plan said speculate: at least one). A round at a
        width the step's choice was not made for — a batch just formed (the plan saw no batch) or
        widened by an admission — is chosen for now, at its width: it ran the ceiling K before
        (a new SmolLM2 batch's first round drafted K = 3 where the control's first tries run K = 1)."""
        if self.control is not None and (self.choice is None or self._chosen_at != bucket(width)):
            self._choose(width, rows)
        # (a choice of plain made for the new width: its one round drafts the fewest, K = 1)
        k = max(1, self.choice.k) if self.choice is not None else max(1, self.ceiling(width))
        self._asked = k
        return k

    def observe(self, kind: Round, width: int, t0: float, results: list, scalar_k: int | None,
                steady: bool = True, scalar_switched: bool = False) -> None:
        """Feed a round that started at t0 to the control: its acceptance and tokens now; its time
        when the next round starts (`round_starts`), as the period between the two starts, so the
        figure holds all the engine's work per round (emission, retirement, admission's planning,
        the caller's loop), not the forward alone. A round right after a transition or an
        admission (`steady` False) is not timed: it holds their one-off work (a new request's
        drafter reads its whole prompt at its first draft: 2-3x a steady round on SmolLM2), nor a
        scalar round that dispatched a successor of another k (`scalar_switched`: ScalarLane.switched)."""
        self._pending = None
        if kind is Round.NONE or width < 1:
            return
        # The round counts under the K it was asked for, not the drafts it got: a drafter that
        # finds fewer (prompt lookup with no match) makes choosing K buy less, and that is what the
        # control must measure (its time and tokens per round); keyed by the drafts got, a K=3
        # choice whose rows drafted one token each was credited K=3's modelled 4 tokens a round.
        drafted = max((r.drafted for r in results), default=0)
        timed = kind in _TIMED and steady
        if kind is Round.SCALAR or kind is Round.SCALAR_LAST:
            k, timed = scalar_k or 0, timed and not scalar_switched
        else:
            k = self._asked if kind is Round.SPECULATIVE else 0
        if self.control is None:  # a plain engine's rounds still teach the others on this target
            if self.drafter is None and kind in _TIMED and steady:
                self._pending = (width, 0, t0)
            return
        if drafted > self.ceiling(width) or any(r.foreign for r in results):
            # a predicted output drafted past the model's K (up to 16 a round), or the request's own
            # context drafted: neither its time nor its acceptance says what the model's drafter buys
            return
        self.control.observe(width, k, None, [(r.drafted, r.accepted) for r in results], steady and kind in _TIMED)
        if timed:
            self._pending = (width, k, t0)

    def shadowed(self, width: int, records: list[tuple[int, int]]) -> None:
        """A gated batch's shadow records (gmlx/decode/batch_shadow.py) for the control."""
        if self.control is not None:
            self.control.shadowed(width, records)

    def can_shadow(self, width: int, rows: list) -> bool:
        """Whether a gated batch of this width with these rows can shadow (gmlx/decode/batch_shadow.py):
        the control is on, the drafter replays a batch, the cap lets the width speculate (a gate
        over the cap has nothing to measure for), and no row has a prediction (its drafts are the
        prediction's, and plain steps advance no alignment)."""
        return (self.control is not None and batch_shadow.SHADOWS and self.drafter.batch_replays
                and self.caps.current.allows(width) and not any(r.params.prediction for r in rows))

    def shadows(self, width: int, rows: list) -> bool:
        """Whether such a batch shadows now: it can, and the width is not far from paying (its shadows
        stopped until its exploration starts them again: control.Controller.far_from_paying)."""
        return self.can_shadow(width, rows) and not self.control.far_from_paying(width)

    def round_starts(self, t: float, width: int, steady: bool) -> None:
        """A round of `width` rows starts at t: the previous round's period ends here, and counts
        when nothing but rounds ran in between (no transition, admission or change of width)."""
        pending, self._pending = self._pending, None
        if pending is not None and steady and pending[0] == width:
            self.record_time(pending[0], pending[1], t - pending[2])

    def record_time(self, width: int, k: int, seconds: float) -> None:
        if self.control is not None:
            self.control.at(width).add_time(k, seconds)
        else:
            record_plain(self.target, width, seconds)

    def summary(self, widths=(1, 2, 4, 8)) -> str:
        """The setting in one line, before anything runs (serve's start line, doctor)."""
        if self.drafter is None:
            return "plain decode (no drafter)"
        cap = self.caps.current
        ks = ", ".join(f"{w}: {self.ceiling(w) if cap.allows(w) or w == 1 else 'plain'}" for w in widths)
        how = ("explicit K, always speculates" if self.explicit_k is not None else
               "online control on: K and plain vs speculative chosen per width from measured rounds"
               if self.control is not None else "online control off (GMLX_CONTROL=0)")
        return f"speculative ({self.drafter.kind}), cap {cap}, K ceiling by width {{{ks}}}; {how}"

    def switched(self) -> list[tuple[int, str]]:
        """The control's plain <-> speculative switches since the last call: (width, reason)."""
        if self.control is None or not self.control.switched:
            return []
        out, self.control.switched = self.control.switched, []
        return out

    def describe(self, width: int, lone: bool = False) -> str:
        """What runs at this width and why, in one line (`lone`: the scalar loop's request, which
        the cap does not govern)."""
        if self.drafter is None:
            return "plain: no drafter"
        if self.explicit_k is not None:
            return f"K={self.explicit_k} ({self.drafter.kind}): explicit --num-draft-tokens, always speculates"
        cap = self.caps.current
        if not lone and not cap.allows(width):
            return f"plain: width {width} over the cap {cap}"
        if self.control is None:
            return f"K<={self.ceiling(width)} ({self.drafter.kind}): cap {cap}; online control off (GMLX_CONTROL=0)"
        last = self.control.last.get(bucket(width))
        if last is None:
            return f"K<={self.ceiling(width)} ({self.drafter.kind}): nothing measured at width {width} yet"
        return f"{last.reason} ({self.drafter.kind}, K<={self.ceiling(width)}, cap {cap})"

