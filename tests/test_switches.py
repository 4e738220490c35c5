"""The GMLX_* switches: declared once (gmlx/switches.py), parsed strictly, read nowhere else.

Parametrised over the declared table, so a new switch is covered as soon as it is declared.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import tokenize
from contextlib import redirect_stderr
from pathlib import Path

import pytest

from gmlx import switches
from gmlx.engine import Engine
from gmlx.errors import ConfigError
from gmlx_cli.app import _dispatch

ROOT = Path(__file__).resolve().parent.parent
# Switches whose value is free text (a path, a key): no value is invalid.
FREE_TEXT = [s for s in switches.SWITCHES if s.parse is switches._text]
STRICT = [s for s in switches.SWITCHES if s not in FREE_TEXT]
BAD = "maybe"  # no switch with a grammar takes it: on/off, integers, seconds, "prior", layer indices


def _ids(s):
    return s.name


def test_names_are_unique_and_meanings_given():
    names = [s.name for s in switches.SWITCHES]
    assert len(set(names)) == len(names) and all(n.startswith("GMLX_") for n in names)
    assert all(s.meaning and s.takes for s in switches.SWITCHES)


@pytest.mark.parametrize("switch", switches.SWITCHES, ids=_ids)
def test_unset_or_blank_is_the_default(switch):
    assert switch.value({}) == switch.default
    assert switch.value({switch.name: "  "}) == switch.default


@pytest.mark.parametrize("switch", STRICT, ids=_ids)
def test_an_invalid_value_is_one_line_naming_it(switch):
    with pytest.raises(ConfigError) as info:
        switches.check({switch.name: BAD})
    msg = str(info.value)
    assert "\n" not in msg and switch.name in msg and repr(BAD) in msg and switch.takes in msg


@pytest.mark.parametrize("switch", STRICT, ids=_ids)
def test_an_invalid_value_is_an_error_at_engine_start(switch, monkeypatch):
    monkeypatch.setenv(switch.name, BAD)
    with pytest.raises(ConfigError, match=switch.name):
        Engine()  # raised before any model is loaded


@pytest.mark.parametrize("switch", STRICT, ids=_ids)
def test_an_invalid_value_is_one_line_at_the_cli(switch, monkeypatch):
    monkeypatch.setenv(switch.name, BAD)
    err = io.StringIO()
    with redirect_stderr(err):
        code = _dispatch(["generate", "hello", "--model", "/nonexistent"], debug=False)
    lines = err.getvalue().strip().splitlines()
    assert code == 1 and len(lines) == 1 and switch.name in lines[0] and repr(BAD) in lines[0], lines


@pytest.mark.parametrize("switch, raw, value", [
    (switches.PREEMPT, "off", False), (switches.TREE, "Yes", True), (switches.CONTROL, "0", False),
    (switches.DEQUANTIZED_DECODE, "true", True), (switches.WIDTH_CAP, "0", 0), (switches.WIDTH_CAP, " 3 ", 3),
    (switches.ROUND_COSTS, "PRIOR", "prior"), (switches.DIST_TIMEOUT, "1.5", 1.5),
    (switches.EAGLE3_LAYERS, "1,2,3", (1, 2, 3)), (switches.CACHE, "~/c", "~/c"),
], ids=lambda x: x.name if isinstance(x, switches.Switch) else repr(x))
def test_valid_values(switch, raw, value):
    assert switch.value({switch.name: raw}) == value


@pytest.mark.parametrize("switch, raw", [
    (switches.WIDTH_CAP, "-1"), (switches.WIDTH_CAP, "1.5"), (switches.DIST_TIMEOUT, "0"),
    (switches.DIST_TIMEOUT, "nan"), (switches.ROUND_COSTS, "measured"), (switches.EAGLE3_LAYERS, "1,,2"),
    (switches.OPENBLAS, "2"),
], ids=lambda x: x.name if isinstance(x, switches.Switch) else repr(x))
def test_out_of_range_values(switch, raw):
    with pytest.raises(ConfigError, match=re.escape(f"{switch.name}={raw!r}")):
        switch.value({switch.name: raw})


def _product_sources() -> list[Path]:
    """The shipped packages' sources: every top-level package of the repository but tests."""
    pkgs = [p for p in ROOT.iterdir() if (p / "__init__.py").is_file() and p.name != "tests"]
    return sorted(f for p in pkgs for f in p.rglob("*.py"))


# Variables that are not gmlx switches, which a line touching the environment may name.
OTHER_VARIABLES = {"MLX_HOSTFILE", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "HOME", "CC", "OPENBLAS_THREAD_TIMEOUT",
                   "OPENBLAS_CORETYPE"}


def test_no_module_but_switches_reads_the_environment():
    """Only gmlx/switches.py touches os.environ / os.getenv (reading, setting or copying it);
    other lines may read variables that are not gmlx switches, each named as a literal there."""
    assert len(_product_sources()) > 50
    offenders = []
    for f in _product_sources():
        if f == ROOT / "gmlx" / "switches.py":
            continue
        lines: dict[int, list] = {}
        with f.open("rb") as fh:
            for tok in tokenize.tokenize(fh.readline):
                if tok.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE):
                    lines.setdefault(tok.start[0], []).append(tok)
        for n, toks in lines.items():
            code = " ".join(t.string for t in toks)
            if not re.search(r"\bos \. (environ|getenv|putenv|unsetenv)\b|\bfrom os import\b", code):
                continue
            named = {t.string.strip("'\"") for t in toks if t.type == tokenize.STRING}
            if not named & OTHER_VARIABLES or any("GMLX_" in x for x in named):
                offenders.append(f"{f.relative_to(ROOT)}:{n}: {toks[0].line.strip()}")
    assert not offenders, "read GMLX_* switches through gmlx.switches:\n" + "\n".join(offenders)


def test_every_gmlx_variable_the_package_names_is_declared():
    """A GMLX_* name in the product's code (an option's envvar, a message) is a declared switch."""
    declared = {s.name for s in switches.SWITCHES}
    named = set()
    for f in _product_sources():
        with f.open("rb") as fh:
            for tok in tokenize.tokenize(fh.readline):
                if tok.type == tokenize.STRING:
                    named |= set(re.findall(r"\bGMLX_[A-Z0-9_]*[A-Z0-9]", tok.string))
    assert named - declared == set()


def test_an_invalid_openblas_value_does_not_break_import():
    """GMLX_OPENBLAS is read at `import gmlx`, before any boundary: an invalid value loads OpenBLAS
    as by default there, and is the error at engine start and the CLI's boundary (above)."""
    env = {**os.environ, "GMLX_OPENBLAS": BAD, "PYTHONPATH": str(ROOT)}
    code = "import gmlx\nfrom gmlx import blas\nprint(blas.active_blas())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "GMLX_OPENBLAS=0" not in out.stdout, out.stderr
