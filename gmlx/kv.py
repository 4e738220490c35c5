"""Ragged batch KV cache for mlx-lm attention, with per-row rollback.

Role: one ``RaggedKVCache`` per attention layer holds the KV of B independent
sequences so speculative decoding can accept a different number of draft
tokens per row. mlx-lm's ``BatchKVCache`` only trims every row by the same n;
here a per-row trim is just a decrement of a host-side length, so it costs the
same as a uniform trim and decoding stays equal to single-sequence decode.

Invariants:
- ``keys``/``values`` are ``[B, H, capacity, D]`` (or None before the first
  write); capacity is a multiple of ``step``.
- Row b's valid KV lives at ``[0, lengths[b])`` (left-aligned). Anything past
  that is stale garbage that masks exclude and later writes overwrite.
- ``lengths`` lives on the host (numpy) so no device sync is needed to know
  it; ``offset`` is the same values as an ``mx.array`` of shape (B,), which is
  what mlx-lm attention passes to rope as per-row positions.
- All layers of one model cache share the same lengths; the model builds its
  mask once from ``cache[0].make_mask`` before any layer updates, so the mask
  and ``offset`` both describe the state *before* the current forward.

The helpers that move every layer of a model's cache at once (attention and recurrent layers
alike): gmlx/model_cache.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache

Mask = mx.array | str | None


# Every layer's cache holds the same lengths: they share one offset array per lengths, so a fused
# rotary embedding computes a forward's angles once for all its layers (gmlx/models/cpu_fused.py,
# keyed by the array). Bounded: emptied when SHARED_OFFSETS lengths are held.
_offsets: dict[bytes, mx.array] = {}
SHARED_OFFSETS = 64


def _offset_of(lengths: np.ndarray) -> mx.array:
    rows = lengths.astype(np.int32)
    key = rows.tobytes()
    off = _offsets.get(key)
    if off is None:
        if len(_offsets) >= SHARED_OFFSETS:
            _offsets.clear()
        off = _offsets[key] = mx.array(rows)  # built from host data: creating it never waits on the device
    return off


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


class RaggedKVCache:
    step = 256

    def __init__(self, batch_size: int = 0):
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self._set_lengths(np.zeros(batch_size, dtype=np.int64))

    # -- bookkeeping -------------------------------------------------------
    def _set_lengths(self, lengths: np.ndarray) -> None:
        self._lengths = np.asarray(lengths, dtype=np.int64).copy()
        self.offset = _offset_of(self._lengths)

    @property
    def lengths(self) -> np.ndarray:
        return self._lengths.copy()

    @property
    def batch_size(self) -> int:
        return len(self._lengths)

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def _max_len(self) -> int:
        return int(self._lengths.max()) if len(self._lengths) else 0

    def _uniform(self) -> bool:
        n = self._lengths
        return len(n) == 0 or bool(n.min() == n.max())

    def size(self) -> int:
        return self._max_len()

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return self.keys.nbytes + self.values.nbytes

    # -- attention interface -----------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        B, H, L, _ = keys.shape
        if B != self.batch_size:
            raise ValueError(f"batch {B} != cache batch {self.batch_size}")
        end = self._max_len() + L
        if end > self.capacity:
            self._grow(end, keys, values)
        if self._uniform():
            # Equal lengths: a plain slice write, same op as KVCache.
            p = int(self._lengths[0]) if B else 0
            self.keys[:, :, p : p + L, :] = keys
            self.values[:, :, p : p + L, :] = values
        else:
            pos = self.offset[:, None] + mx.arange(L, dtype=mx.int32)[None, :]
            idx = pos.reshape(B, 1, L, 1)
            self.keys = mx.put_along_axis(self.keys, idx, keys, axis=2)
            self.values = mx.put_along_axis(self.values, idx, values, axis=2)
        # Update offset only now: rope already consumed the pre-update one.
        self._set_lengths(self._lengths + L)
        return self.keys[:, :, :end, :], self.values[:, :, :end, :]

    def _grow(self, needed: int, keys: mx.array, values: mx.array) -> None:
        B, H, _, Dk = keys.shape
        cap = _round_up(needed, self.step)
        new_k = mx.zeros((B, H, cap, Dk), keys.dtype)
        new_v = mx.zeros((B, H, cap, values.shape[3]), values.dtype)
        if self.keys is not None:
            old = self.capacity
            new_k[:, :, :old, :] = self.keys
            new_v[:, :, :old, :] = self.values
        self.keys, self.values = new_k, new_v

    def make_mask(
        self, N: int, return_array: bool = False, window_size: int | None = None
    ) -> Mask:
        """Mask for N new queries, from the state before this forward's update.

        Query j of row b sits at p = lengths[b] + j and sees key s iff
        s <= p (and s > p - window_size). Shape [B, 1, N, max(lengths) + N].
        Uniform lengths reuse mlx-lm's cheaper None / "causal" forms.
        """
        if self._uniform():
            off = int(self._lengths[0]) if self.batch_size else 0
            if window_size is None and not return_array:
                return None if N == 1 else "causal"
            return create_causal_mask(N, off, window_size=window_size)
        S = self._max_len() + N
        q = self.offset[:, None] + mx.arange(N, dtype=mx.int32)[None, :]  # [B, N]
        q = q[:, None, :, None]
        k = mx.arange(S, dtype=mx.int32)[None, None, None, :]
        mask = k <= q
        if window_size is not None:
            mask = mask & (k > q - window_size)
        return mask

    # -- rollback ----------------------------------------------------------
    def is_trimmable(self) -> bool:
        return True

    def trim_rows(self, ns: Sequence[int] | np.ndarray) -> None:
        ns = np.asarray(ns, dtype=np.int64).reshape(-1)
        if ns.shape != self._lengths.shape:
            raise ValueError(f"trim_rows: got {ns.shape[0]} counts for {self.batch_size} rows")
        if (ns < 0).any() or (ns > self._lengths).any():
            raise ValueError(f"trim_rows: counts {ns} outside [0, lengths={self._lengths}]")
        if not ns.any():  # nothing to drop (every draft accepted, no padding): keep the offset array
            return
        # Stale entries stay in storage; masks hide them and writes overwrite.
        self._set_lengths(self._lengths - ns)

    def trim(self, n: int) -> int:
        """Uniform trim (mlx-lm API); each row is clamped at 0."""
        trimmed = min(n, self._max_len())
        self.trim_rows(np.minimum(self._lengths, n))
        return trimmed

    # -- row management ----------------------------------------------------
    @classmethod
    def lift(cls, caches: Sequence[KVCache]) -> RaggedKVCache:
        """Batch single-sequence KVCaches (any offsets), left-aligned."""
        out = cls()
        lens = [c.offset for c in caches for _ in range(_rows(c))]
        full = [c for c in caches if c.keys is not None and c.offset > 0]
        out._set_lengths(np.array(lens, dtype=np.int64))
        if not full:
            return out
        cap = _round_up(out._max_len(), cls.step)
        ks, vs = [], []
        for c in caches:
            if c.keys is None or c.offset == 0:
                ref_k, ref_v = full[0].keys, full[0].values
                shape = (_rows(c), ref_k.shape[1], cap)
                ks.append(mx.zeros(shape + ref_k.shape[3:], ref_k.dtype))
                vs.append(mx.zeros(shape + ref_v.shape[3:], ref_v.dtype))
                continue
            pad = [(0, 0), (0, 0), (0, cap - c.offset), (0, 0)]
            ks.append(mx.pad(c.keys[:, :, : c.offset, :], pad))
            vs.append(mx.pad(c.values[:, :, : c.offset, :], pad))
        out.keys = mx.concatenate(ks, axis=0)
        out.values = mx.concatenate(vs, axis=0)
        return out

    def extend(self, other: RaggedKVCache) -> None:
        """Append other's rows (new requests joining) after ours."""
        lens = np.concatenate([self._lengths, other._lengths])
        if other.keys is not None or self.keys is not None:
            ref = self if self.keys is not None else other
            cap = max(self.capacity, other.capacity)
            parts = [_padded(c, cap, ref) for c in (self, other)]
            self.keys = mx.concatenate([p[0] for p in parts], axis=0)
            self.values = mx.concatenate([p[1] for p in parts], axis=0)
        self._set_lengths(lens)

    def filter(self, keep: Sequence[int]) -> None:
        """Keep only rows `keep`, in that order; shrink capacity to fit."""
        keep = [int(i) for i in keep]
        lens = self._lengths[keep] if keep else np.zeros(0, dtype=np.int64)
        if self.keys is not None:
            if not keep:
                self.keys = self.values = None
            else:
                # take() makes fresh arrays, so dropped rows (and the tail past
                # the new capacity) are freed once the old storage is released.
                cap = max(self.step, _round_up(int(lens.max()), self.step))
                idx = mx.array(keep, dtype=mx.int32)
                self.keys = mx.take(self.keys[:, :, :cap, :], idx, axis=0)
                self.values = mx.take(self.values[:, :, :cap, :], idx, axis=0)
        self._set_lengths(lens)

    def extract(self, i: int) -> KVCache:
        """Row i's valid KV as a single-sequence mlx-lm KVCache (own copy)."""
        n = int(self._lengths[i])
        c = KVCache()
        if self.keys is not None and n > 0:
            c.keys = mx.contiguous(self.keys[i : i + 1, :, :n, :])
            c.values = mx.contiguous(self.values[i : i + 1, :, :n, :])
            c.offset = n
        return c

    # -- (de)serialisation -------------------------------------------------
    @property
    def state(self) -> tuple[mx.array | None, mx.array | None, mx.array]:
        return self.keys, self.values, mx.array(self._lengths)

    @state.setter
    def state(self, v: tuple[mx.array | None, mx.array | None, Any]) -> None:
        self.keys, self.values, lengths = v
        # sync: lengths must live on the host; only used when loading state
        lengths = np.array(lengths, dtype=np.int64)
        self._set_lengths(lengths)

    @property
    def meta_state(self) -> tuple[str, ...]:
        return (str(self.step),)

    @meta_state.setter
    def meta_state(self, v: tuple[str, ...]) -> None:
        self.step = int(v[0])


def _rows(c: KVCache) -> int:
    return 1 if c.keys is None else c.keys.shape[0]


def _padded(c: RaggedKVCache, cap: int, ref: RaggedKVCache) -> tuple[mx.array, mx.array]:
    """c's storage padded (or created as zeros) to capacity cap, like ref."""
    if c.keys is None:
        rk, rv = ref.keys, ref.values
        return (
            mx.zeros((c.batch_size, rk.shape[1], cap, rk.shape[3]), rk.dtype),
            mx.zeros((c.batch_size, rv.shape[1], cap, rv.shape[3]), rv.dtype),
        )
    if c.keys.shape[1] != ref.keys.shape[1] or c.keys.shape[3] != ref.keys.shape[3]:
        raise ValueError("extend: caches have different head counts or dims")
    pad = [(0, 0), (0, 0), (0, cap - c.capacity), (0, 0)]
    k, v = c.keys.astype(ref.keys.dtype), c.values.astype(ref.values.dtype)
    if cap == c.capacity:
        return k, v
    return mx.pad(k, pad), mx.pad(v, pad)
