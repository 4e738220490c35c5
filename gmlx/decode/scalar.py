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

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from gmlx.decode.plain import PlainDecoder
from gmlx.decode.prefill import Prefilled, prefill_row
from gmlx.decode.verify import RoundResult, verified
from gmlx.drafters.base import DraftPick, Drafter
from gmlx.engine import trace
from gmlx.engine.row import Row
from gmlx.kv import RaggedKVCache, lift_caches
from gmlx.models.adapter import Target
from gmlx.policy.adaptive import AcceptanceEstimate
from gmlx.sampling import RowSampling, sample


@dataclass(slots=True)
class ScalarSeq:
    """The scalar lane's state for its one request."""

    row: Row
    cache: list  # target KV, one mlx-lm KVCache per layer
    draft: object | None  # the drafter's state for this one row
    rs: RowSampling
    acceptance: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)

    @property
    def bonus(self) -> int:
        return self.row.tokens[-1] if self.row.tokens else self.row.prompt[-1]


class ScalarLane:
    def __init__(self, target: Target, drafter: Drafter | None, k: int, prefill_step: int = 512,
                 coupled: bool = True, adaptive: bool = True):
        self.target = target
        self.drafter = drafter  # None: plain decode
        self.k = k  # the most drafts per round
        self.adaptive = adaptive  # fewer drafts while this request's acceptance is low
        self.prefill_step = prefill_step
        self.coupled = coupled  # False only for A/B measurements of coupling itself
        self.seq: ScalarSeq | None = None
        self.plain: PlainDecoder | None = None
        self.flight: Flight | None = None  # the speculative round dispatched and not yet read

    @property
    def row(self) -> Row | None:
        return self.seq.row if self.seq is not None else None

    @property
    def in_flight(self) -> bool:
        """A round is dispatched and not yet read (consume it before moving the request)."""
        return self.flight is not None or (self.plain is not None and self.plain.in_flight)

    def start(self, row: Row, pre: Prefilled | None = None) -> None:
        """Take a prefilled request (prefilling it here when not given); the drafter is
        teacher-forced on the prompt's hidden states at its first draft."""
        if pre is None:
            pre = prefill_row(self.target, row, self.prefill_step, want_hidden=self.drafter is not None)
        draft = self.drafter.start([row], [pre]) if self.drafter is not None else None
        rs = RowSampling.from_params([row.params], [row.seed])
        self.seq = ScalarSeq(row=row, cache=pre.cache, draft=draft, rs=rs)
        if self.drafter is None:
            self.plain = PlainDecoder(self.target, pre.cache, rs, self.seq.bonus, row.next_position,
                                      lambda: row.remaining)

    def round(self, last: bool = False) -> RoundResult:
        """Read the round in flight (dispatching it first if none is) and, unless `last` or the
        request cannot go on, dispatch the next one before returning: the caller's emission,
        detokenizing and delivery then run while the device computes that round."""
        trace.mark("admission")
        if self.plain is not None:
            return self.plain.round(self.seq.bonus, successor=not last)
        seq = self.seq
        flight = self.flight or self._dispatch(seq, seq.bonus, seq.row.next_position, seq.row.remaining)
        self.flight = None
        res = self._collect(seq, flight)
        remaining = seq.row.remaining - len(res.tokens)
        if not last and remaining > 0 and not seq.row.stops_at(res.tokens):
            self.flight = self._dispatch(seq, max(res.tokens[-1], 0), flight.position + len(res.tokens), remaining)
        return res

    def evict(self) -> tuple[list[Row], list[RaggedKVCache], list[Prefilled]]:
        """Hand the request to the batch lane (preempt): its round's tokens are all delivered
        (the round in flight was consumed first), so it restarts there from its bonus, unarmed."""
        assert not self.in_flight, "evict with a round in flight"
        seq = self.seq
        self.seq = self.plain = None
        return [seq.row], lift_caches([seq.cache]), [Prefilled.nothing()]

    def retire(self) -> tuple[Row, list]:
        """The finished request and its cache (for the prompt cache); the lane is empty after. A
        round still in flight (the request stopped at a stop string, its stop_fn or a cancel) is
        dropped: its unverified drafts leave the cache; the bonus's entry is the request's own."""
        seq, flight = self.seq, self.flight
        if flight is not None and flight.k:
            for c in seq.cache:
                c.trim(flight.k)
        self.clear()
        return seq.row, seq.cache

    def clear(self) -> None:
        self.seq = self.plain = self.flight = None

    def round_k(self, seq: ScalarSeq, remaining: int) -> int:
        """Drafts this round: the best k for the request's acceptance so far (when adaptive),
        never more than the budget can use."""
        if self.drafter is None or seq.draft is None:
            return 0
        k = seq.acceptance.best_k(self.k, self.drafter.step_cost) if self.adaptive else self.k
        return max(0, min(k, remaining - 1))

    def _dispatch(self, seq: ScalarSeq, bonus: int, n: int, remaining: int) -> Flight:
        """Build the drafts and the verify forward from the bonus at position n, and start them."""
        k = self.round_k(seq, remaining)
        inputs = mx.array([[bonus]], dtype=mx.int32)
        drafts, lengths = None, None
        if k:
            pick = DraftPick(seq.rs if self.coupled else None, np.array([n]))
            drafts = self.drafter.draft(seq.draft, k, pick, seq.cache)  # [1, k]
            lengths = self.drafter.draft_lengths(seq.draft)  # host: fewer than k when it found less
            if lengths is not None:
                k = int(lengths[0])
                drafts = drafts[:, :k]
            # The draft chain starts computing while the verify graph is built.
            mx.async_eval(drafts)
            inputs = mx.concatenate([inputs, drafts], axis=1)
        logits, hidden = self.target(inputs, seq.cache)  # [1, k+1, V], [1, k+1, D]
        targets = sample(logits, seq.rs, np.array([n]))  # [1, k+1]
        read = mx.concatenate([drafts, targets], axis=1) if drafts is not None else targets
        trace.mark("build")
        mx.async_eval(read)
        trace.mark("dispatch")
        return Flight(k=k, position=n, read=read, hidden=hidden, targets=targets)

    def _collect(self, seq: ScalarSeq, fl: Flight) -> RoundResult:
        """The round's one host read, the acceptance rule, and the rollback of what it rejected."""
        k = fl.k
        read = np.array(fl.read)  # sync: the round's one host read of drafts and target tokens
        trace.mark("wait")
        accepted, (res,) = verified(read[:, :k], read[:, k:])
        seq.acceptance.record(k, res.accepted)
        trace.mark("readback")
        if k > res.accepted:
            for c in seq.cache:
                c.trim(k - res.accepted)
        if seq.draft is not None:
            self.drafter.commit(seq.draft, k, accepted, fl.hidden, mx.maximum(fl.targets, 0))  # never embed FAULT
        trace.mark("commit")
        return res


@dataclass(slots=True)
class Flight:
    """A dispatched round not yet read: k drafts from position `position` and their verify."""

    k: int
    position: int
    read: mx.array  # [1, k + (k+1)]: the drafts, then the target's tokens
    hidden: mx.array  # [1, k+1, D]
    targets: mx.array  # [1, k+1]
