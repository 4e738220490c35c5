"""OpenBLAS's core type on a CPU newer than the library (gmlx/openblas_core.py): chosen before it
loads, only where the library would fall back to Prescott, never over the user's choice."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from gmlx import blas, openblas_core
from user_path_helpers import user_env

LINUX_X86 = sys.platform == "linux" and os.uname().machine == "x86_64"
VARIABLE = "OPENBLAS_CORETYPE"
AVX512 = {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl", "avx2", "fma", "avx"}


@pytest.mark.parametrize("detected,flags,expected", [
    ("Prescott", AVX512, "SkylakeX"),
    ("Prescott", {"avx2", "fma", "avx", "sse3"}, "Haswell"),
    ("Prescott", {"avx", "sse3"}, "Sandybridge"),
    ("Prescott", {"sse3"}, None),  # a real Prescott-class CPU: the library chose right
    ("Prescott", AVX512 - {"avx512vl"}, "Haswell"),  # (an AVX-512 subset SkylakeX's kernels do not run on)
    ("Haswell", AVX512, None),  # a core the library recognised is its own
    ("Zen", AVX512, None),
    (None, AVX512, None),  # the child could not say
])
def test_the_core_is_set_only_where_the_library_fell_back_to_prescott(detected, flags, expected):
    assert openblas_core.core_for(detected, flags) == expected


class Child:
    """subprocess.run in openblas_core, answering as a library would (or raising: must not run)."""

    def __init__(self, core: str | None, path: str):
        self.core, self.path, self.calls = core, path, 0

    def __call__(self, args, env, **kw):
        self.calls += 1
        if self.core is None:
            raise AssertionError("the child must not run")
        assert VARIABLE not in env  # the library's own choice is what is asked
        out = json.dumps({"name": "libopenblas.so.0", "path": self.path, "core": self.core})
        return subprocess.CompletedProcess(args, 0, stdout=out + "\n", stderr="")


@pytest.fixture
def child(monkeypatch, tmp_path):
    monkeypatch.setenv("GMLX_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(VARIABLE, raising=False)
    lib = tmp_path / "libopenblas.so.0"
    lib.write_bytes(b"0")

    def make(core):
        fake = Child(core, str(lib))
        monkeypatch.setattr(openblas_core.subprocess, "run", fake)
        return fake
    return make, lib


def test_the_librarys_answer_is_kept_per_library_file_and_asked_again_when_the_file_changes(child):
    make, lib = child
    first = make("Prescott")
    assert openblas_core.detected(("libopenblas.so.0",))["core"] == "Prescott" and first.calls == 1
    make(None)  # kept: no child
    assert openblas_core.detected(("libopenblas.so.0",))["core"] == "Prescott"
    lib.write_bytes(b"a newer library")  # upgraded in place: asked again
    again = make("SkylakeX")
    assert openblas_core.detected(("libopenblas.so.0",))["core"] == "SkylakeX" and again.calls == 1


@pytest.mark.skipif(not LINUX_X86, reason="the choice is made on x86-64 Linux only")
@pytest.mark.parametrize("core,flags,expected", [("Prescott", AVX512, "SkylakeX"), ("Prescott", {"sse3"}, None),
                                                 ("Zen", AVX512, None)])
def test_prepare_sets_the_variable_before_the_library_loads(child, monkeypatch, core, flags, expected):
    make, _ = child
    make(core)
    monkeypatch.setattr(openblas_core, "cpu_flags", lambda: flags)
    why = openblas_core.prepare(("libopenblas.so.0",))
    assert os.environ.get(VARIABLE) == expected
    assert (why is not None) == (expected is not None)


def test_a_users_core_type_is_left_alone_and_nothing_is_asked(child, monkeypatch):
    make, _ = child
    make(None)
    monkeypatch.setenv(VARIABLE, "Prescott")
    assert openblas_core.prepare(("libopenblas.so.0",)) is None
    assert os.environ[VARIABLE] == "Prescott"


@pytest.mark.skipif(not LINUX_X86, reason="the choice is made on x86-64 Linux only")
def test_the_users_process_runs_the_kernels_its_cpu_runs_and_says_which(tmp_path):
    """A fresh process in the user's environment: the core active_blas() names is the library's own
    choice, or (where that was Prescott on a CPU that runs better kernels) the one gmlx set, said so."""
    env = {k: v for k, v in user_env(tmp_path).items() if k != VARIABLE}
    own = subprocess.run([sys.executable, "-S", "-E", "-c", openblas_core._PROBE, json.dumps(["libopenblas.so.0"])],
                         env=env, capture_output=True, text=True, timeout=60).stdout.strip()
    if not own:
        pytest.skip("no OpenBLAS here")
    library = json.loads(own)["core"]
    code = "import os, gmlx\nfrom gmlx import blas\nprint(blas.active_blas())\nprint(os.environ.get('OPENBLAS_CORETYPE'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    said, variable = out.stdout.strip().splitlines()
    chosen = openblas_core.core_for(library, openblas_core.cpu_flags())
    if chosen is None:
        assert f"core {library}," in said and "set by gmlx" not in said and variable == "None", said
    else:
        assert f"core {chosen} (set by gmlx: the library took this CPU for a Prescott)" in said, said
        assert variable == chosen
    # ... and what this process set is what a child it starts must not take for the user's choice
    assert set(blas.variables_set()) <= {"OPENBLAS_THREAD_TIMEOUT", VARIABLE}
