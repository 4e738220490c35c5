"""The decode loops, one round each: the scalar speculative loop and plain decode.

Round boundary invariant (pending bonus): for a sequence x_0..x_{n-1}, the target's KV cache
holds x_0..x_{n-2}; the bonus x_{n-1} is emitted but its KV is not in the cache.

Scalar speculative round (one request, k drafts):
    d_n..d_{n+k-1}  = drafter, sampled with the target's noise G(seed, p)      (coupled)
    t_n..t_{n+k}    = sample(target([x_{n-1}, d_n..d_{n+k-1}]))                 one forward
    a               = max{i : d_{n+j} == t_{n+j} for all j < i}                 accept iff equal
    emit t_n..t_{n+a}       (a accepted drafts, then the bonus t_{n+a})
    trim k-a target entries (the rejected drafts), keeping x_{n-1}..x_{n+a-1}
Every emitted token is the target's own position-keyed sample, so the stream is exactly the
plain stream. One host sync per round: drafts and targets are read together.

Graph builders here never sync; `ScalarLoop.round` holds the one sync of the round.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from gmlx.models.adapter import Target
from gmlx.engine.row import Row
from gmlx.sampling import RowSampling, sample
from gmlx.policy.adaptive import AcceptanceEstimate
from gmlx.drafters.base import DraftPick, Drafter


@dataclass(slots=True)
class RoundResult:
    tokens: list[int]  # candidates to emit, in order
    drafted: int
    accepted: int


def accept_length(drafts: list[int], targets: list[int]) -> int:
    """Number of leading drafts equal to the target's tokens at the same positions."""
    a = 0
    for d, t in zip(drafts, targets):
        if d != t:
            break
        a += 1
    return a


def positions(start: int, n: int) -> mx.array:
    return mx.array(np.arange(start, start + n, dtype=np.int32)[None])  # [1, n]


def prefill(target: Target, cache: list, bodies: list[list[int]], step: int, want_hidden: bool) -> mx.array | None:
    """Run each row's tokens through the target in chunks, right-padded to the longest row (the
    padded positions lie after a row's real ones; the caller trims them per row). Returns the
    hidden states [B, L, D] when asked."""
    longest = max((len(b) for b in bodies), default=0)
    hiddens = []
    for i in range(0, longest, step):
        n = min(step, longest - i)
        chunk = mx.array([(b[i : i + n] + [0] * n)[:n] for b in bodies], dtype=mx.int32)  # [B, n]
        if want_hidden:
            _, h = target(chunk, cache)
            hiddens.append(h)
            mx.eval(h, [c.state for c in cache])  # sync: bound the graph per prefill chunk
        else:
            target.backbone(chunk, cache=cache)
            mx.eval([c.state for c in cache])  # sync: bound the graph per prefill chunk
    if not want_hidden or not hiddens:
        return None
    return hiddens[0] if len(hiddens) == 1 else mx.concatenate(hiddens, axis=1)


@dataclass(slots=True)
class Prefilled:
    """A request ready to decode: its single-sequence target cache holds x_0..x_{m-2} (the last
    prompt token is the pending bonus); `hidden` / `next_tokens` are the (h_i, x_{i+1}) entries a
    drafter is teacher-forced on (positions `start`..m-2), None when no drafter needs them."""

    cache: list
    hidden: mx.array | None  # [1, P, D]
    next_tokens: mx.array | None  # [1, P]


def prefill_row(target: Target, row: Row, step: int, want_hidden: bool, cache: list | None = None,
                start: int = 0) -> Prefilled:
    """Run prompt[start:-1] into `cache` (fresh when None; `start` tokens already cached)."""
    cache = cache if cache is not None else target.make_cache()
    body = row.prompt[start:-1]
    row.stats.prefill_tokens = len(body)
    hidden = prefill(target, cache, [body], step, want_hidden)
    nxt = mx.array([row.prompt[start + 1 :]], dtype=mx.int32) if hidden is not None else None
    return Prefilled(cache, hidden, nxt)


@dataclass(slots=True)
class ScalarSeq:
    """The scalar loop's state for its one request."""

    row: Row
    cache: list  # target KV, one mlx-lm KVCache per layer
    draft: object | None  # the drafter's state for this one row
    rs: RowSampling
    acceptance: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)

    @property
    def bonus(self) -> int:
        return self.row.tokens[-1] if self.row.tokens else self.row.prompt[-1]


class ScalarLoop:
    """One request, speculating with coupled sampled drafts (or plain when k == 0)."""

    def __init__(self, target: Target, drafter: Drafter | None, k: int, prefill_step: int = 512,
                 coupled: bool = True, adaptive: bool = True):
        self.target = target
        self.drafter = drafter
        self.k = k  # the most drafts per round
        self.adaptive = adaptive  # fewer drafts while this request's acceptance is low
        self.prefill_step = prefill_step
        self.coupled = coupled  # False only for A/B measurements of coupling itself

    def start(self, row: Row, rs: RowSampling, pre: Prefilled | None = None) -> ScalarSeq:
        """Take a prefilled request (prefilling it here when not given); queue the head's
        teacher forcing on the prompt's hidden states."""
        if pre is None:
            pre = prefill_row(self.target, row, self.prefill_step, want_hidden=self.drafter is not None)
        draft = self.drafter.start([row], [pre]) if self.drafter is not None else None
        return ScalarSeq(row=row, cache=pre.cache, draft=draft, rs=rs)

    def round_k(self, seq: ScalarSeq) -> int:
        """Drafts this round: the best k for the request's acceptance so far (when adaptive),
        never more than the budget can use."""
        if self.drafter is None or seq.draft is None:
            return 0
        k = seq.acceptance.best_k(self.k, self.drafter.step_cost) if self.adaptive else self.k
        return max(0, min(k, seq.row.remaining - 1))

    def round(self, seq: ScalarSeq) -> RoundResult:
        k = self.round_k(seq)
        n = seq.row.next_position
        drafts = None
        if k:
            pick = DraftPick(seq.rs if self.coupled else None, np.array([n]))
            drafts = self.drafter.draft(seq.draft, k, pick, seq.cache)  # [1, k]
            # Evaluating the draft chain apart from the verify forward measured 11.8 vs 17 ms per
            # round on the CPU backend (8-layer target, k=3); the host still reads once per round.
            mx.eval(drafts)  # sync: device-only barrier between the draft and verify graphs
            inputs = mx.concatenate([mx.array([[seq.bonus]], dtype=mx.int32), drafts], axis=1)
        else:
            inputs = mx.array([[seq.bonus]], dtype=mx.int32)
        logits, hidden = self.target(inputs, seq.cache)  # [1, k+1, V], [1, k+1, D]
        targets = sample(logits, seq.rs, positions(n, k + 1))  # [1, k+1]
        mx.eval(targets)  # sync: the round's one host read of drafts and target tokens
        d = drafts.tolist()[0] if drafts is not None else []  # sync: already evaluated above
        t = targets.tolist()[0]  # sync: already evaluated above
        a = accept_length(d, t)
        seq.acceptance.record(k, a)
        out = t[: a + 1]
        if k > a:
            for c in seq.cache:
                c.trim(k - a)
        if seq.draft is not None:
            self.drafter.commit(seq.draft, k, np.array([a]), hidden, mx.maximum(targets, 0))  # never embed FAULT
        return RoundResult(tokens=out, drafted=k, accepted=a)


class PlainDecoder:
    """Plain decode of one request, double-buffered like mlx-lm's generate_step: step p+1's
    forward is dispatched before step p's token is read. The reference path for the oracle."""

    def __init__(self, target: Target, seq: ScalarSeq):
        self.target = target
        self.seq = seq
        self.pos = seq.row.next_position
        self.next = self._step(mx.array([[seq.bonus]], dtype=mx.int32), self.pos)
        mx.async_eval(self.next)

    def _step(self, y: mx.array, pos: int) -> mx.array:
        logits = self.target.logits(y, self.seq.cache)[:, -1:]  # [1, 1, V]
        return sample(logits, self.seq.rs, positions(pos, 1))  # [1, 1]

    @property
    def in_flight(self) -> bool:
        return self.next is not None

    def round(self, successor: bool = True) -> RoundResult:
        cur = self.next if self.next is not None else self._step(mx.array([[self.seq.bonus]], dtype=mx.int32), self.pos)
        self.next = None
        if successor and self.seq.row.remaining > 1:
            self.next = self._step(mx.maximum(cur, 0), self.pos + 1)  # a FAULT ends the row; feed a real id
            mx.async_eval(self.next)
        tok = cur.item()  # sync: read this step's token while the next one computes
        self.pos += 1
        return RoundResult(tokens=[tok], drafted=0, accepted=0)
