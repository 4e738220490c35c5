"""Recurrent layers that roll back exactly: hybrid targets (and drafters) speculate.

mlx-lm's hybrid families mix full attention with layers whose cache is a recurrent state
(`ArraysCache`: Qwen3-Next / Qwen3.5 Gated DeltaNet keep a short conv window [B, K-1, C] and a
state [B, Hv, Dv, Dk]). A KV cache rolls back by forgetting its last n entries; a recurrent state
cannot: the state after a verify of k+1 positions has every rejected draft folded in.

How gmlx rolls it back (docs/design.md §5, README "Hybrid targets"):

- `RecurrentCache` stands in for `ArraysCache` in those layers (the same protocol: `cache[0]`,
  `cache[1]`, `lengths`, `make_mask`, `advance`, `prepare`/`finalize`), for one sequence or a
  batch, and keeps a *journal* (`Journal`): for each row, the state after each of its recent
  positions (the last entry is the current state, the one before it the state one position
  earlier, ...).
  `trim_rows(ns)` / `trim(n)` restore each row to its state ns[b] positions back, exactly like
  the ragged KV trim, so the loops roll every layer back with the same call.
- A multi-position forward (a verify of k+1 tokens, a draft model's pending feed) is *captured*
  (gmlx/models/gated_delta.py): the layer's mixer runs gmlx's capture forward, the same ops as mlx-lm's
  `GatedDeltaNet.__call__` (its projections, conv1d, `normalize_qk` and the gated-delta step of
  mlx-lm's own `gated_delta` module), which the recurrence computes position by position anyway;
  it only keeps each position's state and conv window (references to arrays the forward computes
  anyway; no extra work) instead of dropping them. A one-position forward runs mlx-lm's own code
  and the journal keeps the state before it. The mixers get the capture by a subclass swap on
  the instance (`install`): for any other cache (mlx-lm's ArraysCache, mlx-lm's own generate)
  the subclass calls mlx-lm's `__call__` unchanged. At install, gmlx's capture forward is checked
  against mlx-lm's on the model's own weights (output and state); a mismatch (an mlx-lm change)
  makes the target decode plain with that reason, never wrong.
- A right-padded batch prefill (ragged prompts) runs mlx-lm's masked path (`prepare(lengths)`:
  each row's state stops at its own length, the padding positions leave it unchanged), so the
  padding is trimmed like the KV's.
- Rows change membership (filter, extend, lift, extract) only between rounds, so those collapse
  the journal to the current state.

What it costs: the capture keeps k+2 states and conv windows per recurrent layer and row alive
until the round's trim (memory, no compute), and a trim gathers each row's state (one copy of
the state per layer in a batch with different acceptance; none when every row kept the same
count). `benchmarks/bench_hybrid.py` measures a verify forward with and without capture.

Which layers, and the helpers the loops call over a model's whole cache (every layer, attention
or recurrent, with one call): gmlx/model_cache.py. The journal itself: gmlx/recurrent_journal.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from gmlx.recurrent_journal import CAPTURE_MAX, Journal


class RecurrentCache:
    """A batch of recurrent states (mlx-lm's ArraysCache protocol) with per-row rollback."""

    def __init__(self, size: int = 2, batch_size: int | None = None, span: int = 0):
        self.cache: list[mx.array | None] = [None] * size
        self.lengths: mx.array | None = None  # mlx-lm: tokens still valid in a prepared (right-padded) forward
        self.left_padding = None
        self._prep: np.ndarray | None = None  # host copy of `lengths`
        self.capture = True  # False during a prefill: nothing there is rolled back (but padding)
        self._journal = Journal(span)
        self._tokens: np.ndarray | None = None
        if batch_size is not None:
            self._init_rows(batch_size)

    # -- rows ---------------------------------------------------------------------------------
    def _init_rows(self, b: int) -> None:
        self._tokens = np.zeros(b, dtype=np.int64)
        self._journal.reset(b)

    @property
    def span(self) -> int:
        """One-position forwards kept reachable beyond the last one (a draft model's chained draft
        steps are trimmed together after the verify); 0 for a target: only its last forward."""
        return self._journal.span

    @span.setter
    def span(self, n: int) -> None:
        self._journal.span = n

    @property
    def batch_size(self) -> int:
        if self._tokens is not None:
            return len(self._tokens)
        a = next((c for c in self.cache if c is not None), None)
        return 0 if a is None else a.shape[0]

    @property
    def positions(self) -> np.ndarray:
        """Tokens each row has consumed (host; what its state stands for), like a KV length."""
        return np.zeros(0, dtype=np.int64) if self._tokens is None else self._tokens.copy()

    @property
    def offset(self):
        """Tokens consumed: an int for one sequence (as mlx-lm's KVCache), else per row."""
        if self._tokens is None:
            return 0
        return int(self._tokens[0]) if len(self._tokens) == 1 else mx.array(self._tokens.astype(np.int32))

    # -- the ArraysCache protocol (what mlx-lm's layers and masks call) ----------------------
    def __getitem__(self, i: int):
        return self.cache[i]

    def __setitem__(self, i: int, v) -> None:
        self.cache[i] = v

    def make_mask(self, N: int, **kwargs):
        if self.lengths is None:
            return None
        return mx.arange(N)[None, :] < self.lengths[:, None]

    def prepare(self, lengths=None, **kwargs) -> None:
        """The next forwards are right-padded: row b holds lengths[b] real tokens (mlx-lm's
        ragged batch prefill); the padding leaves each row's state where its tokens end."""
        self._prep = np.asarray(lengths, dtype=np.int64).copy()
        self.lengths = mx.array(self._prep.astype(np.int32))

    def finalize(self) -> None:
        self.lengths = self._prep = None
        self.left_padding = None

    def advance(self, n: int) -> None:
        """Called by mlx-lm's layer after a forward of n positions through its own code."""
        if self._prep is not None:
            valid = np.clip(self._prep, 0, n)
            self._prep = self._prep - n
            self.lengths = self.lengths - n
        else:
            valid = None
        self._record_uncaptured(n, valid)

    @property
    def state(self) -> list[mx.array]:
        return [c for c in self.cache if c is not None]

    @state.setter
    def state(self, v) -> None:
        self.cache = list(v)
        self._tokens = None
        self._collapse()

    @property
    def meta_state(self) -> tuple[str, ...]:
        return ("",)

    @meta_state.setter
    def meta_state(self, v) -> None:
        pass

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.cache if c is not None)

    def is_trimmable(self) -> bool:
        return True

    def empty(self) -> bool:
        return all(c is None for c in self.cache)

    def size(self) -> int:
        return 0 if self._tokens is None or not len(self._tokens) else int(self._tokens.max())

    # -- recording and rollback (the journal: gmlx/recurrent_journal.py) ------------------------
    def captures(self, n: int) -> bool:
        """Whether a forward of n positions runs the capture forward (else mlx-lm's own code)."""
        return self.capture and self.lengths is None and 1 < n <= CAPTURE_MAX

    def _ensure_rows(self) -> None:
        if self._tokens is None:  # never written: one sequence (as mlx-lm's KVCache), or its arrays' rows
            self._init_rows(self.batch_size or 1)

    def record(self, snaps: list[tuple]) -> None:
        """A captured forward: snaps[t] holds the arrays after t+1 of its positions (every row);
        the last one becomes the current state."""
        if self._tokens is None:
            self._init_rows(next(a.shape[0] for a in snaps[-1] if a is not None))
        self._journal.record(snaps)
        self._tokens = self._tokens + len(snaps)
        self.cache = list(snaps[-1])

    def _record_uncaptured(self, n: int, valid: np.ndarray | None) -> None:
        self._ensure_rows()
        self._journal.record_uncaptured(self.cache, n, valid)
        self._tokens = self._tokens + n

    def trim_rows(self, ns: Sequence[int] | np.ndarray) -> None:
        """Row b goes back ns[b] positions (its rejected drafts, its padding)."""
        ns = np.asarray(ns, dtype=np.int64).reshape(-1)
        if not ns.any():
            return
        self._ensure_rows()
        self.cache = self._journal.back(ns, len(self.cache))
        self._tokens = self._tokens - ns

    def trim(self, n: int) -> int:
        """Uniform trim (mlx-lm's API): every row goes back n positions."""
        if n <= 0:
            return 0
        self._ensure_rows()
        self.trim_rows(np.full(len(self._journal.hist), n))
        return n

    def _collapse(self) -> None:
        """Forget the journal: the current state is all there is (membership changed)."""
        b = self.batch_size
        if self._tokens is None:
            self._tokens = np.zeros(b, dtype=np.int64)
        self._journal.collapse(b, None if self.empty() else self.cache)

    # -- row management (between rounds) --------------------------------------------------------
    def filter(self, keep: Sequence[int]) -> None:
        keep = [int(i) for i in keep]
        self._ensure_rows()
        idx = mx.array(keep, dtype=mx.int32)
        self.cache = [None if c is None or not keep else mx.take(c, idx, axis=0) for c in self.cache]
        self._tokens = self._tokens[keep] if keep else np.zeros(0, dtype=np.int64)
        self._collapse()

    def extend(self, other: RecurrentCache) -> None:
        self._ensure_rows()
        other._ensure_rows()
        self.cache = _cat([self, other])
        self._tokens = np.concatenate([self._tokens, other._tokens])
        self._collapse()

    @classmethod
    def lift(cls, caches: Sequence[RecurrentCache]) -> RecurrentCache:
        """Batch single-sequence (or smaller batch) caches, rows in order."""
        out = cls(len(caches[0].cache))
        for c in caches:
            c._ensure_rows()
        out.cache = _cat(caches)
        out._tokens = np.concatenate([c._tokens for c in caches]) if caches else np.zeros(0, dtype=np.int64)
        out._collapse()
        return out

    def extract(self, i: int) -> RecurrentCache:
        """Row i as a single-sequence cache (its own copy)."""
        self._ensure_rows()
        out = RecurrentCache(len(self.cache))
        out.cache = [None if c is None else mx.contiguous(c[i:i + 1]) for c in self.cache]
        out._tokens = self._tokens[i:i + 1].copy()
        out._collapse()
        return out

    def copy(self) -> RecurrentCache:
        """A new cache object over the same (immutable) arrays, journal collapsed."""
        out = RecurrentCache(len(self.cache), span=self.span)
        out.cache = list(self.cache)
        out._tokens = None if self._tokens is None else self._tokens.copy()
        out._collapse()
        return out


def _cat(caches: Sequence[RecurrentCache]) -> list:
    """Per array index, the caches' rows concatenated (zeros for a cache never written)."""
    n = len(caches[0].cache)
    out = []
    for j in range(n):
        ref = next((c.cache[j] for c in caches if c.cache[j] is not None), None)
        if ref is None:
            out.append(None)
            continue
        parts = [c.cache[j].astype(ref.dtype) if c.cache[j] is not None
                 else mx.zeros((len(c._tokens),) + ref.shape[1:], ref.dtype) for c in caches]
        parts = [p for p in parts if p.shape[0]]
        out.append(mx.concatenate(parts, axis=0) if parts else None)
    return out
