"""gmlx's small-M sgemm (gmlx/native/small_gemm.c, loaded by gmlx/small_gemm.py): the values it
computes, that a row's values do not depend on the rows beside it, that it takes MLX's decode
matmuls in the user's environment and leaves the rest to OpenBLAS, and that a process runs on
without it (switched off, no compiler) and after a fork."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from numerics import assert_close
from user_path_helpers import user_env

from gmlx import blas, small_gemm

ROOT = Path(__file__).resolve().parents[1]
LINUX = sys.platform.startswith("linux")
needs_kernel = pytest.mark.skipif(not small_gemm.active(), reason=f"not in use here: {small_gemm.state()}")
F, I, P = ctypes.c_float, ctypes.c_int, ctypes.c_void_p


def _env(home: Path, **extra: str) -> dict[str, str]:
    """The user's environment (user_path_helpers.user_env: no pins, a fresh HOME and cache, so the
    kernel is built there as on a first run), with this checkout and tests/ importable."""
    return user_env(home, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}", **extra)


def _run(code: str, env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _sgemm(M, N, K, alpha, A, lda, B, ldb, beta, C, ldc) -> None:
    """The kernel's cblas_sgemm called directly: row-major C = alpha A B^T + beta C."""
    fn = small_gemm._state["lib"].cblas_sgemm
    fn.argtypes = [I] * 6 + [F, P, I, P, I, F, P, I]
    fn(101, 111, 112, M, N, K, alpha, A.ctypes.data, lda, B.ctypes.data, ldb, beta, C.ctypes.data, ldc)


@needs_kernel
@pytest.mark.numerics
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 9, 16])
@pytest.mark.parametrize("k,n", [(1, 1), (7, 3), (17, 5), (64, 129), (576, 1536)])
def test_mlx_matmuls_match_float64_through_the_kernel_and_past_its_rows(m, k, n):
    """x @ W.T as a model's Linear computes it (W stored out x in); 9 and 16 rows go to OpenBLAS."""
    rng = np.random.default_rng(m * 1000 + k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    before = small_gemm.counts()
    got = np.array(mx.array(x) @ mx.array(w).T)
    assert_close(got, x.astype(np.float64) @ w.T.astype(np.float64), dtype=mx.float32, msg=f"{m}x{k}x{n}")
    ours, theirs = (a - b for a, b in zip(small_gemm.counts(), before))
    if min(k, n) == 1:  # W.T is then contiguous as it stands: MLX passes it untransposed, to OpenBLAS
        assert (ours, theirs) == (0, 1)
    else:  # which one computed it
        assert (ours, theirs) == ((1, 0) if m <= small_gemm.ROW_LIMIT else (0, 1))


@needs_kernel
@pytest.mark.numerics
def test_strides_alpha_and_beta_are_honoured_and_nothing_outside_c_is_written():
    rng = np.random.default_rng(1)
    for m, n, k in [(1, 5, 33), (4, 1536, 576), (8, 7, 16), (3, 70000 // 64, 64)]:
        a = rng.standard_normal((m, k + 3)).astype(np.float32)
        b = rng.standard_normal((n, k + 1)).astype(np.float32)
        c = rng.standard_normal((m, n + 2)).astype(np.float32)
        c0 = c.copy()
        _sgemm(m, n, k, 1.5, a, k + 3, b, k + 1, 0.5, c, n + 2)
        want = 1.5 * (a[:, :k].astype(np.float64) @ b[:, :k].T.astype(np.float64)) + 0.5 * c0[:, :n]
        assert_close(c[:, :n], want, dtype=mx.float32, msg=f"{m}x{k}x{n}")
        assert (c[:, n:] == c0[:, n:]).all()
        nan = np.full((m, n), np.nan, np.float32)  # beta 0: C is not read
        _sgemm(m, n, k, 1.0, a, k + 3, b, k + 1, 0.0, nan, n)
        assert np.isfinite(nan).all()


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(k=st.integers(1, 300), n=st.integers(1, 300), rows=st.integers(2, small_gemm.ROW_LIMIT),
       row=st.integers(0, small_gemm.ROW_LIMIT - 1))
def test_a_rows_values_are_the_same_bits_whatever_rows_are_computed_beside_it(k, n, rows, row):
    """Why it matters: a verify of a row and its drafts gives the row exactly the logits a plain
    step gives it, so plain and speculative decoding agree bit for bit wherever both fit."""
    row = row % rows
    rng = np.random.default_rng(k * 301 + n)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w = mx.array(rng.standard_normal((n, k)).astype(np.float32))
    alone = np.array(mx.array(x[row:row + 1]) @ w.T)
    together = np.array(mx.array(x) @ w.T)
    assert (alone[0] == together[row]).all()


@needs_kernel
def test_two_threads_calling_at_once_both_get_their_products():
    """The pool runs one job at a time; a second caller computes alone (not a wrong answer)."""
    rng = np.random.default_rng(2)
    w = rng.standard_normal((2048, 576)).astype(np.float32)
    xs = [rng.standard_normal((4, 576)).astype(np.float32) for _ in range(2)]
    outs = [np.zeros((4, 2048), np.float32) for _ in range(2)]
    bad = []

    def work(i):
        for _ in range(200):
            _sgemm(4, 2048, 576, 1.0, xs[i], 576, w, 576, 0.0, outs[i], 2048)
            if not np.allclose(outs[i], xs[i] @ w.T, rtol=1e-4, atol=1e-3):
                bad.append(i)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    [t.start() for t in threads]
    [t.join(timeout=120) for t in threads]
    assert not bad and not any(t.is_alive() for t in threads)


@needs_kernel
def test_back_to_back_jobs_from_two_processes_all_finish_with_their_products(tmp_path):
    """Jobs handed to the pool back to back while another process competes for the cores (workers
    preempted anywhere): each finishes, right. A worker that read a finished job's generation late
    once took a slab of the next job while the caller was writing it, and the caller's reset of
    the count of finished slabs lost that slab: the caller waited forever (seen once in CI, both
    test processes spinning in the pool's wait; generations are now closed while a job is written)."""
    code = ("import gmlx, numpy as np\nimport test_small_gemm as t\nrng = np.random.default_rng(0)\n"
            "w = rng.standard_normal((256, 512)).astype(np.float32)\nx = rng.standard_normal((2, 512)).astype(np.float32)\n"
            "want = x @ w.T\nc = np.zeros((2, 256), np.float32)\nbad = 0\nfor i in range(30000):\n"
            "    t._sgemm(2, 256, 512, 1.0, x, 512, w, 512, 0.0, c, 256)\n"
            "    bad += i % 100 == 0 and not np.allclose(c, want, rtol=1e-4, atol=1e-3)\nprint('bad', bad)")
    env = _env(tmp_path)
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        [p.kill() for p in procs]
    assert all(p.returncode == 0 and o.strip().endswith("bad 0") for p, o in zip(procs, outs)), outs


@pytest.mark.skipif(not LINUX, reason="the kernel is built on Linux only")
def test_the_users_environment_runs_decode_matmuls_through_the_kernel_and_large_ones_through_openblas(tmp_path):
    code = ("import gmlx, mlx.core as mx\nfrom gmlx import blas, small_gemm\nw = mx.ones((1536, 576))\n"
            "mx.eval(mx.ones((2, 576)) @ w.T)  # sync: the test's\nmx.eval(mx.ones((64, 576)) @ w.T)  # sync: ditto\n"
            "print(blas.active_blas()); print(small_gemm.counts())")
    out = _run(code, _env(tmp_path))
    if "OpenBLAS" not in out:
        pytest.skip(f"no OpenBLAS here: {out}")
    assert f"small-M kernel for <= {small_gemm.ROW_LIMIT} rows" in out, out
    assert out.strip().splitlines()[-1] == "(1, 1)", out


@pytest.mark.skipif(not LINUX, reason="OpenBLAS is loaded on Linux only")
@pytest.mark.parametrize("given,expected", [(None, blas.THREAD_TIMEOUT), ("12", "12")])
def test_openblas_loads_with_its_idle_workers_sleeping_after_a_job_unless_the_user_set_it(given, expected, tmp_path):
    """OpenBLAS reads OPENBLAS_THREAD_TIMEOUT once, when it loads: gmlx sets it (gmlx/blas.py's doc) before
    that, and a value the user gave stays. (This process imported gmlx: its own value is dropped here.)"""
    env = {k: v for k, v in _env(tmp_path).items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    env |= {"OPENBLAS_THREAD_TIMEOUT": given} if given else {}
    code = "import os, gmlx\nfrom gmlx import blas\nprint(blas.active_blas())\nprint(os.environ['OPENBLAS_THREAD_TIMEOUT'])"
    out = _run(code, env)
    if "OpenBLAS" not in out:
        pytest.skip(f"no OpenBLAS here: {out}")
    assert out.strip().splitlines()[-1] == expected and f"OPENBLAS_THREAD_TIMEOUT={expected}" in out, out


@pytest.mark.skipif(not LINUX, reason="the kernel is built on Linux only")
@pytest.mark.parametrize("env,reason", [({"GMLX_SMALL_GEMM": "0"}, "GMLX_SMALL_GEMM=0"),
                                        ({"CC": "/nonexistent/cc"}, "could not build it")])
def test_without_the_kernel_matmuls_run_on_openblas_and_the_reason_is_reported(env, reason, tmp_path):
    code = ("import gmlx, mlx.core as mx\nfrom gmlx import blas, small_gemm\n"
            "print(blas.active_blas()); print((mx.ones((2, 8)) @ mx.ones((3, 8)).T).tolist())  # sync: the test's")
    out = _run(code, _env(tmp_path / "home", GMLX_CACHE=str(tmp_path), **env))
    assert f"small-M kernel off ({reason}" in out, out
    assert "[[8.0, 8.0, 8.0], [8.0, 8.0, 8.0]]" in out
    assert not list(tmp_path.glob("native/*.so"))


@pytest.mark.skipif(not LINUX, reason="the kernel is built on Linux only")
def test_a_forked_child_multiplies_after_the_parents_pool_ran(tmp_path):
    """The workers are not copied into a fork: the child starts its own on first use (a pool that
    waited for the parent's workers would hang the child)."""
    code = ("import gmlx, os, numpy as np\nfrom gmlx import small_gemm\nimport test_small_gemm as t\n"
            "a, w = np.ones((2, 576), np.float32), np.ones((4096, 576), np.float32)\n"
            "c = np.zeros((2, 4096), np.float32)\nt._sgemm(2, 4096, 576, 1.0, a, 576, w, 576, 0.0, c, 4096)\n"
            "pid = os.fork()\nif pid == 0:\n    c[:] = 0\n    t._sgemm(2, 4096, 576, 1.0, a, 576, w, 576, 0.0, c, 4096)\n"
            "    os._exit(0 if (c == 576).all() else 3)\n_, status = os.waitpid(pid, 0)\n"
            "print(small_gemm.state(), 'child', status)")
    out = _run(code, _env(tmp_path))
    if "kernel off" in out:
        pytest.skip(out)
    assert out.strip().endswith("child 0"), out


@pytest.mark.skipif(not LINUX, reason="the kernel is built on Linux only")
def test_the_build_is_cached_per_source_and_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("GMLX_CACHE", str(tmp_path))
    path, why = small_gemm.build()
    if path is None:
        pytest.skip(f"no compiler here: {why}")
    assert path.parent == tmp_path / "native" and path.stat().st_size > 0
    built = path.stat().st_mtime_ns
    again, _ = small_gemm.build()
    assert again == path and again.stat().st_mtime_ns == built  # not built again
    monkeypatch.setattr(small_gemm, "cpu_identity", lambda: "another CPU")
    other, _ = small_gemm.build()
    assert other is not None and other != path


def test_the_active_blas_names_the_kernels_state():
    if blas.is_fast() and LINUX:
        assert "small-M kernel" in blas.active_blas()
