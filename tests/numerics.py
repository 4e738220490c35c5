"""One tolerance for values computed along different paths, and tie-aware stream checks.

Why: the same values computed with other shapes (a batch vs one row, a verify vs a decode step,
a chunked vs a whole prefill, a rebuilt vs a rolled-back cache) go through other kernels: OpenBLAS
picks its kernels per shape and per CPU (OPENBLAS_CORETYPE), so float32 sums run in another order,
and a GPU runs float32 matmuls at TF32 precision by default (MLX_ENABLE_TF32), on some shapes
only. Only the same shape recomputed on one machine is bit-exact; everything else is compared here.

How it scales: |got - want| <= tolerance(dtype) * max|want| element-wise (a dot product's rounding
error scales with its terms, not its result), with tolerance = REORDER * 2^-24 (float32 sums in
another order, amplified through a few layers: worst measured 174 x 2^-24, OPENBLAS_CORETYPE=Haswell)
+ ROUNDING * u, u the unit roundoff of reduced-precision arithmetic: 0 for float32 on the CPU, TF32
2^-11 for float32 on a GPU unless MLX_ENABLE_TF32=0, float16 2^-11, bfloat16 2^-8 (worst measured
5.8 x 2^-11 with GEMM operands rounded to TF32 and GEMVs not, an emulation of the GPU).
Token streams are compared tie-aware (gmlx.engine.oracle.compare_streams): a divergence is forgiven when
the top-2 margin there is below tie_margin(), the same tolerance on logits of magnitude ~16.
"""

from __future__ import annotations

import os

import gmlx  # noqa: F401  (loads OpenBLAS before mlx.core)
import mlx.core as mx
import numpy as np

from gmlx.engine.oracle import Comparison, compare_streams

REORDER = 1024
# A recurrent layer's state carried across two forwards (6 tokens, then 6) against one forward of all
# 12 runs its sums in another association over positions as well, and the next layers amplify it:
# worst measured 2551 x 2^-24 (Qwen3-Next's test model, OPENBLAS_CORETYPE=Haswell, a 2-core Xeon;
# 1448 with the CPU's own kernels there, 487 as SkylakeX; every other case of that test <= 118).
RECURRENT_REORDER = 4096
ROUNDING = 32
LOGIT_SCALE = 16  # the embedded model's largest |logit| (p99 15.5)
_REDUCED = {"float16": 2.0**-11, "bfloat16": 2.0**-8}
_TF32 = 2.0**-11


def on_gpu() -> bool:
    return mx.default_device().type == mx.DeviceType.gpu


def reduced_roundoff(dtype) -> float:
    """The unit roundoff of the operands' rounding in matmuls on `dtype` (0: none) on this device."""
    name = str(dtype).split(".")[-1]
    if name == "float32":
        return _TF32 if on_gpu() and os.environ.get("MLX_ENABLE_TF32", "1") != "0" else 0.0
    return _REDUCED.get(name, 0.0)


def tolerance(dtype=mx.float32, recurrent: bool = False) -> float:
    """Tolerance relative to the reference's largest magnitude, for cross-path comparisons
    (`recurrent`: a recurrent state carried across forwards on one path, RECURRENT_REORDER)."""
    return (RECURRENT_REORDER if recurrent else REORDER) * 2.0**-24 + ROUNDING * reduced_roundoff(dtype)


def _host(x) -> np.ndarray:
    return np.asarray(x.astype(mx.float32) if isinstance(x, mx.array) else x, dtype=np.float64)


def assert_close(got, want, *, dtype=None, msg: str = "", recurrent: bool = False) -> None:
    """`got` equals `want` to within the rounding of other kernels (see above). The tolerance
    follows the coarser of the two arrays' dtypes unless `dtype` is given; `recurrent`: tolerance's."""
    if dtype is None:
        dtypes = [x.dtype for x in (got, want) if isinstance(x, mx.array)] or [mx.float32]
        dtype = max(dtypes, key=tolerance)
    g, w = _host(got), _host(want)
    assert g.shape == w.shape, (g.shape, w.shape, msg)
    if not w.size:
        return
    scale = float(np.max(np.abs(w)))
    err = float(np.max(np.abs(g - w)))
    tol = tolerance(dtype, recurrent)
    assert err <= tol * scale, f"{msg}: max |diff| {err:.3g} > {tol * scale:.3g} = {tol:.3g} x max |ref| {scale:.3g}"


def tie_margin() -> float:
    """Top-2 margin below which two candidate tokens count as tied: 1e-3 on the CPU (float32
    logits move by ~1e-5 there), about 0.5 on a TF32 GPU."""
    return max(1e-3, tolerance(mx.float32) * LOGIT_SCALE)


def compare_tokens(lm, prompt, ref, got, params) -> Comparison:
    """gmlx.engine.oracle.compare_streams with this backend's tie margin."""
    return compare_streams(lm, list(prompt), list(ref), list(got), params, tol=tie_margin())


def same_stream(lm, prompt, ref, got, params) -> Comparison:
    """Assert `got` equals the reference stream `ref` except at a near-tie (where the rest of the
    streams may differ); returns the comparison, so a caller can check more when `.equal`."""
    c = compare_tokens(lm, prompt, ref, got, params)
    assert c.ok, f"stream diverged from its reference: {c}\nref {list(ref)}\ngot {list(got)}"
    return c
