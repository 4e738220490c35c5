"""Load a fast BLAS for MLX's CPU backend on Linux, before `mlx.core` is first imported.

The Linux mlx-cpu wheel links a bundled reference BLAS (netlib): an fp32 matmul runs at about
5 GFLOP/s on a 2-core EPYC, against ~180 GFLOP/s with Debian's OpenBLAS loaded first with
RTLD_GLOBAL, so that MLX's `sgemm_` resolves to it (results agree to fp32 rounding). Without it a
verify forward costs ~L times a decode step and speculation cannot pay. This module must be
imported before anything imports `mlx.core`; `gmlx/__init__.py` does that first.

OpenBLAS's idle workers spin for 2^28 cycles (~0.13 s at 2.1 GHz) after each call before they
sleep, holding cores that the next matmuls need: a plain batch round right after speculative ones
(whose verify went to OpenBLAS: more rows than the small-M kernel takes) ran ~1.3-1.45x its steady
period (the embedded model at width 4: the small-M kernel's rounds), and a prefill slowed the plain
rounds after it the same way.
So unless the user set OPENBLAS_THREAD_TIMEOUT, it is set to 20 before the library loads: 2^20
cycles (~0.5 ms here) outlast the gaps between one forward's matmuls (a sleeping worker's wake-up
at every matmul cost a 16-row forward ~5 % at OpenBLAS's floor, 4) and end within a round.
Measured: docs/cpu_kernel.md "OpenBLAS's idle workers held the cores after every call". And where
the library would take the CPU for a Prescott (an OpenBLAS older than the CPU), OPENBLAS_CORETYPE is
set to the kernels the CPU runs before it loads, unless the user set one (gmlx/openblas_core.py).

Opt out with GMLX_OPENBLAS=0. `active_blas()` reports what is in use; `warn_if_reference()`
prints one line with the install command when only the reference BLAS is present; importing
gmlx after `mlx.core` warns once (RuntimeWarning) instead, since only the import order can fix it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import sys
import warnings

from gmlx import openblas_core, small_gemm, switches
from gmlx.errors import ConfigError

_CANDIDATES = (
    "libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "libopenblas.so",
)
INSTALL_HINT = "sudo apt-get install libopenblas0-pthread"

THREAD_TIMEOUT = "20"  # OPENBLAS_THREAD_TIMEOUT unless the user set one (the module's doc)

_state: dict = {"blas": None, "path": None, "reason": None, "timeout": None, "core": None, "set": ()}
_warned = False


def _opted_out() -> bool:
    try:
        return not switches.OPENBLAS.value()
    except ConfigError:  # at `import gmlx`, before any boundary: load as by default; switches.check() says it
        return False


def ensure_loaded() -> str:
    """Load OpenBLAS globally if we are on Linux, allowed, and MLX is not imported yet."""
    if _state["blas"] is not None:
        return _state["blas"]
    if platform.system() != "Linux":
        _state["blas"] = "platform default (Accelerate/Metal)" if platform.system() == "Darwin" else "platform default"
        return _state["blas"]
    if _opted_out():
        _state.update(blas="reference", reason="GMLX_OPENBLAS=0")
        return "reference"
    if "mlx.core" in sys.modules:
        _state.update(blas="reference", reason="mlx.core was imported before gmlx")
        _warn_imported_first()
        return "reference"
    # read once, when the library loads: what it read is what active_blas() reports
    users_timeout = "OPENBLAS_THREAD_TIMEOUT" in os.environ
    _state["timeout"] = os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", THREAD_TIMEOUT)
    why_core = openblas_core.prepare(_CANDIDATES)  # its kernels, where it would take this CPU for an old one
    _state["set"] = ((() if users_timeout else ("OPENBLAS_THREAD_TIMEOUT",))
                    + (("OPENBLAS_CORETYPE",) if why_core else ()))
    for name in _CANDIDATES:
        try:
            blas = ctypes.CDLL(name)  # local first: the small-M kernel must precede it in the global scope
        except OSError:
            continue
        small_gemm.load(blas)
        ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
        _state.update(blas="OpenBLAS", path=name, reason=None, core=_core(blas, why_core))
        return "OpenBLAS"
    _state.update(blas="reference", reason="libopenblas.so.0 not found")
    return "reference"


def _core(blas: ctypes.CDLL, why: str | None) -> str:
    """The kernels the loaded library runs (its core type), and why when gmlx chose them."""
    try:
        blas.openblas_get_corename.restype = ctypes.c_char_p
        core = blas.openblas_get_corename().decode()
    except (AttributeError, UnicodeDecodeError):
        return "core unknown"
    return f"core {core}" + (f" ({why})" if why else "")


def _warn_imported_first() -> None:
    """Said once, at `import gmlx`: MLX has already bound its BLAS symbols, so loading OpenBLAS
    now would change nothing, and the slowdown (about 2x on generation) is otherwise silent."""
    global _warned
    _warned = True  # warn_if_reference would say less about the same thing
    warnings.warn(
        "gmlx: mlx.core was imported before gmlx, so MLX keeps its bundled reference BLAS: CPU matmuls are much"
        " slower (generation about half as fast); import gmlx before mlx (or set GMLX_OPENBLAS=0 to choose the"
        " reference BLAS and silence this)", RuntimeWarning, stacklevel=_import_stacklevel())


def _import_stacklevel() -> int:
    """The stacklevel of the user's `import gmlx`: past gmlx's own frames; importlib's frames are
    not counted (warnings.warn skips them itself)."""
    frame, level = sys._getframe(1), 1
    while frame is not None:
        file = frame.f_code.co_filename
        if "importlib" in file and "_bootstrap" in file:
            frame = frame.f_back
            continue
        if not frame.f_globals.get("__name__", "").startswith("gmlx"):
            return level
        frame, level = frame.f_back, level + 1
    return 1


def active_blas() -> str:
    """A one-line description of the BLAS MLX's CPU matmuls use in this process."""
    blas = ensure_loaded()
    if blas == "OpenBLAS":
        return (f"OpenBLAS ({_state['path']}, {_state['core']}, OPENBLAS_THREAD_TIMEOUT={_state['timeout']});"
                f" {small_gemm.state()}")
    if blas == "reference":
        return f"reference netlib BLAS ({_state['reason']})"
    return blas


def variables_set() -> tuple[str, ...]:
    """The environment variables gmlx set for OpenBLAS in this process (a user's are never among
    them): a child process inherits them, and one that should choose as a user's would drops them."""
    return _state["set"]


def is_fast() -> bool:
    return ensure_loaded() != "reference"


def warn_if_reference(stream=None) -> None:
    """Warn once per process when MLX runs on the slow reference BLAS."""
    global _warned
    if _warned or is_fast() or _state["reason"] == "GMLX_OPENBLAS=0":
        return
    _warned = True
    print(
        f"gmlx: warning: MLX is using the reference BLAS ({_state['reason']}); CPU matmuls run ~30x slower"
        f" and speculation will not pay. Install OpenBLAS: {INSTALL_HINT}",
        file=stream or sys.stderr,
    )
