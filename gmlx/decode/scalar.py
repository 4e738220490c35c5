"""The scalar lane: one request, speculating with coupled sampled drafts, or decoding plain.

Round boundary invariant (pending bonus): for a sequence x_0..x_{n-1}, the target's KV cache
holds x_0..x_{n-2}; the bonus x_{n-1} is emitted but its KV is not in the cache.

Scalar speculative round (one request, k drafts):
    d_n..d_{n+k-1}  = drafter, sampled with the target's noise G(seed, p)      (coupled)
    t_n..t_{n+k}    = sample(target([x_{n-1}, d_n..d_{n+k-1}]))                 one forward
    a, emitted      = the acceptance rule (gmlx.decode.verify)
    trim k-a target entries (the rejected drafts), keeping x_{n-1}..x_{n+a-1}
Coupling makes a sampled draft equal the target's sample whenever the two distributions agree
there (gmlx.sampling), which is why one request alone speculates here and not in the batch lane.

The lane offers start / round / evict / retire: preempt is `batch.add(*scalar.evict(), arm=False)`.
Graph builders here never sync; `round` holds the one host read of the round.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from gmlx.decode import plain
from gmlx.decode.plain import PlainDecoder
from gmlx.decode.prefill import Prefilled, prefill_row
from gmlx.decode.scalar_seq import Flight, ScalarSeq
from gmlx.decode.scalar_start import start_k
from gmlx.decode.shadow import Shadow
from gmlx.decode.verify import verified
from gmlx.drafters.base import DraftPick, Drafter
from gmlx import trace
from gmlx.row import Row, RoundResult
from gmlx.kv import RaggedKVCache
from gmlx.model_cache import lift_caches
from gmlx.models.adapter import Target
from gmlx.decode.probe import round_costs
from gmlx.policy.figures import MIN_ROUNDS_TO_STOP
from gmlx.policy.costs import Costs
from gmlx.policy import thresholds
from gmlx.processors import attach, processed, scored
from gmlx.sampling import RowSampling, sample


# A request that will draft takes its first token from a plain step (plain.FIRST_TOKEN_OUT: it leaves
# before anything else is dispatched) and drafts from the second (a re-arm), not in a first round whose
# drafts the prompt alone made: that token waited for the drafts and their verify (SmolLM2 float32 here:
# time to first token 191 -> 157 ms, plain's 155 ms). The answer as a whole gives up the first round's
# extra tokens, ~0.2 of a step on SmolLM2's code (measured: 1-2 % of a 64-token answer; docs/speculation.md).
FIRST_TOKEN_PLAIN = True


class ScalarLane:
    def __init__(self, target: Target, drafter: Drafter | None, k: int, prefill_step: int = 512,
                 coupled: bool = True, adaptive: bool = True, may_go_plain: bool = True, context: bool = False):
        self.target = target
        self.drafter = drafter  # None: plain decode
        self.k = k  # the most drafts per round
        self.adaptive = adaptive  # fewer drafts while this request's acceptance is low
        # Decode plain where no draft length pays (measured costs); False when speculation was
        # asked for explicitly (a K given by the user, the oracle tests' speculative runs).
        self.may_go_plain = may_go_plain and adaptive
        self.prefill_step = prefill_step
        self.coupled = coupled  # False only for A/B measurements of coupling itself
        self.context = context  # rounds may draft from the request's own context (drafters/context_lookup.py)
        self.seq: ScalarSeq | None = None
        self.plain: PlainDecoder | None = None
        self.flight: Flight | None = None  # the speculative round dispatched and not yet read
        self.shadow: Shadow | None = None  # a kept drafter's replays of the plain steps (gmlx/decode/shadow.py)
        self.costs: Costs | None = None  # calibrated costs (the engine sets them) or measured at first use
        # The online control (gmlx/policy/control.py; the engine sets it): K per round and plain
        # vs speculative from measured round times at width 1. None: the cost model alone decides.
        self.control = None
        self.last_k: int | None = None  # drafts asked of the round last read (0: plain), for the control
        # ... and whether it dispatched a successor of another k, or started with nothing in flight (the
        # control does not time it: docs/speculation.md, "Switching rounds are not timed")
        self.switched = False

    @property
    def row(self) -> Row | None:
        return self.seq.row if self.seq is not None else None

    @property
    def in_flight(self) -> bool:
        """A round is dispatched and not yet read (consume it before moving the request)."""
        return self.flight is not None or (self.plain is not None and self.plain.in_flight)

    def round_costs(self) -> Costs:
        """What rounds cost here: calibrated (`costs` set by the engine) or measured once."""
        if self.costs is None:
            self.costs = round_costs(self.target, self.drafter, max(self.k, 1))
        return self.costs

    def decide(self, max_k: int | None = None) -> int:
        """The most drafts a new lone request may use (0: plain): gmlx/decode/scalar_start.py."""
        return start_k(self, max_k)

    def start(self, row: Row, pre: Prefilled | None = None, max_k: int | None = None) -> None:
        """Take a prefilled request (prefilling it here when not given) and decode it with up to
        `max_k` drafts per round (see `decide`; 0: plain). The drafter is teacher-forced on the
        prompt's hidden states at its first draft."""
        max_k = self.decide() if max_k is None else max_k
        if pre is None:
            pre = prefill_row(self.target, row, self.prefill_step, want_hidden=max_k > 0 and self.drafter.needs_hidden)
        draft = self.drafter.start([row], [pre]) if max_k else None
        rs = RowSampling.from_params([row.params], [row.seed])
        self.seq = ScalarSeq(row=row, cache=pre.cache, draft=draft, rs=rs, max_k=max_k)
        if self.control is not None and max_k:
            self.seq.acceptance = self.control.pooled(1)  # starts from recent lone requests' acceptance
        if not max_k:
            self._go_plain(self.seq, self.seq.bonus, row.next_position)
        elif plain.FIRST_TOKEN_OUT and FIRST_TOKEN_PLAIN and self.drafter.rearms(draft) and row.remaining > 1:
            self._go_plain(self.seq, self.seq.bonus, row.next_position, keep=True)
            self.seq.rearm_next = True

    def _go_plain(self, seq: ScalarSeq, bonus: int, position: int, pending: list[int] = (),
                  keep: bool = False) -> None:
        """Decode this request plain from `bonus` (the next token sampled at `position`),
        double-buffered: the plain path, not a speculative round without drafts. The drafter's
        state is dropped, or (`keep`) kept for a re-arm (thresholds.REARM_MIN)."""
        if not keep:
            seq.draft, seq.max_k = None, 0
        self.shadow = Shadow(position) if keep and self.drafter.replays else None
        self.plain = PlainDecoder(self.target, seq.cache, seq.rs, bonus, position, lambda: seq.row.remaining,
                                  row=seq.row, pending=pending, keep_hidden=keep)

    def _may_rearm(self, seq: ScalarSeq, remaining: int) -> bool:
        """Whether this request, going plain (or plain already), may still re-arm (thresholds.REARM_MIN)."""
        return (self.control is not None and seq.draft is not None and self.drafter.rearms(seq.draft)
                and remaining > thresholds.REARM_MIN)

    def _rearms(self, seq: ScalarSeq) -> bool:
        """Before a plain round of a request that kept its drafter: whether the control asks for
        drafts again (the choice is then the next round's)."""
        if self.plain.keep is None:  # past plain.KEEP_MAX steps: the drafter's state goes
            seq.draft = None
        if not self._may_rearm(seq, seq.row.remaining):
            return False
        if self.shadow is not None:  # what its drafts would have accepted lately
            self.shadow.read(seq.row, seq.acceptance)
        choice = self.control.choose(1, seq.max_k, seq.acceptance)
        seq.choice = choice if choice.k > 0 else seq.choice
        if choice.k == 0 and self.context and self.drafter.context_recurs(seq.draft, seq.row.tokens):
            return True  # a round its own context drafts (drafters/context_lookup.py)
        if choice.k == 0 and self.shadow is not None and self.shadow.due(self.plain):
            self.shadow.dispatch(self.drafter, seq.draft, self.plain, seq.rs)
        return choice.k > 0

    def _rearm(self, seq: ScalarSeq, pending: list[int] = ()) -> None:
        """Hand the plain steps to the drafter as pending entries (one commit with k = 0, the drafter
        base's contract) and dispatch a speculative round from the last one's token (`pending`: the
        round's tokens not yet emitted; none: the last emitted one)."""
        self.plain.hand_to(self.drafter, seq.draft)
        position, self.plain, self.shadow = self.plain.pos, None, None
        bonus = max(pending[-1], 0) if pending else seq.bonus
        self.flight = self._dispatch(seq, bonus, position, seq.row.remaining - len(pending), pending)

    def _stops_paying(self, seq: ScalarSeq, remaining: int) -> bool:
        """Enough rounds show that no draft length pays at this request's acceptance (with the
        control: at the measured round times; the choice is also the next round's K). With the
        control asking for plain rounds to pair with speculative ones (a window), they run now
        when the request can re-arm after them (thresholds.REARM_MIN), else as its last few tokens."""
        if self.control is not None and self.may_go_plain and seq.draft is not None:
            seq.choice = self.control.choose(1, seq.max_k, seq.acceptance)
            if seq.choice.window:
                window = self.control.at(1).plain_window
                return (self._may_rearm(seq, remaining - window)
                        or remaining <= window + thresholds.WINDOW_TAIL_EXTRA)
            return (seq.acceptance.rounds >= MIN_ROUNDS_TO_STOP and seq.choice.k == 0
                    and not (self.context and self.drafter.context_recurs(seq.draft)))  # its context drafts on
        return (self.may_go_plain and seq.draft is not None and seq.acceptance.rounds >= MIN_ROUNDS_TO_STOP
                and seq.acceptance.best_k(seq.max_k, self.round_costs()) == 0)

    def round(self, last: bool = False) -> RoundResult:
        """Read the round in flight (dispatching it first if none is) and, unless `last` or the
        request cannot go on, dispatch the next one before returning: the caller's emission,
        detokenizing and delivery then run while the device computes that round."""
        trace.mark("admission")
        cold = not self.in_flight  # (after its first token: plain.FIRST_TOKEN_OUT)
        if cold and self.seq.rearm_next and self.plain is not None:  # FIRST_TOKEN_PLAIN: the drafter reads now
            self.seq.rearm_next = False
            self._rearm(self.seq)
        res = self._round(self.seq, last)
        following = self.flight.asked if self.flight is not None else 0 if self.in_flight else None
        self.switched = cold or following is not None and (  # (cold: its period holds its whole round)
            following != self.last_k or getattr(self.flight, "foreign", False))
        return res

    def _round(self, seq: ScalarSeq, last: bool) -> RoundResult:
        if self.plain is not None:
            self.last_k = 0
            first = plain.FIRST_TOKEN_OUT and not seq.row.tokens
            rearm = not last and not first and self._rearms(seq)
            res = self.plain.round(seq.bonus, successor=not last and not rearm and not first)
            # (its kept steps may have reached plain.KEEP_MAX in this very round: no re-arm then)
            if rearm and self.plain.keep and seq.row.remaining > len(res.tokens) and not seq.row.stops_at(res.tokens):
                self._rearm(seq, res.tokens)
            return res
        flight = self.flight or self._dispatch(seq, seq.bonus, seq.row.next_position, seq.row.remaining)
        self.flight = None
        res = self._collect(seq, flight)
        self.last_k = flight.asked
        remaining = seq.row.remaining - len(res.tokens)
        if not last and remaining > 0 and not seq.row.stops_at(res.tokens):
            bonus, position = max(res.tokens[-1], 0), flight.position + len(res.tokens)
            if self._stops_paying(seq, remaining):
                self._go_plain(seq, bonus, position, res.tokens, keep=self._may_rearm(seq, remaining))
            else:
                self.flight = self._dispatch(seq, bonus, position, remaining, res.tokens)
        return res

    def evict(self) -> tuple[list[Row], list[RaggedKVCache], list[Prefilled]]:
        """Hand the request to the batch lane (preempt): its round's tokens are all delivered
        (the round in flight was consumed first), so it restarts there from its bonus, unarmed."""
        assert not self.in_flight, "evict with a round in flight"
        seq = self.seq
        self.seq = self.plain = self.shadow = None
        return [seq.row], lift_caches([seq.cache]), [Prefilled.nothing()]

    def retire(self) -> tuple[Row, list]:
        """The finished request and its cache (for the prompt cache); the lane is empty after. A round
        still in flight (a stop string, stop_fn or cancel) is dropped: its drafts leave the cache."""
        seq, flight = self.seq, self.flight
        if flight is not None and flight.k:
            for c in seq.cache:
                c.trim(flight.k)
        self.clear()
        return seq.row, seq.cache

    def clear(self) -> None:
        self.seq = self.plain = self.flight = self.shadow = None

    def round_k(self, seq: ScalarSeq, remaining: int) -> int:
        """Drafts this round: the best k >= 1 for its acceptance so far (adaptive), within its budget."""
        if seq.draft is None:
            return 0
        if self.control is not None and self.adaptive:
            if seq.choice is None:  # the request's first round
                seq.choice = self.control.choose(1, seq.max_k, seq.acceptance)
            # A plain window's rounds run at the request's tail, plain (`_stops_paying`): until then
            # the K in force (a one-token verify is no plain step: it is not pipelined).
            k = max(1, seq.choice.best_spec[0] if seq.choice.window else seq.choice.k)
        else:
            k = max(1, seq.acceptance.best_k(seq.max_k, self.round_costs())) if self.adaptive else seq.max_k
        return max(0, min(k, remaining - 1))

    def _dispatch(self, seq: ScalarSeq, bonus: int, n: int, remaining: int, pending: list[int] = ()) -> Flight:
        """Build the drafts and the verify forward from the bonus at position n, and start them."""
        k = asked = self.round_k(seq, remaining)
        inputs = mx.array([[bonus]], dtype=mx.int32)
        drafts, lengths = None, None
        if k:
            pick = DraftPick(seq.rs if self.coupled else None, np.array([n]), context=seq.max_k if self.context else 0)
            drafts = self.drafter.draft(seq.draft, k, pick, seq.cache)  # [1, k]
            lengths = self.drafter.draft_lengths(seq.draft)  # host: fewer than k (more: from the context)
            if lengths is not None:
                k = int(lengths[0])
                drafts = drafts[:, :k]
            mx.async_eval(drafts)  # the draft chain starts computing while the verify graph is built
            inputs = mx.concatenate([inputs, drafts], axis=1)
        logits, hidden = self.target(inputs, seq.cache)  # [1, k+1, V], [1, k+1, D]
        # processors (if any) see the committed tokens, the round's not yet emitted ones and drafts[:j]
        logits = processed(logits, seq.rs, [seq.row], [n], drafts, pending=[pending])
        targets = sample(logits, seq.rs, np.array([n]))  # [1, k+1]
        lps = scored(logits, targets, seq.rs)  # None unless the request asked for logprobs
        read = mx.concatenate([drafts, targets], axis=1) if drafts is not None else targets
        trace.mark("build")
        mx.async_eval(read) if lps is None else mx.async_eval(read, lps)
        trace.mark("dispatch")
        return Flight(k=k, position=n, read=read, hidden=hidden, targets=targets, lps=lps, asked=asked,
                      foreign=bool(k) and self.drafter.foreign(seq.draft))

    def _collect(self, seq: ScalarSeq, fl: Flight) -> RoundResult:
        """The round's one host read, the acceptance rule, and the rollback of what it rejected."""
        k = fl.k
        read = np.array(fl.read)  # sync: the round's one host read of drafts and target tokens
        trace.mark("wait")
        accepted, (res,) = verified(read[:, :k], read[:, k:])
        attach([res], fl.lps, seq.rs)
        res.foreign = fl.foreign
        if not fl.foreign:  # the request's acceptance is its drafter's
            seq.acceptance.record(k, res.accepted)
        trace.mark("readback")
        if k > res.accepted:
            for c in seq.cache:
                c.trim(k - res.accepted)
        if seq.draft is not None:
            self.drafter.commit(seq.draft, k, accepted, fl.hidden, mx.maximum(fl.targets, 0))  # never embed FAULT
        trace.mark("commit")
        return res

