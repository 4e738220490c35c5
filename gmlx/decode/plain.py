"""Plain decode of one request, double-buffered like mlx-lm's generate_step: step p+1's forward
is dispatched before step p's token is read. The reference path for the oracle tests.

A lone request the control sent plain may keep its drafter (`keep_hidden`): its steps then run
the target's hidden-capturing forward (the one speculative rounds run) and keep each emitted
step's hidden state and token, the drafter's pending entries if the request re-arms (`kept`)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from gmlx.row import RoundResult
from gmlx import trace
from gmlx.models.adapter import Target
from gmlx.processors import attach, processed, scored
from gmlx.sampling import RowSampling, sample


# A request's first token leaves the engine before a successor is dispatched (here and in the batch's
# plain rounds): a forward's dispatch waits for the device as it is built (gmlx/models/early_dispatch.py),
# so a first token read after its successor's dispatch waited for most of that step (SmolLM2 float32
# here: time to first token 174 -> 155 ms; benchmarks/bench_first_token.py). The round after starts with
# nothing in flight: its period holds its own whole step, and it is not timed (the engine's `_round`).
FIRST_TOKEN_OUT = True

# The most plain steps whose hidden states are kept for a re-arm (a SmolLM2 EAGLE-3 head's are
# 7 KB a step): past it the request decodes plain to its end, as the control's back-off would
# rarely try it again by then (EXPLORE_SOON 16, EXPLORE_FIRST 64 plain rounds).
KEEP_MAX = 512


class PlainDecoder:
    def __init__(self, target: Target, cache: list, rs: RowSampling, bonus: int, position: int, remaining,
                 row=None, pending: list[int] = (), keep_hidden: bool = False):
        """`remaining()`: the request's budget left, read before dispatching a successor. `row`
        and `pending` (its tokens not yet emitted, ending with `bonus`): what logits processors
        see (gmlx.processors; needed only when the request has some). `keep_hidden`: see above."""
        self.target = target
        self.row = row
        self.cache = cache
        self.rs = rs
        self.pos = position
        self.remaining = remaining
        self.keep: list | None = [] if keep_hidden else None  # (hidden [1, 1, D], token [1, 1]) per step emitted
        self.steps_kept = 0  # steps kept in all (those handed over by `kept` leave `keep`)
        self.next, self.next_lps, self.next_hidden = self._step(mx.array([[bonus]], dtype=mx.int32), self.pos,
                                                                pending=pending)
        _dispatch(self.next, self.next_lps, self.next_hidden)

    def _step(self, y: mx.array, pos: int, lookahead: bool = False, pending: list[int] = ()):
        """The token at `pos` after `y` (and its logprobs, None unless asked); `lookahead`: y is
        the previous step's token, still on the device (processors see it there). And its hidden
        state when kept (else None)."""
        hidden = None
        if self.keep is None:
            logits = self.target.logits(y, self.cache)[:, -1:]  # [1, 1, V]
        else:
            logits, hidden = self.target(y, self.cache)  # [1, 1, V], [1, 1, D]
        logits = processed(logits, self.rs, [self.row], [pos], y if lookahead else None, int(lookahead), [pending])
        tok = sample(logits, self.rs, np.array([pos]))  # [1, 1]
        return tok, scored(logits, tok, self.rs), hidden

    @property
    def in_flight(self) -> bool:
        return self.next is not None

    def round(self, bonus: int, successor: bool = True) -> RoundResult:
        if self.next is not None:
            cur, cur_lps, cur_hidden = self.next, self.next_lps, self.next_hidden
        else:
            cur, cur_lps, cur_hidden = self._step(mx.array([[bonus]], dtype=mx.int32), self.pos)
        self.next = self.next_lps = self.next_hidden = None
        if successor and self.remaining() > 1:
            # a FAULT ends the row; feed a real id
            self.next, self.next_lps, self.next_hidden = self._step(mx.maximum(cur, 0), self.pos + 1, lookahead=True)
            trace.mark("build")
            _dispatch(self.next, self.next_lps, self.next_hidden)
            trace.mark("dispatch")
        tok = cur.item()  # sync: read this step's token while the next one computes
        trace.mark("wait")
        self.pos += 1
        if self.keep is not None:
            self.keep.append((cur_hidden, mx.maximum(cur, 0)))  # a FAULT ends the row: never embedded
            self.steps_kept += 1
            if self.steps_kept >= KEEP_MAX:  # bounded memory: no re-arm after this many plain steps
                self.keep = None
        res = RoundResult(tokens=[tok], drafted=0, accepted=0)
        attach([res], cur_lps, self.rs)
        return res

    def hand_to(self, drafter, state) -> None:
        """The kept steps not yet handed over become the drafter's pending entries: one commit with
        k = 0 of several (the drafter base's contract), as a re-arm and a shadow round make it."""
        hidden, tokens = self.kept()
        drafter.commit(state, 0, np.array([tokens.shape[1] - 1]), hidden, tokens)

    def kept(self) -> tuple[mx.array, mx.array]:
        """The emitted steps' hidden states [1, n, D] and tokens [1, n] (n >= 1), in order: step i
        read token x_i and sampled x_{i+1}, as a verify's position does (gmlx/drafters/base.py).
        Handed over: the next call returns the steps emitted after this one (KEEP_MAX counts all)."""
        hidden, tokens = zip(*self.keep)
        self.keep = []
        return mx.concatenate(hidden, axis=1), mx.concatenate(tokens, axis=1)


def _dispatch(tok: mx.array, lps: mx.array | None, hidden: mx.array | None) -> None:
    mx.async_eval(tok, *(x for x in (lps, hidden) if x is not None))
