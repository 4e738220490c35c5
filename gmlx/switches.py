"""Every GMLX_* environment switch, declared once and parsed strictly: the only module that reads them.

Each switch is declared with its name, the values it takes, its value when unset and one line of
meaning (README's table says the same). `Switch.value()` parses the variable's current value: read
where it is used, since some change within a process (GMLX_MTP_WIDTH_CAP is re-read every round;
tests and the load generator set others). `check()` parses every switch, so that an invalid value
is one ConfigError at engine start and at the CLI's boundary, naming the variable, the value and
what it takes, never a silent default. This module imports nothing of gmlx but its errors:
gmlx/blas.py reads GMLX_OPENBLAS through it before mlx is first imported.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from gmlx.errors import ConfigError

_TRUE = {"1", "true", "on", "yes"}
_FALSE = {"0", "false", "off", "no"}
_ON_OFF = "1/0, true/false, on/off or yes/no"


def _bool(raw: str) -> bool:
    v = raw.lower()
    if v in _TRUE | _FALSE:
        return v in _TRUE
    raise ValueError(raw)


def _count(raw: str) -> int:
    n = int(raw)
    if n < 0:
        raise ValueError(raw)
    return n


def _seconds(raw: str) -> float:
    s = float(raw)
    if not s > 0:  # NaN too
        raise ValueError(raw)
    return s


def _prior(raw: str) -> str:
    if raw.lower() != "prior":
        raise ValueError(raw)
    return "prior"


def _indices(raw: str) -> tuple[int, ...]:
    return tuple(int(x) for x in raw.split(","))


def _text(raw: str) -> str:
    return raw


@dataclass(frozen=True)
class Switch:
    name: str
    takes: str  # the values it accepts, as the error message says them
    default: object  # its value when unset or blank
    meaning: str
    parse: Callable[[str], object]  # the stripped, non-empty value -> its value; ValueError when not allowed

    def raw(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The variable as set (None when unset), unparsed: for records and change detection."""
        return (os.environ if environ is None else environ).get(self.name)

    def value(self, environ: Mapping[str, str] | None = None):
        """The parsed value now (the default when unset or blank); ConfigError when invalid."""
        raw = self.raw(environ)
        if raw is None or not raw.strip():
            return self.default
        try:
            return self.parse(raw.strip())
        except ValueError:
            raise ConfigError(f"{self.name}={raw!r} is not valid; it takes {self.takes}") from None

    def put(self, value: str | None) -> None:
        """Set the variable for this process (None: unset it): the load generator's and the
        soak's live changes, which the engine then reads as a user's would be."""
        if value is None:
            os.environ.pop(self.name, None)
        else:
            os.environ[self.name] = value


def _on_off(name: str, default: bool | None, meaning: str) -> Switch:
    unset = "measured" if default is None else ("on" if default else "off")
    return Switch(name, f"{_ON_OFF} (unset: {unset})", default, meaning, _bool)


PREEMPT = _on_off("GMLX_MTP_PREEMPT", True, "waiters preempt a running scalar request into the batch loop")
RESUME = _on_off("GMLX_MTP_RESUME", True, "a gated batch back within the cap re-arms through a capture round")
WIDTH_CAP = Switch("GMLX_MTP_WIDTH_CAP", "an integer >= 0 (0 = uncapped)", None, "the width cap; re-read every round",
                   _count)
CONTROL = _on_off("GMLX_CONTROL", True, "the online control of K and of plain vs speculative per width")
TREE = _on_off("GMLX_TREE", False, "the lone request may verify a token tree, where measured faster than its chain")
CONTEXT_LOOKUP = _on_off("GMLX_CONTEXT_LOOKUP", True, "the lone request drafts from its own context where its last"
                         " tokens recur there, beside the model's drafter")
ROUND_COSTS = Switch("GMLX_ROUND_COSTS", "prior (unset: measured)", None, "use built-in round cost estimates", _prior)
DEQUANTIZED_VERIFY = _on_off("GMLX_DEQUANTIZED_VERIFY", True, "a quantized target on the CPU verifies through a twin")
DEQUANTIZED_DECODE = _on_off("GMLX_DEQUANTIZED_DECODE", None, "the twin's one-token steps too (on) or not (off)")
COMPILE = _on_off("GMLX_COMPILE", True, "the sampler, acceptance and assistant draft graphs (and on the CPU the"
                  " models' norms and rotary embeddings) run through mx.compile")
EARLY_DISPATCH = Switch("GMLX_EARLY_DISPATCH", f"{_ON_OFF} (unset: on the CPU backend only)", None,
                        "a verify forward's layers start computing as they are built", _bool)
OPENBLAS = _on_off("GMLX_OPENBLAS", True, "load OpenBLAS for MLX's CPU matmuls at `import gmlx` (Linux)")
SMALL_GEMM = _on_off("GMLX_SMALL_GEMM", True, "gmlx's small-M sgemm takes MLX's CPU matmuls of <= 12 rows (Linux)")
CACHE = Switch("GMLX_CACHE", "a directory", None, "where GGUF conversions go (default ~/.cache/gmlx)", _text)
KEEP_MEASURED = _on_off("GMLX_KEEP_MEASURED", True, "load-time work (round costs, a quantized target's twin, its decode"
                        " path and check) kept in the cache across processes (gmlx/measured.py)")
CONFIG = Switch("GMLX_CONFIG", "a file path", None, "the user config (default ~/.config/gmlx/config.toml)", _text)
API_KEY = Switch("GMLX_API_KEY", "a key", None, "serve's and bench --url's --api-key (typer reads it)", _text)
DIST_TIMEOUT = Switch("GMLX_DIST_TIMEOUT", "seconds > 0 (unset: 300)", 300.0, "a rank's longest wait on the others",
                      _seconds)
EAGLE3_LAYERS = Switch("GMLX_EAGLE3_LAYERS", "comma-separated layer indices", None, "the layers EAGLE-3 reads",
                       _indices)
DEBUG = _on_off("GMLX_DEBUG", False, "the CLI shows the full traceback on errors (as --debug)")

def cache_root() -> Path:
    """gmlx's cache directory: GMLX_CACHE, else $XDG_CACHE_HOME/gmlx (~/.cache/gmlx): GGUF
    conversions (gmlx/gguf/convert.py), the built small-M kernel (gmlx/small_gemm.py) and load-time
    measurements (gmlx/measured.py)."""
    if (chosen := CACHE.value()) is not None:
        return Path(chosen).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "gmlx"


SWITCHES: tuple[Switch, ...] = (PREEMPT, RESUME, WIDTH_CAP, CONTROL, TREE, CONTEXT_LOOKUP, ROUND_COSTS, DEQUANTIZED_VERIFY,
                                DEQUANTIZED_DECODE, COMPILE, EARLY_DISPATCH, OPENBLAS, SMALL_GEMM, CACHE, KEEP_MEASURED, CONFIG,
                                API_KEY, DIST_TIMEOUT, EAGLE3_LAYERS, DEBUG)


def check(environ: Mapping[str, str] | None = None) -> None:
    """Parse every switch: the first invalid one is a ConfigError (engine start, the CLI's boundary)."""
    for s in SWITCHES:
        s.value(environ)
