"""Fused RMSNorm and RoPE for MLX's CPU backend: the same operations, dispatched as fewer.

Why: on the GPU backends `mx.fast.rms_norm` and `mx.fast.rope` are one kernel each; on the CPU
backend MLX builds each from its fallback graph (a norm: astype, square, sum, rsqrt and four
multiplies with their broadcasts; a rotary embedding: an arange, an exp chain, cos, sin, the
rotation and a concatenate), and every operation is one task for the CPU stream's scheduler at
~5-15 us each. SmolLM2-135M's one-token forward was 4,071 operations, ~10 ms of a 30 ms step.
Traced through `mx.compile`, each becomes the same graph with its elementwise chains fused (2,563
operations a forward): its results are the same (tests/test_cpu_fused.py; the compiled kernels run
the same float32 operations in the same order: here bit-identical, logits max |diff| 0.0; a compiler
that contracts a multiply and an add rounds once instead of twice), and on this repository's 2-core CPU
SmolLM2 decoded plain 1.04-1.19x faster (bench_results/20261206T002555Z; docs/cpu_kernel.md).

A rotary embedding goes further: its angles depend only on the positions, the same in every layer,
yet each call computed them again (an arange, an exp chain, a cos and a sin: ~8 operations, 60 calls
a SmolLM2 forward). Here the calls of one forward (`one_forward`, around the target's forwards) share
them, computed once with the fallback's own operations — at a KVCache's int offset, or at a batch's
per-row offsets (every layer's RaggedKVCache holds one array: gmlx/kv.py) — and each call is one
compiled rotation over them, x * [cos, cos] + swap(x) * [-sin, sin] (the same products, summed in the
same order: bit-identical here; tests/test_cpu_fused.py): SmolLM2's one-token forward 2,629 -> 2,172
operations (`ANGLES`; docs/cpu_kernel.md).

How: the loaded model's own `nn.RMSNorm` and `nn.RoPE` modules (exactly those classes, not their
subclasses: Llama-3 or YaRN rotary embeddings keep mlx-lm's code) are given a subclass whose call
runs a compiled function: the norm's shapeless (its graph does not depend on the rows; one trace
per hidden size and eps), the rotary embedding's traced per input shape (its positions are
arange(L) + offset) with the offset as an array input, so a new position is no new trace. Only on
the CPU backend, and not under GMLX_COMPILE=0.

mlx-lm's own loops run the same model objects: a benchmark's mlx-lm arm runs them unfused inside
`as_mlx_lm()` (per thread), as users of mlx-lm run them.
"""

from __future__ import annotations

import contextlib
import threading

import mlx.core as mx
import mlx.nn as nn

from gmlx.compiled import enabled

_local = threading.local()  # .unfused: this thread runs mlx-lm's own calls (as_mlx_lm)
# One thread at a time in a compiled call: a new shape traces the function (Python, the GIL released
# between bytecodes) into MLX's compile cache, which two engines' threads must not fill at once.
_lock = threading.Lock()
_norms: dict[tuple, object] = {}  # (eps, hidden size) -> compiled rms_norm
_ropes: dict[tuple, object] = {}  # (dims, traditional, base, scale) -> compiled rope
# Rotary angles shared by the calls of one forward (the module docstring); off: each call computes
# them (the compiled fallback), for the A/B in benchmarks/bench_cpu_fused.py and tests.
ANGLES = True


@contextlib.contextmanager
def as_mlx_lm():
    """Within this block this thread runs the models' norms and rotary embeddings unfused:
    exactly mlx-lm's operations (a benchmark's mlx-lm arm)."""
    before = getattr(_local, "unfused", False)
    _local.unfused = True
    try:
        yield
    finally:
        _local.unfused = before


def _norm_fn(eps: float, dims: int):
    key = (eps, dims)
    if key not in _norms:
        _norms[key] = mx.compile(lambda x, w: mx.fast.rms_norm(x, w, eps), shapeless=True)
    return _norms[key]


def _rope_fn(dims: int, traditional: bool, base: float, scale: float):
    key = (dims, traditional, base, scale)
    if key not in _ropes:
        _ropes[key] = mx.compile(lambda x, offset: mx.fast.rope(
            x, dims, traditional=traditional, base=base, scale=scale, offset=offset))
    return _ropes[key]


@contextlib.contextmanager
def one_forward():
    """The rotary embeddings called within share their angles (the module docstring): kept for this
    thread's block only — nothing outlives the forward, and a graph kept is evaluated by the thread
    that built it (two threads evaluating one unevaluated array at once is a race in MLX: wrong
    values and a crash, seen with 4 threads in tests/test_cpu_fused.py). Nests."""
    before = getattr(_local, "angles", None)
    _local.angles = {}
    try:
        yield
    finally:
        _local.angles = before


def _angles(dims: int, base: float, scale: float, offset, length: int) -> tuple[mx.array, mx.array]:
    """[cos, cos] and [-sin, sin] at positions offset + arange(length) — [length, dims] at an int
    offset, [B, 1, length, dims] at a batch's per-row offsets [B] — computed as mx.fast.rope's CPU
    fallback computes them (its angles bit for bit); shared within `one_forward`."""
    kept_here = getattr(_local, "angles", None)
    key = (dims, base, scale, offset if isinstance(offset, int) else id(offset), length)
    kept = kept_here.get(key) if kept_here is not None else None
    if kept is None:
        half = dims // 2
        inv_freq = mx.exp(-mx.arange(half).astype(mx.float32) * (mx.log(mx.array(base, mx.float32)) / half))
        if isinstance(offset, int):
            theta = ((mx.arange(length) + offset).astype(mx.float32) * scale)[:, None] * inv_freq[None]
        else:
            theta = ((offset[:, None] + mx.arange(length)).astype(mx.float32) * scale)[..., None] * inv_freq
        cos, sin = mx.cos(theta), mx.sin(theta)
        cos, sin = mx.concatenate([cos, cos], -1), mx.concatenate([-sin, sin], -1)
        if not isinstance(offset, int):
            cos, sin = cos[:, None], sin[:, None]  # over the heads
        kept = (cos, sin, offset)  # (an array offset kept with them: its identity stays its own meanwhile)
        if kept_here is not None:
            kept_here[key] = kept
    return kept[0], kept[1]


@mx.compile
def _rotate(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """The rotation of rope's default (non-traditional) layout: halves (x1, x2) -> (x1 cos - x2 sin,
    x1 sin + x2 cos), as x * [cos, cos] + (x2, x1) * [-sin, sin] (x1 cos + x2 (-sin) is x1 cos - x2 sin
    exactly); one fused kernel over a view that swaps the halves."""
    shape = x.shape
    swapped = x.reshape(*shape[:-1], 2, shape[-1] // 2)[..., ::-1, :].reshape(shape)
    return x * cos + swapped * sin


class FusedRMSNorm(nn.RMSNorm):
    """nn.RMSNorm through a compiled graph (the module docstring)."""

    def __call__(self, x: mx.array) -> mx.array:
        if getattr(_local, "unfused", False):
            return super().__call__(x)
        with _lock:
            return _norm_fn(self.eps, self.weight.shape[-1])(x, self.weight)


class FusedRoPE(nn.RoPE):
    """nn.RoPE through a compiled graph, its offset an array input (the module docstring)."""

    def __call__(self, x: mx.array, offset=0) -> mx.array:
        if getattr(_local, "unfused", False):
            return super().__call__(x, offset)
        if ANGLES and (isinstance(offset, int) or isinstance(offset, mx.array) and offset.shape == x.shape[:1]) \
                and not self.traditional and self.dims == x.shape[-1] and x.dtype == mx.float32:
            with _lock:
                return _rotate(x, *_angles(self.dims, self.base, self.scale, offset, x.shape[-2]))
        if not isinstance(offset, mx.array):
            offset = mx.array(offset, dtype=mx.int32)
        with _lock:
            return _rope_fn(self.dims, self.traditional, self.base, self.scale)(x, offset)


FUSED = {nn.RMSNorm: FusedRMSNorm, nn.RoPE: FusedRoPE}  # mlx-lm's class -> its fused subclass


def wanted() -> bool:
    """Whether loaded models are fused here: MLX's CPU backend, compilation on."""
    return mx.default_device().type == mx.cpu and enabled()


def install(module: nn.Module) -> int:
    """Give every nn.RMSNorm and nn.RoPE inside `module` its fused class (where `wanted`); the
    number changed. Their weights and attributes stay the same objects."""
    if not wanted():
        return 0
    n = 0
    for _, m in module.named_modules():
        fused = FUSED.get(type(m))
        if fused is not None:
            m.__class__ = fused
            n += 1
    return n
