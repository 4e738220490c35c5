"""The drafter protocol: the one contract both decode loops use, whatever proposes the drafts.

A drafter keeps per-row state for the rows it serves (a `DraftRows`, one object for a batch or
for the scalar loop's single row) and exposes five operations, all graph builders that never
sync:

    start(rows, pres)      state for newly prefilled rows (teacher forcing on their prompts)
    merge(a, b) / filter   admission and retirement: state follows the batch's row order
    draft(st, k, pick, target_cache) -> drafts [B, k]
    commit(st, k, accepted, hidden, targets)   per-row rollback after a verify
    capture(rows, hidden, targets)             cold start after a capture round (re-arm)

Round-boundary contract (the pending-bonus invariant of the loops): row b's sequence is
x_0..x_{n-1}; the target's KV holds x_0..x_{n-2}; the bonus x_{n-1} is emitted, not cached.
A verify of [bonus, d_n..d_{n+k-1}] yields, per row, target tokens t_0..t_k (t_j at position
n+j) and hidden states at positions n-1..n+k-1. With a_b accepted drafts the row keeps
t_0..t_{a_b}: `commit` gets the whole [B, k+1] arrays and the accepted counts, and keeps what
each row kept. `draft` consumes whatever was pending, so a round with k = 0 (the scalar loop
near its budget) is just a commit that appends; with k = 0 and a_b > 0, the a_b + 1 entries given
are appended (a lone request's plain steps, when it re-arms: gmlx/decode/scalar.py).

Capabilities: `needs_hidden` (prefill and verify must capture target hidden states),
`shares_kv` (it reads the target's K/V instead of keeping its own), `max_width` (rows it can
serve at once; None = any), `step_cost` (one draft step in target decode steps, for the
adaptive draft length), `drafts_replaceable` (its `commit` reads only the accepted counts and
the verify's tokens and hidden states, never its own draft values, and a round it did not draft
for is a `commit` with k = 0: so another source, a request's predicted output, may supply some
rows' drafts; gmlx/drafters/prediction.py), `rearms(st)` (a lone request that went plain may keep
its state and re-arm from its plain steps' hidden states: a `commit` with k = 0 of several),
`replays` / `replay(st, rs, last_position)` (one row: the first draft each pending entry would have proposed,
its pending entries then consumed as a `draft` consumes them; None where the drafter cannot say:
the lane then measures the request's acceptance only in the rounds that draft — gmlx/decode/shadow.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from gmlx.sampling import RowSampling, draft_coupled, draft_greedy


@dataclass(slots=True)
class DraftPick:
    """How drafts are chosen from drafter logits: greedy (batch loop, `rs` None) or coupled with
    the target's position-keyed noise (scalar loop). `first_positions[b]`: the absolute position
    of row b's first draft."""

    rs: RowSampling | None
    first_positions: np.ndarray
    context: int = 0  # (the lone request's rounds) the most drafts its own context may give (context_lookup.py)

    def __call__(self, logits: mx.array, j: int) -> mx.array:
        """logits [B, 1, V] for draft j -> tokens [B, 1] int32."""
        if self.rs is None:
            return draft_greedy(logits)
        return draft_coupled(logits, self.rs, self.first_positions + j)


class Drafter(ABC):
    kind: str = ""
    needs_hidden: bool = True
    shares_kv: bool = False
    max_width: int | None = None
    step_cost: float = 0.1
    drafts_replaceable: bool = False
    replays: bool = False  # offers `replay` (the lane's shadow rounds)
    batch_replays: bool = False  # offers `replay_rows` (a gated batch's shadow rounds)

    @abstractmethod
    def start(self, rows: list, pres: list) -> object: ...

    @abstractmethod
    def merge(self, a: object, b: object) -> object: ...

    @abstractmethod
    def filter(self, st: object, keep: list[int]) -> object: ...

    @abstractmethod
    def width(self, st: object) -> int: ...

    @abstractmethod
    def draft(self, st: object, k: int, pick: DraftPick, target_cache: list) -> mx.array: ...

    def draft_lengths(self, st: object) -> np.ndarray | None:
        """Host data: how many of the last `draft`'s k columns each row really drafted (the rest
        is padding, never accepted); None: every row drafted k. A drafter that finds nothing to
        propose for a row (prompt lookup without a match) drafts 0 there."""
        return None

    @abstractmethod
    def commit(self, st: object, k: int, accepted: np.ndarray, hidden: mx.array, targets: mx.array) -> None: ...

    @abstractmethod
    def capture(self, rows: list, hidden: mx.array, targets: mx.array) -> object: ...

    def foreign(self, st: object) -> bool:
        """Whether the last draft came from elsewhere than this drafter's model (the row's own
        context: gmlx/drafters/context_lookup.py): the control learns nothing from such a round."""
        return False

    def context_recurs(self, st: object, emitted: list[int] | None = None) -> bool:
        """(one row) Whether its next round would draft from its own context (`emitted`: its output
        tokens so far, where the state may lag them): gmlx/drafters/context_lookup.py."""
        return False

    def rearms(self, st: object) -> bool:
        """Whether a lone request that goes plain may keep this state and re-arm from its plain
        steps (a `commit` with k = 0 of several: see above)."""
        return True

    def replay(self, st: object, rs: RowSampling, last_position: int) -> mx.array | None:
        """(one row) [1, P]: the first draft each of the P pending entries would have proposed,
        coupled with `rs`'s noise as a round's first draft is, the last one's at `last_position`;
        the entries are consumed (teacher forcing, as `draft` does). None: not offered (or nothing
        pending), and nothing consumed."""
        return None

    def replay_rows(self, st: object) -> tuple[mx.array, np.ndarray] | None:
        """(every row; a gated batch's shadow rounds) [B, P]: the first draft each row's pending
        entries would have proposed, greedy as a batch's drafts are, right-padded; and each row's
        count of entries. Consumed as `replay` consumes them. None: not offered, or nothing pending."""
        return None


def pad_to(x: mx.array, p: int) -> mx.array:
    """Right-pad axis 1 to length p."""
    if x.shape[1] == p:
        return x
    pad = [(0, 0), (0, p - x.shape[1])] + [(0, 0)] * (x.ndim - 2)
    return mx.pad(x, pad)


def concat_rows(xs: list[mx.array]) -> mx.array:
    """Stack per-row [1, P_i, ...] blocks into [B, max P, ...], right-padded."""
    p = max(x.shape[1] for x in xs)
    return mx.concatenate([pad_to(x, p) for x in xs], axis=0)


def ragged_append(x: mx.array | None, lx: np.ndarray, y: mx.array, ly: np.ndarray) -> tuple[mx.array, np.ndarray]:
    """Per row, y's first ly[b] entries after x's first lx[b] entries; right-padded. x [B, P, ...]
    (None: P = 0), y [B, Q, ...]. Gathers with host-built indices: no sync."""
    if x is None or x.shape[1] == 0 or not lx.any():
        return y, ly.copy()
    p, q = x.shape[1], y.shape[1]
    n = lx + ly
    i = np.arange(max(int(n.max()), 1))[None, :]
    idx = np.where(i < lx[:, None], i, p + i - lx[:, None])
    idx = np.clip(idx, 0, p + q - 1).astype(np.int32)  # past a row's end: any valid index (padding)
    both = mx.concatenate([x, y], axis=1)
    g = mx.array(idx).reshape(idx.shape + (1,) * (both.ndim - 2))
    g = mx.broadcast_to(g, idx.shape + both.shape[2:])
    return mx.take_along_axis(both, g, axis=1), n


def take_rows_at(x: mx.array, cols: np.ndarray) -> mx.array:
    """x [B, L, ...] -> [B, 1, ...]: row b's entry at column cols[b]."""
    g = mx.array(cols.astype(np.int32)).reshape((-1, 1) + (1,) * (x.ndim - 2))
    g = mx.broadcast_to(g, (x.shape[0], 1) + x.shape[2:])
    return mx.take_along_axis(x, g, axis=1)
