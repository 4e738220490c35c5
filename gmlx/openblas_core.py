"""OpenBLAS's kernels on a CPU newer than the library: the core type, chosen before it loads.

OpenBLAS built with DYNAMIC_ARCH picks its kernels by the CPU's family and model when it loads,
and a model it does not know gets its Prescott (SSE3) kernels. Debian 12's OpenBLAS 0.3.21 does
not know Intel's Xeons since Sapphire Rapids: on a 2-core Xeon (family 6, model 207) SmolLM2's
forwards of 32 / 64 / 120 tokens (each matmul > the small-M kernel's rows: OpenBLAS's) took
233 / 425 / 767 ms on them, 140 / 237 / 449 with OPENBLAS_CORETYPE=SkylakeX (the AVX-512 kernels),
and every prompt's prefill runs through them (docs/cpu_kernel.md, "OpenBLAS took this Xeon for a
Prescott"). The library reads OPENBLAS_CORETYPE once, when it loads, so gmlx asks first: a child
process loads it and says which core it chose (kept under gmlx's cache directory per library file
and CPU, ~30 ms once). Where that is Prescott on a CPU with AVX-512 (or AVX2 and FMA, or AVX), gmlx
sets OPENBLAS_CORETYPE to the kernels the CPU runs (SkylakeX, Haswell, Sandybridge) before the
library loads. A core the library did recognise is never second-guessed, and a user's
OPENBLAS_CORETYPE (any value, "Prescott" included) is left alone.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from gmlx import small_gemm, switches
from gmlx.atomic_file import write_atomic

FALLBACK = "Prescott"  # what DYNAMIC_ARCH loads for an x86-64 CPU it does not know
# The kernels each CPU feature set runs, best first: the flags /proc/cpuinfo lists when the kernel
# enabled them (AVX-512 needs the OS to save its registers: the flag is absent otherwise).
CORES = (("SkylakeX", {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"}),
         ("Haswell", {"avx2", "fma"}),
         ("Sandybridge", {"avx"}))

# The child: load the first candidate that loads, say its name, file and core. Run with -S -E (no
# site, no PYTHON* variables): only ctypes, and no gmlx import (that would load OpenBLAS itself).
_PROBE = """
import ctypes, json, sys
for name in json.loads(sys.argv[1]):
    try:
        lib = ctypes.CDLL(name)
    except OSError:
        continue
    lib.openblas_get_corename.restype = ctypes.c_char_p
    core = lib.openblas_get_corename().decode()
    path = next((ln.split()[-1] for ln in open("/proc/self/maps") if "openblas" in ln and "/" in ln), name)
    print(json.dumps({"name": name, "path": path, "core": core}))
    break
"""


def core_for(detected: str | None, flags: set[str]) -> str | None:
    """The core type to set: the best this CPU's flags run, only where the library fell back to
    Prescott (a core it recognised, or an unknown answer, stays its own)."""
    if detected != FALLBACK:
        return None
    return next((core for core, needs in CORES if needs <= flags), None)


def cpu_flags() -> set[str]:
    """The CPU's flags, from the identity the kernel's build is keyed by (its /proc/cpuinfo lines)."""
    line = next((ln for ln in small_gemm.cpu_identity().splitlines() if ln.split(":")[0].strip() == "flags"), "")
    return set(line.split(":", 1)[1].split()) if ":" in line else set()


def _file_identity(path: str) -> list | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [str(Path(path).resolve()), st.st_size, st.st_mtime_ns]


def detected(candidates: tuple[str, ...]) -> dict | None:
    """What the library loads as with no OPENBLAS_CORETYPE: {"name", "path", "core"}, from the cache
    when the same library file was asked on this CPU, else from a child process (then kept)."""
    key = hashlib.sha256(json.dumps([candidates, small_gemm.cpu_identity()]).encode()).hexdigest()[:24]
    cached = switches.cache_root() / "openblas_core" / f"{key}.json"
    try:
        got = json.loads(cached.read_text())
        if got["file"] == _file_identity(got["path"]):
            return got
    except (OSError, ValueError, KeyError, TypeError):
        pass
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    try:
        done = subprocess.run([sys.executable, "-S", "-E", "-c", _PROBE, json.dumps(candidates)], env=env,
                              capture_output=True, text=True, timeout=10)
        got = json.loads(done.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None  # no child, or no library: the loader says what is missing
    got["file"] = _file_identity(got["path"])
    try:
        write_atomic(cached, json.dumps(got))
    except OSError:  # a read-only cache: asked again next time
        pass
    return got


def prepare(candidates: tuple[str, ...]) -> str | None:
    """Before OpenBLAS loads: set OPENBLAS_CORETYPE where the library would fall back to Prescott
    on a CPU that runs better kernels. Returns why it was set (None: left as it was)."""
    if "OPENBLAS_CORETYPE" in os.environ or sys.platform != "linux" or os.uname().machine != "x86_64":
        return None
    got = detected(candidates)
    core = core_for(got["core"] if got else None, cpu_flags())
    if core is None:
        return None
    os.environ["OPENBLAS_CORETYPE"] = core
    return f"set by gmlx: the library took this CPU for a {FALLBACK}"
