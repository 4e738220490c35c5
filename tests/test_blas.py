"""The BLAS gmlx loads gives the same matmul results as numpy."""

import mlx.core as mx
import numpy as np
import pytest
from numerics import assert_close

from gmlx import blas


@pytest.mark.numerics
def test_matmul_matches_numpy_under_loaded_blas():
    rng = np.random.default_rng(0)
    for m, k, n in [(1, 256, 256), (7, 300, 129), (256, 256, 256)]:
        a = rng.standard_normal((m, k)).astype(np.float32)
        b = rng.standard_normal((k, n)).astype(np.float32)
        got = np.array(mx.array(a) @ mx.array(b))
        ref = a.astype(np.float64) @ b.astype(np.float64)
        assert_close(got, ref, dtype=mx.float32, msg=f"{m}x{k}x{n}")  # vs float64: float32 rounding


def test_active_blas_is_reported():
    desc = blas.active_blas()
    assert desc
    if blas.is_fast():
        assert "OpenBLAS" in desc or "platform" in desc
