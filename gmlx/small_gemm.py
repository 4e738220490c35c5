"""gmlx's small-M sgemm for MLX's CPU backend on Linux (gmlx/native/small_gemm.c; why and what it
computes: that file's comment; measurements: docs/cpu_kernel.md).

Built from its C source with the machine's compiler on first use (`cc -O3 -march=native`, about a
second), cached under gmlx's cache directory keyed by the source, the compiler, the flags and the
CPU, and loaded with RTLD_GLOBAL *before* OpenBLAS, so that MLX's `cblas_sgemm` resolves to it;
the calls it does not take go to OpenBLAS through the handle given at init. gmlx/blas.py calls
`load` while loading OpenBLAS, before `mlx.core` is imported. Without a compiler, with
GMLX_SMALL_GEMM=0, or off Linux, nothing changes: MLX's matmuls are OpenBLAS's, and `state()`
says why."""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from gmlx import switches
from gmlx.errors import ConfigError

SOURCE = Path(__file__).parent / "native" / "small_gemm.c"
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-pthread")
# Rows (tokens x batch rows) up to which the kernel runs. Since it prefetches the weights
# (2026-12-07), SmolLM2's forward of 12 tokens took 0.69-0.70 of OpenBLAS's time, of 16 0.95-0.97,
# of 24 0.97-0.99, of 32 1.18-1.24 (an Intel Xeon, OpenBLAS on its AVX-512 kernels); on an AMD EPYC
# before the prefetch 12 tokens already ran faster through the kernel and 16 slower
# (docs/cpu_kernel.md, "Prefetching the weights"): 12 is within both.
ROW_LIMIT = 12
BUILD_SECONDS = 120

_state: dict = {"lib": None, "threads": 0, "reason": "not loaded"}


def _enabled() -> bool:
    try:
        return bool(switches.SMALL_GEMM.value())
    except ConfigError:  # at `import gmlx`, before any boundary: as by default; switches.check() says it
        return True


def cpu_identity() -> str:
    """What -march=native compiles for: the CPU's model and flags (a cache shared across machines
    must not hand one machine's instructions to another; gmlx/openblas_core.py keys its answers by it too)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    keep = [ln for ln in lines if ln.split(":")[0].strip() in ("model name", "flags", "Features", "CPU part")]
    return "\n".join(dict.fromkeys(keep))


def _cache_dir() -> Path:
    return switches.cache_root() / "native"


def build() -> tuple[Path | None, str]:
    """The compiled library (built now if not cached), or (None, why not)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        return None, "no C compiler (cc) to build it"
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, cc.encode(), " ".join(FLAGS).encode(), platform.machine().encode(),
                                     cpu_identity().encode()])).hexdigest()[:16]
    out = _cache_dir() / f"small_gemm-{key}.so"
    if out.is_file():
        return out, ""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:  # built aside, then renamed: racing builds are safe
            part = Path(tmp) / out.name
            done = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(part), "-ldl"], capture_output=True, text=True,
                                  timeout=BUILD_SECONDS)
            if done.returncode != 0:
                return None, f"{Path(cc).name} failed: {(done.stderr.strip().splitlines() or ['?'])[-1][:200]}"
            os.replace(part, out)
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"could not build it ({e})"
    return out, ""


def load(blas: ctypes.CDLL) -> bool:
    """Build and load the kernel into the global scope; `blas` (loaded RTLD_LOCAL, to enter the
    global scope after the kernel) computes every call the kernel does not take. False (and
    `state()` says why) if off."""
    if platform.system() != "Linux":
        _state["reason"] = "not Linux"
        return False
    if not _enabled():
        _state["reason"] = "GMLX_SMALL_GEMM=0"
        return False
    path, why = build()
    if path is None:
        _state["reason"] = why
        return False
    try:
        lib = ctypes.CDLL(str(path))  # local until it has the BLAS to pass calls to
        threads = lib.gmlx_small_gemm_init(ctypes.c_void_p(blas._handle), ROW_LIMIT, 0)
        if threads <= 0:
            _state["reason"] = f"{blas._name} has no cblas_sgemm"
            return False
        ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)  # now ahead of the BLAS for MLX's symbols
    except OSError as e:
        _state["reason"] = f"could not load it ({e})"
        return False
    _state.update(lib=lib, threads=threads, reason="")
    return True


def state() -> str:
    """One line: the kernel in use, or why not."""
    if _state["lib"] is None:
        return f"small-M kernel off ({_state['reason']})"
    return f"gmlx small-M kernel for <= {ROW_LIMIT} rows, {_state['threads']} threads"


def active() -> bool:
    return _state["lib"] is not None


def counts() -> tuple[int, int]:
    """(calls the kernel computed, calls it passed to the BLAS) in this process."""
    lib = _state["lib"]
    if lib is None:
        return 0, 0
    small, blas = ctypes.c_long(), ctypes.c_long()
    lib.gmlx_small_gemm_counts(ctypes.byref(small), ctypes.byref(blas))
    return small.value, blas.value
