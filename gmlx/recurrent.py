"""Recurrent layers that roll back exactly: hybrid targets (and drafters) speculate.

mlx-lm's hybrid families mix full attention with layers whose cache is a recurrent state
(`ArraysCache`: Qwen3-Next / Qwen3.5 Gated DeltaNet keep a short conv window [B, K-1, C] and a
state [B, Hv, Dv, Dk]). A KV cache rolls back by forgetting its last n entries; a recurrent state
cannot: the state after a verify of k+1 positions has every rejected draft folded in.

How gmlx rolls it back (docs/design.md §5, README "Hybrid targets"):

- `RecurrentCache` stands in for `ArraysCache` in those layers (the same protocol: `cache[0]`,
  `cache[1]`, `lengths`, `make_mask`, `advance`, `prepare`/`finalize`), for one sequence or a
  batch, and keeps a *journal*: for each row, the state after each of its recent positions (the
  last entry is the current state, the one before it the state one position earlier, ...).
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

Which layers: found from the model (`recurrent_layers`): every layer whose mlx-lm cache is an
ArraysCache; its mixer is the submodule with the Gated DeltaNet structure (conv1d, A_log,
dt_bias, norm, out_proj and either Qwen3-Next's in_proj_qkvz/in_proj_ba or Qwen3.5's
in_proj_qkv/z/b/a) in a module that imports mlx-lm's `gated_delta_update`. Other recurrent
mixers (Mamba/Mamba2 SSM blocks, OLMo-hybrid's or Kimi's delta nets, ...) are named in
`blockers` and their models decode plain.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

CAPTURE_MAX = 64  # longest forward captured position by position (a verify of k+1, a draft feed)
EMPTY = -1  # the slot id of a state never written (zeros)


class RecurrentCache:
    """A batch of recurrent states (mlx-lm's ArraysCache protocol) with per-row rollback."""

    def __init__(self, size: int = 2, batch_size: int | None = None, span: int = 0):
        self.cache: list[mx.array | None] = [None] * size
        self.lengths: mx.array | None = None  # mlx-lm: tokens still valid in a prepared (right-padded) forward
        self.left_padding = None
        self._prep: np.ndarray | None = None  # host copy of `lengths`
        self.capture = True  # False during a prefill: nothing there is rolled back (but padding)
        # One-position forwards kept reachable beyond the last one (a draft model's chained draft
        # steps are trimmed together after the verify); 0 for a target: only its last forward.
        self.span = span
        self._tokens: np.ndarray | None = None
        self._slots: dict[int, tuple] = {}
        self._hist: list[list[int | None]] = []
        self._next = 0
        if batch_size is not None:
            self._init_rows(batch_size)

    # -- rows ---------------------------------------------------------------------------------
    def _init_rows(self, b: int) -> None:
        self._tokens = np.zeros(b, dtype=np.int64)
        self._hist = [[EMPTY] for _ in range(b)]
        self._slots = {}

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

    # -- the journal ----------------------------------------------------------------------------
    def captures(self, n: int) -> bool:
        """Whether a forward of n positions runs the capture forward (else mlx-lm's own code)."""
        return self.capture and self.lengths is None and 1 < n <= CAPTURE_MAX

    def _new_slot(self, arrays: Sequence) -> int:
        sid = self._next
        self._next += 1
        self._slots[sid] = tuple(arrays)
        return sid

    def _ensure_rows(self) -> None:
        if self._tokens is None:  # never written: one sequence (as mlx-lm's KVCache), or its arrays' rows
            self._init_rows(self.batch_size or 1)

    def record(self, snaps: list[tuple]) -> None:
        """A captured forward: snaps[t] holds the arrays after t+1 of its positions (every row);
        the last one becomes the current state."""
        if self._tokens is None:
            self._init_rows(next(a.shape[0] for a in snaps[-1] if a is not None))
        ids = [self._new_slot(s) for s in snaps]
        for b, h in enumerate(self._hist):
            self._hist[b] = h[-(self.span + 1):] + ids
        self._tokens = self._tokens + len(snaps)
        self.cache = list(snaps[-1])
        self._gc()

    def _record_uncaptured(self, n: int, valid: np.ndarray | None) -> None:
        self._ensure_rows()
        sid = self._new_slot(self.cache)
        for b, h in enumerate(self._hist):
            v = n if valid is None else int(valid[b])
            keep = h[-(self.span + 1):]
            if v == 0:  # all padding: the row's state did not move (earlier padding stays reachable)
                self._hist[b] = h + [sid] * n
            else:  # positions inside a long forward are not reachable; padding after it is
                self._hist[b] = keep + [None] * (v - 1) + [sid] * (1 + n - v)
        self._tokens = self._tokens + n
        self._gc()

    def trim_rows(self, ns: Sequence[int] | np.ndarray) -> None:
        """Row b goes back ns[b] positions (its rejected drafts, its padding)."""
        ns = np.asarray(ns, dtype=np.int64).reshape(-1)
        if not ns.any():
            return
        self._ensure_rows()
        if ns.shape[0] != len(self._hist):
            raise ValueError(f"trim_rows: got {ns.shape[0]} counts for {len(self._hist)} rows")
        for b, n in enumerate(ns):
            h = self._hist[b]
            if n < 0 or n >= len(h) or h[-1 - n] is None:
                raise ValueError(
                    f"recurrent state of row {b} cannot go back {n} positions: only the positions of its last "
                    f"captured forward (up to {CAPTURE_MAX}) and {self.span} one-token steps before are kept")
        for b, n in enumerate(ns):
            if n:
                self._hist[b] = self._hist[b][: len(self._hist[b]) - int(n)]
        self._tokens = self._tokens - ns
        self.cache = self._gather([h[-1] for h in self._hist])
        self._gc()

    def trim(self, n: int) -> int:
        """Uniform trim (mlx-lm's API): every row goes back n positions."""
        if n <= 0:
            return 0
        self._ensure_rows()
        self.trim_rows(np.full(len(self._hist), n))
        return n

    def _gather(self, ids: list[int]) -> list:
        """The arrays whose row b is slot ids[b]'s row b."""
        if len(set(ids)) == 1:
            return [None] * len(self.cache) if ids[0] == EMPTY else list(self._slots[ids[0]])
        ref = next(self._slots[i] for i in ids if i != EMPTY)
        out = []
        for j, r in enumerate(ref):
            if r is None:
                out.append(None)
                continue
            parts = [mx.zeros((1,) + r.shape[1:], r.dtype) if i == EMPTY else self._slots[i][j][b:b + 1]
                     for b, i in enumerate(ids)]
            out.append(mx.concatenate(parts, axis=0))
        return out

    def _gc(self) -> None:
        live = {i for h in self._hist for i in h if i is not None}
        for sid in [s for s in self._slots if s not in live]:
            del self._slots[sid]

    def _collapse(self) -> None:
        """Forget the journal: the current state is all there is (membership changed)."""
        b = self.batch_size
        if self._tokens is None:
            self._tokens = np.zeros(b, dtype=np.int64)
        self._slots = {}
        if self.empty():
            self._hist = [[EMPTY] for _ in range(b)]
        else:
            sid = self._new_slot(self.cache)
            self._hist = [[sid] for _ in range(b)]

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


# -- which layers ------------------------------------------------------------------------------
def recurrent_layers(model: nn.Module) -> list[tuple[int, nn.Module, int]]:
    """(layer index, decoder layer, state arrays) of every layer whose mlx-lm cache is an
    ArraysCache (mlx-lm's MambaCache is one), found from the model's own `make_cache`."""
    from mlx_lm.models.cache import ArraysCache, make_prompt_cache

    try:
        layers = getattr(model, "layers", None)
        if layers is None:
            layers = model.model.layers
        caches = make_prompt_cache(model)
    except (AttributeError, TypeError):  # not an mlx-lm decoder with per-layer caches: nothing recurrent here
        return []
    return [(i, layers[i], len(c.cache)) for i, c in enumerate(caches) if isinstance(c, ArraysCache)]


def wrap_caches(caches: list, span: int = 0) -> list:
    """mlx-lm's per-layer caches with every ArraysCache replaced by a RecurrentCache."""
    from mlx_lm.models.cache import ArraysCache

    return [RecurrentCache(len(c.cache), span=span) if isinstance(c, ArraysCache) else c for c in caches]


# -- helpers over a model's cache (a list with one cache per layer) ------------------------------
def begin_prefill(caches: Sequence, lengths: Sequence[int]) -> bool:
    """A prefill of rows with these many tokens follows (right-padded to the longest). Nothing in
    a prefill is rolled back but its padding, so the recurrent layers run mlx-lm's own code, never
    the capture: its masked path when the rows are ragged (each row's state stops where its tokens
    end, the padding is trimmed later like the KV's), else its plain path. True when some layer is
    recurrent (call `end_prefill` after)."""
    rec = [c for c in caches if isinstance(c, RecurrentCache)]
    ragged = len({int(n) for n in lengths}) > 1
    for c in rec:
        c.capture = False
        if ragged:
            c.prepare(lengths=list(lengths))
    return bool(rec)


def end_prefill(caches: Sequence) -> None:
    for c in caches:
        if isinstance(c, RecurrentCache):
            c.finalize()
            c.capture = True


def reach(caches: Sequence, n: int) -> None:
    """Keep n one-token steps reachable by a trim (a draft model drafting n tokens)."""
    for c in caches:
        if isinstance(c, RecurrentCache) and c.span < n:
            c.span = n
