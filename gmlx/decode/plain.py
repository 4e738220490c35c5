"""Plain decode of one request, double-buffered like mlx-lm's generate_step: step p+1's forward
is dispatched before step p's token is read. The reference path for the oracle tests."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from gmlx.decode.verify import RoundResult
from gmlx.engine import trace
from gmlx.models.adapter import Target
from gmlx.sampling import RowSampling, sample


class PlainDecoder:
    def __init__(self, target: Target, cache: list, rs: RowSampling, bonus: int, position: int, remaining):
        """`remaining()`: the request's budget left, read before dispatching a successor."""
        self.target = target
        self.cache = cache
        self.rs = rs
        self.pos = position
        self.remaining = remaining
        self.next = self._step(mx.array([[bonus]], dtype=mx.int32), self.pos)
        mx.async_eval(self.next)

    def _step(self, y: mx.array, pos: int) -> mx.array:
        logits = self.target.logits(y, self.cache)[:, -1:]  # [1, 1, V]
        return sample(logits, self.rs, np.array([pos]))  # [1, 1]

    @property
    def in_flight(self) -> bool:
        return self.next is not None

    def round(self, bonus: int, successor: bool = True) -> RoundResult:
        cur = self.next if self.next is not None else self._step(mx.array([[bonus]], dtype=mx.int32), self.pos)
        self.next = None
        if successor and self.remaining() > 1:
            self.next = self._step(mx.maximum(cur, 0), self.pos + 1)  # a FAULT ends the row; feed a real id
            trace.mark("build")
            mx.async_eval(self.next)
            trace.mark("dispatch")
        tok = cur.item()  # sync: read this step's token while the next one computes
        trace.mark("wait")
        self.pos += 1
        return RoundResult(tokens=[tok], drafted=0, accepted=0)
