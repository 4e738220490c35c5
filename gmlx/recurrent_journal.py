"""The journal that lets a recurrent state roll back: for each row of a `RecurrentCache`
(gmlx/recurrent.py), the state after each of its recent positions.

A KV cache rolls back by forgetting its last n entries; a recurrent state cannot (the state after
a verify has every rejected draft folded in), so the cache keeps the states themselves. They are
held once, in *slots* (a slot: the cache's arrays at one moment, every row), and each row keeps a
history of slot ids: its last entry is the row's current state, the one before it the state one
position earlier, and so on; None marks a position that is not reachable (inside a long forward
that was not captured), EMPTY a state never written (zeros). Going back n positions is dropping a
row's last n ids and gathering each row's state from its slot; slots no row refers to are freed.

What is reachable: every position of the last captured forward (up to CAPTURE_MAX), and `span`
one-token steps before it (a draft model's chained draft steps are trimmed together after the
verify; 0 for a target: only its last forward).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

CAPTURE_MAX = 64  # longest forward captured position by position (a verify of k+1, a draft feed)
EMPTY = -1  # the slot id of a state never written (zeros)


class Journal:
    """Per row, the slot ids of its recent states (last: the current one); the slots themselves."""

    def __init__(self, span: int = 0):
        self.span = span
        self.slots: dict[int, tuple] = {}
        self.hist: list[list[int | None]] = []
        self._next = 0

    def reset(self, b: int) -> None:
        """b rows, none written."""
        self.hist = [[EMPTY] for _ in range(b)]
        self.slots = {}

    def _new_slot(self, arrays: Sequence) -> int:
        sid = self._next
        self._next += 1
        self.slots[sid] = tuple(arrays)
        return sid

    def record(self, snaps: list[tuple]) -> None:
        """A captured forward: snaps[t] holds the arrays after t+1 of its positions (every row)."""
        ids = [self._new_slot(s) for s in snaps]
        for b, h in enumerate(self.hist):
            self.hist[b] = h[-(self.span + 1):] + ids
        self._gc()

    def record_uncaptured(self, arrays: Sequence, n: int, valid: np.ndarray | None) -> None:
        """A forward of n positions through mlx-lm's own code, `arrays` the state after it; row b
        had valid[b] real tokens in it (None: all n), the rest padding."""
        sid = self._new_slot(arrays)
        for b, h in enumerate(self.hist):
            v = n if valid is None else int(valid[b])
            keep = h[-(self.span + 1):]
            if v == 0:  # all padding: the row's state did not move (earlier padding stays reachable)
                self.hist[b] = h + [sid] * n
            else:  # positions inside a long forward are not reachable; padding after it is
                self.hist[b] = keep + [None] * (v - 1) + [sid] * (1 + n - v)
        self._gc()

    def back(self, ns: np.ndarray, size: int) -> list:
        """Row b goes back ns[b] positions; the arrays of every row's state there (`size` of them).
        Nothing changes when some row cannot go back that far (a ValueError)."""
        if ns.shape[0] != len(self.hist):
            raise ValueError(f"trim_rows: got {ns.shape[0]} counts for {len(self.hist)} rows")
        for b, n in enumerate(ns):
            h = self.hist[b]
            if n < 0 or n >= len(h) or h[-1 - n] is None:
                raise ValueError(
                    f"recurrent state of row {b} cannot go back {n} positions: only the positions of its last "
                    f"captured forward (up to {CAPTURE_MAX}) and {self.span} one-token steps before are kept")
        for b, n in enumerate(ns):
            if n:
                self.hist[b] = self.hist[b][: len(self.hist[b]) - int(n)]
        out = self._gather([h[-1] for h in self.hist], size)
        self._gc()
        return out

    def _gather(self, ids: list[int], size: int) -> list:
        """The arrays whose row b is slot ids[b]'s row b."""
        if len(set(ids)) == 1:
            return [None] * size if ids[0] == EMPTY else list(self.slots[ids[0]])
        ref = next(self.slots[i] for i in ids if i != EMPTY)
        out = []
        for j, r in enumerate(ref):
            if r is None:
                out.append(None)
                continue
            parts = [mx.zeros((1,) + r.shape[1:], r.dtype) if i == EMPTY else self.slots[i][j][b:b + 1]
                     for b, i in enumerate(ids)]
            out.append(mx.concatenate(parts, axis=0))
        return out

    def _gc(self) -> None:
        live = {i for h in self.hist for i in h if i is not None}
        for sid in [s for s in self.slots if s not in live]:
            del self.slots[sid]

    def collapse(self, b: int, arrays: Sequence | None) -> None:
        """Forget the history: `arrays` (None: never written) is all there is, for b rows."""
        self.slots = {}
        if arrays is None:
            self.hist = [[EMPTY] for _ in range(b)]
        else:
            sid = self._new_slot(arrays)
            self.hist = [[sid] for _ in range(b)]
