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
- A multi-position forward (a verify of k+1 tokens, a draft model's pending feed) is *captured*:
  the layer's mixer runs gmlx's capture forward (`_gdn_capture`), the same ops as mlx-lm's
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

import sys
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


# -- the model side: which layers, their capture forward ---------------------------------------
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


_GDN_PROJ = {"qwen3_next": ("in_proj_qkvz", "in_proj_ba"), "qwen3_5": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")}
_GDN_COMMON = ("conv1d", "A_log", "dt_bias", "norm", "out_proj", "conv_kernel_size", "conv_dim", "key_dim",
               "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim")


def _family_module(mixer: nn.Module):
    cls = type(mixer)
    base = cls.__mro__[1] if getattr(cls, "_gmlx_capture", False) else cls
    return sys.modules.get(base.__module__)


def gdn_layout(mixer: nn.Module) -> str | None:
    """'qwen3_next' or 'qwen3_5' when the module is a Gated DeltaNet gmlx can capture, else None."""
    mod = _family_module(mixer)
    if mod is None or not hasattr(mod, "gated_delta_update") or not hasattr(mod, "normalize_qk"):
        return None
    if not all(hasattr(mixer, a) for a in _GDN_COMMON):
        return None
    for name, proj in _GDN_PROJ.items():
        if all(hasattr(mixer, p) for p in proj):
            if name == "qwen3_next" and not hasattr(mixer, "fix_query_key_value_ordering"):
                continue
            return name
    return None


def mixer_of(layer: nn.Module) -> nn.Module | None:
    """The layer's recurrent mixer (a Gated DeltaNet gmlx can capture), or None."""
    for _, m in layer.named_modules():
        if m is not layer and gdn_layout(m) is not None:
            return m
    return None


def _mixer_name(layer: nn.Module) -> str:
    """The most telling class name inside a layer gmlx cannot capture (its mixer, when there
    is a child that takes the cache)."""
    for name in ("linear_attn", "mixer", "mamba", "ssm", "conv", "attn", "self_attn", "attention"):
        m = getattr(layer, name, None)
        if isinstance(m, nn.Module):
            return type(m).__name__
    return type(layer).__name__


_CAPTURING: dict[type, type] = {}


def _capturing(cls: type) -> type:
    """cls with a `__call__` that captures per position for a RecurrentCache, mlx-lm's otherwise."""
    if getattr(cls, "_gmlx_capture", False):
        return cls
    sub = _CAPTURING.get(cls)
    if sub is None:
        def __call__(self, inputs, mask=None, cache=None):
            if mask is None and isinstance(cache, RecurrentCache) and cache.captures(inputs.shape[1]):
                return _gdn_capture(self, inputs, cache)
            return cls.__call__(self, inputs, mask, cache)

        sub = type(cls.__name__, (cls,), {"__call__": __call__, "_gmlx_capture": True, "__module__": cls.__module__,
                                          "__qualname__": cls.__qualname__})
        _CAPTURING[cls] = sub
    return sub


def install(model: nn.Module) -> list[str]:
    """Give every recurrent layer's mixer the capture forward; returns the blockers (why this
    model cannot roll back its recurrent layers; empty when it can, or has none)."""
    found = recurrent_layers(model)
    if not found:
        return []
    missing = sorted({_mixer_name(layer) for _, layer, _ in found if mixer_of(layer) is None})
    if missing:
        return [f"ArraysCache ({', '.join(missing)}: gmlx captures per-position state only for Qwen3-Next /"
                " Qwen3.5 Gated DeltaNet layers)"]
    mixers = [mixer_of(layer) for _, layer, _ in found]
    for m in mixers:
        if not getattr(type(m), "_gmlx_capture", False):
            m.__class__ = _capturing(type(m))
    why = _check(mixers[0])
    if why:
        for m in mixers:  # back to mlx-lm's own class: the model decodes plain
            m.__class__ = type(m).__mro__[1]
        return [f"ArraysCache ({type(mixers[0]).__name__}: {why})"]
    return []


def _check(mixer: nn.Module) -> str | None:
    """gmlx's capture forward against mlx-lm's on this layer's weights: 2 tokens, then 3 more
    (output and state), and every position's state against a prefix forward. None when equal."""
    from mlx_lm.models.cache import ArraysCache

    dtype = _param_dtype(mixer)
    x = (0.5 * mx.random.normal((1, 5, int(mixer.hidden_size)), key=mx.random.key(7))).astype(dtype)
    try:
        ref_c = ArraysCache(2)
        base = type(mixer).__mro__[1]
        base.__call__(mixer, x[:, :2], None, ref_c)
        pre = list(ref_c.cache)
        ref = base.__call__(mixer, x[:, 2:], None, ref_c)
        ours_c = RecurrentCache(2)
        ours_c.cache = list(pre)
        ours = _gdn_capture(mixer, x[:, 2:], ours_c)
        diffs = [_diff(ref, ours)] + [_diff(a, b) for a, b in zip(ref_c.cache, ours_c.cache)]
        one_c = ArraysCache(2)
        one_c.cache = list(pre)
        base.__call__(mixer, x[:, 2:3], None, one_c)
        ours_c.trim(2)  # back to the state after the first of the 3 positions
        diffs += [_diff(a, b) for a, b in zip(one_c.cache, ours_c.cache)]
    except Exception as e:  # noqa: BLE001 - any failure means: do not speculate on this layer
        return f"gmlx's capture forward failed on it ({type(e).__name__}: {e})"
    tol = 1e-5 if dtype == mx.float32 else 1e-2
    worst = max(diffs)
    if worst > tol:
        return f"gmlx's capture forward differs from mlx-lm's by {worst:.3g} (mlx-lm changed this layer?)"
    return None


def _diff(a, b) -> float:
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    return float(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item())  # sync: at load, once


def _param_dtype(m: nn.Module):
    w = getattr(m.out_proj, "weight", None)
    if w is None or w.dtype in (mx.uint32, mx.int32, mx.uint8):
        s = getattr(m.out_proj, "scales", None)
        return s.dtype if s is not None else mx.float32
    return w.dtype


def _projections(layer: nn.Module, inputs: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """(the conv's input qkv [B, S, C], z [B, S, Hv, Dv], b, a) as the family's __call__ makes them."""
    B, S, _ = inputs.shape
    if hasattr(layer, "in_proj_qkvz"):  # Qwen3-Next
        q, k, v, z, b, a = layer.fix_query_key_value_ordering(layer.in_proj_qkvz(inputs), layer.in_proj_ba(inputs))
        mixed = mx.concatenate([q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], axis=-1)
        return mixed, z, b, a
    mixed = layer.in_proj_qkv(inputs)  # Qwen3.5
    z = layer.in_proj_z(inputs).reshape(B, S, layer.num_v_heads, layer.head_v_dim)
    return mixed, z, layer.in_proj_b(inputs), layer.in_proj_a(inputs)


def _gdn_capture(layer: nn.Module, inputs: mx.array, cache: RecurrentCache) -> mx.array:
    """The Gated DeltaNet forward of mlx-lm (qwen3_next / qwen3_5 `__call__`, unmasked), keeping
    the state and conv window after every position in the cache's journal."""
    mod = _family_module(layer)
    B, S, _ = inputs.shape
    group = getattr(layer, "sharding_group", None)
    if group is not None:
        from mlx.nn.layers.distributed import sum_gradients

        inputs = sum_gradients(group)(inputs)
    mixed, z, b, a = _projections(layer, inputs)
    n_keep = layer.conv_kernel_size - 1
    conv_state = cache[0] if cache[0] is not None else mx.zeros((B, n_keep, layer.conv_dim), dtype=inputs.dtype)
    conv_input = mx.concatenate([conv_state, mixed], axis=1)
    conv_out = nn.silu(layer.conv1d(conv_input))
    q, k, v = [
        t.reshape(B, S, h, d)
        for t, h, d in zip(
            mx.split(conv_out, [layer.key_dim, 2 * layer.key_dim], -1),
            [layer.num_k_heads, layer.num_k_heads, layer.num_v_heads],
            [layer.head_k_dim, layer.head_k_dim, layer.head_v_dim],
        )
    ]
    q, k = mod.normalize_qk(q, k, inv_scale=layer.head_k_dim**-0.5, eps=1e-6)
    out, states = _delta_steps(mod, q, k, v, a, b, layer.A_log, layer.dt_bias, cache[1], not layer.training)
    snaps = [(conv_input[:, t:t + n_keep], states[t - 1]) for t in range(1, S)]
    snaps.append((mx.contiguous(conv_input[:, -n_keep:, :]), states[-1]))
    cache.record(snaps)
    out = layer.norm(out, z)
    out = layer.out_proj(out.reshape(B, S, -1))
    if group is not None:
        out = mx.distributed.all_sum(out, group=group)
    return out


def _delta_steps(mod, q, k, v, a, b, A_log, dt_bias, state, use_kernel: bool) -> tuple[mx.array, list[mx.array]]:
    """mlx-lm's `gated_delta_update` (as the family module calls it), position by position:
    the output [B, S, Hv, Dv] and the state after each position. The same kernel or ops mlx-lm
    would pick for this shape and device, so the numbers are mlx-lm's."""
    gd = sys.modules[mod.gated_delta_update.__module__]
    B, S, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    kernel = (use_kernel and mx.default_device() == mx.gpu and mx.metal.is_available()
              and Dk >= 32 and Dk % 32 == 0)
    step = getattr(gd, "_gated_delta_step_ops", None)
    if kernel or step is None:  # one call of mlx-lm's update per position
        ys, states = [], []
        for t in range(S):
            y, state = mod.gated_delta_update(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], a[:, t:t + 1],
                                              b[:, t:t + 1], A_log, dt_bias, state, None, use_kernel=use_kernel)
            ys.append(y)
            states.append(state)
        return mx.concatenate(ys, axis=1), states
    # gated_delta_update -> gated_delta_ops, written out so each position's state is kept
    beta = mx.sigmoid(b)
    g = gd.compute_g(A_log, a, dt_bias)
    if (r := Hv // Hk) > 1:
        q = mx.repeat(q, r, -2)
        k = mx.repeat(k, r, -2)
    ys, states = [], []
    for t in range(S):
        y, state = step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state, None)
        ys.append(y)
        states.append(state)
    return mx.stack(ys, axis=1), states


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


def describe(model: nn.Module, blockers: Sequence[str] = ()) -> str | None:
    """One line for `gmlx doctor`: the recurrent layers and how they roll back (None: no such layer)."""
    found = recurrent_layers(model)
    if not found:
        return None
    layers = getattr(model, "layers", None) or model.model.layers
    names = sorted({type(m).__name__ if (m := mixer_of(layer)) is not None else _mixer_name(layer)
                    for _, layer, _ in found})
    how = ("not rolled back: decodes plain" if blockers else "rolled back per row by per-position capture (a verify"
           f" of k = 3 costs ~{100 * CAPTURE_COST[3]:.0f} % more at width 1, ~4 % at width 8: benchmarks/bench_hybrid.py)")
    return f"hybrid: {len(found)} of {len(layers)} layers recurrent ({', '.join(names)}), {how}"


# What the capture and the per-row rollback add to a verify forward of k+1 tokens (a fraction
# of it), measured by benchmarks/bench_hybrid.py on a tiny hybrid on this project's 2-core CPU
# (bench_results/20261201T173353Z_hybrid.md: width 1, the mean of the Qwen3-Next and Qwen3.5
# layouts, 21 interleaved pairs; widths 2-8 add 1-4 %, the per-row gather). The engine's probe
# times a hybrid target's verify on its own caches, capture included; these figures scale the
# built-in prior instead when nothing is measured (GMLX_ROUND_COSTS=prior, or a probe that failed).
CAPTURE_COST = {1: 0.015, 2: 0.015, 3: 0.01, 4: 0.015}


def captures(model: nn.Module) -> bool:
    """Whether this model's recurrent layers run the capture forward (a hybrid that speculates)."""
    return any(getattr(type(mixer_of(layer)), "_gmlx_capture", False) for _, layer, _ in recurrent_layers(model))


def prior_verify(verify: Sequence[float], model: nn.Module) -> tuple[float, ...]:
    """The cost model's prior verify[k] for this target: a hybrid's grows by CAPTURE_COST[k]."""
    if not captures(model):
        return tuple(verify)
    last = CAPTURE_COST[max(CAPTURE_COST)]
    return tuple(v if k == 0 else v * (1.0 + CAPTURE_COST.get(k, last)) for k, v in enumerate(verify))
