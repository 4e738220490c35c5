"""Plain decode of one request, double-buffered like mlx-lm's generate_step: step p+1's forward
is dispatched before step p's token is read. The reference path for the oracle tests."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from gmlx.row import RoundResult
from gmlx import trace
from gmlx.models.adapter import Target
from gmlx.processors import attach, processed, scored
from gmlx.sampling import RowSampling, sample


class PlainDecoder:
    def __init__(self, target: Target, cache: list, rs: RowSampling, bonus: int, position: int, remaining,
                 row=None, pending: list[int] = ()):
        """`remaining()`: the request's budget left, read before dispatching a successor. `row`
        and `pending` (its tokens not yet emitted, ending with `bonus`): what logits processors
        see (gmlx.processors; needed only when the request has some)."""
        self.target = target
        self.row = row
        self.cache = cache
        self.rs = rs
        self.pos = position
        self.remaining = remaining
        self.next, self.next_lps = self._step(mx.array([[bonus]], dtype=mx.int32), self.pos, pending=pending)
        _dispatch(self.next, self.next_lps)

    def _step(self, y: mx.array, pos: int, lookahead: bool = False, pending: list[int] = ()):
        """The token at `pos` after `y` (and its logprobs, None unless asked); `lookahead`: y is
        the previous step's token, still on the device (processors see it there)."""
        logits = self.target.logits(y, self.cache)[:, -1:]  # [1, 1, V]
        logits = processed(logits, self.rs, [self.row], [pos], y if lookahead else None, int(lookahead), [pending])
        tok = sample(logits, self.rs, np.array([pos]))  # [1, 1]
        return tok, scored(logits, tok, self.rs)

    @property
    def in_flight(self) -> bool:
        return self.next is not None

    def round(self, bonus: int, successor: bool = True) -> RoundResult:
        if self.next is not None:
            cur, cur_lps = self.next, self.next_lps
        else:
            cur, cur_lps = self._step(mx.array([[bonus]], dtype=mx.int32), self.pos)
        self.next = self.next_lps = None
        if successor and self.remaining() > 1:
            # a FAULT ends the row; feed a real id
            self.next, self.next_lps = self._step(mx.maximum(cur, 0), self.pos + 1, lookahead=True)
            trace.mark("build")
            _dispatch(self.next, self.next_lps)
            trace.mark("dispatch")
        tok = cur.item()  # sync: read this step's token while the next one computes
        trace.mark("wait")
        self.pos += 1
        res = RoundResult(tokens=[tok], drafted=0, accepted=0)
        attach([res], cur_lps, self.rs)
        return res


def _dispatch(tok: mx.array, lps: mx.array | None) -> None:
    mx.async_eval(tok) if lps is None else mx.async_eval(tok, lps)
