"""An LRU prefix cache of target KV (and drafter state), bounded in bytes.

Role: when a request retires, the engine stores the KV of its tokens; a later prompt that
shares a prefix with a stored sequence prefills only the remainder. The target's KV at
positions < n depends only on tokens < n (causal attention), so any common prefix of a stored
sequence and a new prompt is reusable, not only a stored sequence that is a whole prefix.

Structure: a dict in LRU order with a linear scan (a few hundred entries at most). Each scan
step compares token arrays with numpy, so a lookup costs O(entries) small vectorised compares
and no per-token Python work; a trie would trade that for a Python node per token.

Invariants:
- every stored cache is a plain mlx-lm `KVCache` holding exactly len(tokens) positions
  (offset == keys.shape[2] == len(tokens)), in its own contiguous buffer: it never shares
  storage with the caller's (larger) cache, so `nbytes` is what the entry really keeps alive;
- `nbytes` == sum of the entries' KV bytes plus their drafters' `nbytes`, and <= max_bytes;
- a hit is a prefix of the query of length 1 <= length <= len(query) - 1: the engine needs the
  last prompt token pending, to produce its logits;
- a hybrid target's recurrent layers (`gmlx.recurrent.RecurrentCache`) hold the state after exactly
  len(tokens) tokens: it stands for that whole sequence only, so such an entry is reused only as a
  whole (a prompt that extends it, e.g. the next turn of a chat), never cut to a shorter prefix;
- a hit's caches are new KVCache objects over new arrays (MLX arrays are immutable values, so
  a caller's writes can never reach the stored entry); the drafter state is handed out as
  stored, and only when the hit covers the whole entry (it describes that length only) —
  callers must treat it as read-only.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from gmlx.recurrent import RecurrentCache


@dataclass
class Hit:
    length: int  # cached tokens reused; the caller runs tokens[length:]
    caches: list[KVCache]  # per layer, offset == length, the caller's to mutate
    drafter: Any | None  # the stored drafter state when length == the entry's length, else None


@dataclass
class _Entry:
    tokens: np.ndarray  # int64, for vectorised prefix compares
    caches: list[KVCache]
    drafter: Any | None
    nbytes: int
    whole_only: bool = False  # recurrent layers: reusable only as the whole sequence


def _slice(c: KVCache, n: int, *, own: bool) -> KVCache:
    if isinstance(c, RecurrentCache):  # a state after exactly n tokens (checked by insert / lookup)
        out = c.copy()
        if own:
            out.cache = [None if a is None else mx.contiguous(a) for a in out.cache]
        return out
    out = KVCache()
    k, v = c.keys[..., :n, :], c.values[..., :n, :]
    # A slice is a view that keeps the whole source buffer alive; `own` forces a compact copy.
    out.keys, out.values = (mx.contiguous(k), mx.contiguous(v)) if own else (k, v)
    out.offset = n
    return out


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    m = min(len(a), len(b))
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if len(diff) else m


class PromptCache:
    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()  # LRU first
        self._nbytes = 0
        self._lock = threading.Lock()  # cheap, and submit threads may look up while the loop inserts

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[tuple[int, ...]]:
        """Stored token sequences, least recently used first (no side effects)."""
        with self._lock:
            return list(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._nbytes = 0

    def lookup(self, tokens: Sequence[int]) -> Hit | None:
        """The longest reusable prefix of `tokens` (< len(tokens)), as fresh caches; None if none."""
        if len(tokens) < 2:
            return None
        query = np.asarray(tokens, dtype=np.int64)
        limit = len(query) - 1
        with self._lock:
            best: tuple[int, bool] = (0, False)
            best_key = None
            # Most recent first, and only strict improvements: ties go to the most recent entry,
            # after preferring one used whole (it brings its drafter and needs no trim).
            for key in reversed(self._entries):
                e = self._entries[key]
                if e.tokens[0] != query[0]:
                    continue
                n = min(_common_prefix(e.tokens, query), limit)
                if e.whole_only and n < len(e.tokens):  # a recurrent state stands for its whole sequence
                    continue
                score = (n, n == len(e.tokens))
                if score > best:
                    best, best_key = score, key
            if best_key is None or best[0] == 0:
                return None
            n, whole = best
            e = self._entries[best_key]
            self._entries.move_to_end(best_key)
            return Hit(length=n, caches=[_slice(c, n, own=False) for c in e.caches],
                       drafter=e.drafter if whole else None)

    def insert(self, tokens: Sequence[int], caches: Sequence[KVCache], drafter: Any | None = None) -> bool:
        """Store copies of `caches` trimmed to len(tokens) positions; False if it cannot fit.

        Each cache's offset may exceed len(tokens) (stale positions past the sequence are
        dropped) but not fall short of it. An identical sequence is replaced; least recently
        used entries are evicted until the total fits max_bytes.
        """
        n = len(tokens)
        if n == 0:
            return False
        for c in caches:
            if isinstance(c, RecurrentCache):
                if c.offset != n or c.batch_size != 1:  # its state stands for offset tokens, not n
                    return False
                continue
            if not isinstance(c, KVCache):
                raise TypeError(f"PromptCache stores mlx-lm KVCache (and gmlx RecurrentCache) layers only, got"
                                f" {type(c).__name__}")
            if c.offset < n or c.keys is None or c.keys.shape[0] != 1:
                raise ValueError(f"a cache with offset {c.offset} cannot hold {n} tokens of one sequence")
        stored = [_slice(c, n, own=True) for c in caches]
        size = sum(c.nbytes for c in stored) + (int(drafter.nbytes) if drafter is not None else 0)
        if size > self.max_bytes:
            return False
        # Materialise the compact copies now, so that a lazy graph does not keep the caller's
        # full-capacity buffers alive and `nbytes` is true.
        mx.eval([c.state for c in stored])  # sync: state, copies of retired KV
        key = tuple(int(t) for t in tokens)
        entry = _Entry(np.asarray(key, dtype=np.int64), stored, drafter, size,
                       whole_only=any(isinstance(c, RecurrentCache) for c in stored))
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._nbytes -= old.nbytes
            self._entries[key] = entry
            self._nbytes += size
            while self._nbytes > self.max_bytes:  # the new entry is last, and fits on its own
                _, victim = self._entries.popitem(last=False)
                self._nbytes -= victim.nbytes
        return True
