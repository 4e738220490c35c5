"""The user config file: where it is, reading one model's entry on this machine, and writing it
(`gmlx sweep-cap`). gmlx/policy/caps.py decides the cap from it and the other sources.

User config: TOML at $GMLX_CONFIG, else $XDG_CONFIG_HOME/gmlx/config.toml, else
~/.config/gmlx/config.toml (on every platform, so the path is predictable). Entries are keyed by
model (`model_key`) and machine (`machine_key`), as `gmlx sweep-cap` writes them:

    [models."gmlx-default"."amd-epyc-2c-openblas"]
    speculative_width_cap = 4                # or "off"; 0 = uncapped
    num_draft_tokens_by_width = {1 = 3, 2 = 3, 4 = 2}
    measured_at = "2025-01-01T00:00:00+00:00"
    source = "sweep-cap"

Invariants: reading never writes; an invalid file (bad TOML, wrong type, negative cap, unknown
key in an entry) is a ConfigError naming the file and the fix, never a silent default; writing
rewrites the whole file atomically (temp file + rename), keeps every other model's and machine's
entry, refuses to overwrite a file it cannot parse, and does not keep comments.
"""

from __future__ import annotations

import datetime as dt
import functools
import os
import platform
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from gmlx import blas
from gmlx import machine as _machine
from gmlx import switches
from gmlx.errors import ConfigError
from gmlx.policy.toml_write import atomic_write, dumps_toml, toml_key

DEFAULT_MODEL_KEY = "gmlx-default"
OFF = "off"
Cap = int | Literal["off"]
_ENTRY_KEYS = ("speculative_width_cap", "num_draft_tokens_by_width", "measured_at", "source")
_CAP_HELP = 'use an integer >= 0 (0 = uncapped) or "off" (never speculate in a batch)'


# -- where and for what ----------------------------------------------------------------------
def config_path() -> Path:
    """The user config file (it need not exist)."""
    return _config_path_for(switches.CONFIG.value() or "", os.environ.get("XDG_CONFIG_HOME", ""),
                            os.environ.get("HOME", ""))


@functools.lru_cache(maxsize=16)  # the engine asks every round: build the Path once per setting
def _config_path_for(explicit: str, xdg: str, home: str) -> Path:
    explicit, xdg = explicit.strip(), xdg.strip()
    if explicit:
        return Path(explicit).expanduser()
    # The XDG spec says a relative XDG_CONFIG_HOME is invalid and must be ignored.
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".config"
    return base / "gmlx" / "config.toml"


def config_stamp() -> tuple | None:
    """What identifies the user config's current content: its path and (mtime, size, inode), or
    None when it does not exist. Cheap (one stat), so a caller may ask every round."""
    p = config_path()
    try:
        st = os.stat(p)
    except OSError:
        return (p, None)
    return (p, st.st_mtime_ns, st.st_size, st.st_ino)


def _slug(text: str) -> str:
    text = re.sub(r"\((r|tm|c)\)", " ", text.lower())
    return re.sub(r"[^a-z0-9]+", "-", text).strip("-") or "unknown"


@functools.cache  # constant for the process; the engine resolves the cap every round
def machine_key() -> str:
    """A short stable key for this machine: CPU model, logical core count, BLAS kind."""
    loaded = blas.ensure_loaded()
    if loaded == "OpenBLAS":
        kind = "openblas"
    elif loaded == "reference":
        kind = "refblas"
    else:  # a measurement on Metal says nothing about another backend, so name it
        kind = "metal" if platform.system() == "Darwin" else "default"
    return _slug(f"{_machine.cpu_name()} {os.cpu_count() or 0}c {kind}")


def model_key(path: str | Path | None) -> str:
    """"gmlx-default" for the embedded model (path None or its directory), else the resolved path."""
    from gmlx.models.loading import default_model_path  # lazy: keeps this module light

    if path is None:
        return DEFAULT_MODEL_KEY
    p = Path(path).expanduser().resolve()
    return DEFAULT_MODEL_KEY if p == default_model_path().resolve() else str(p)


# -- values ----------------------------------------------------------------------------------
def parse_cap(value: Any, where: str) -> Cap:
    if isinstance(value, str) and value.strip().lower() == OFF:
        return OFF
    # bool is an int subclass; `true` is not a cap.
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{where}: speculative_width_cap = {value!r} is invalid; {_CAP_HELP}")
    return value


def _parse_k(value: Any, where: str) -> tuple[tuple[int, int], ...]:
    fix = 'use a table of width = K with integers >= 0 (0: plain), e.g. {1 = 3, 4 = 2}'
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: num_draft_tokens_by_width = {value!r} is not a table; {fix}")
    out = {}
    for w, k in value.items():
        w_ok = (isinstance(w, int) and not isinstance(w, bool)
                or isinstance(w, str) and w.strip().isascii() and w.strip().isdigit())
        if not w_ok or int(w) < 1 or isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ConfigError(f"{where}: num_draft_tokens_by_width entry {w!r} = {k!r} is invalid; {fix}")
        out[int(w)] = k
    return tuple(sorted(out.items()))


@dataclass(frozen=True)
class UserEntry:
    """One [models.<model>.<machine>] entry. cap None: the entry sets no cap (K only)."""

    cap: Cap | None
    k_by_width: tuple[tuple[int, int], ...]
    measured_at: str | None
    source: str | None
    path: Path


# -- reading ---------------------------------------------------------------------------------
_cache: dict[Path, tuple[tuple[int, int, int], dict]] = {}  # stat stamp: re-read only on change


def load_config(path: str | Path | None = None) -> dict:
    """The parsed config file ({} when it does not exist)."""
    p = Path(path) if path is not None else config_path()
    try:
        st = p.stat()
    except FileNotFoundError:
        return {}
    except OSError as e:
        raise ConfigError(f"cannot read gmlx config {p}: {e}") from None
    stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
    hit = _cache.get(p)
    if hit is not None and hit[0] == stamp:
        return hit[1]
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read gmlx config {p}: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"gmlx config {p} is not valid TOML ({e}); fix the syntax, or delete the file"
                          " and run `gmlx sweep-cap` to measure again") from None
    _cache[p] = (stamp, data)
    return data


def _header(*keys: str) -> str:
    return "[" + ".".join(toml_key(k) for k in keys) + "]"


def read_user_entry(model: str, *, machine: str | None = None, path: str | Path | None = None) -> UserEntry | None:
    """The validated entry for (model, machine), or None when the file or the entry is absent."""
    p = Path(path) if path is not None else config_path()
    data = load_config(p)
    mach = machine if machine is not None else machine_key()
    node: Any = data
    for i, k in enumerate(("models", model, mach)):
        node = node.get(k)
        if node is None:
            return None
        if not isinstance(node, dict):
            name = "models" if i == 0 else _header("models", *(model, mach)[:i])
            raise ConfigError(f"gmlx config {p}: {name} must be a table; see the example in gmlx/policy/user_config.py")
    where = f"gmlx config {p}, {_header('models', model, mach)}"
    unknown = sorted(set(node) - set(_ENTRY_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(_ENTRY_KEYS)}")
    cap = parse_cap(node["speculative_width_cap"], where) if "speculative_width_cap" in node else None
    k = _parse_k(node["num_draft_tokens_by_width"], where) if "num_draft_tokens_by_width" in node else ()
    meta = {}
    for name in ("measured_at", "source"):
        v = node.get(name)
        if v is not None and not isinstance(v, (str, dt.date, dt.time)):
            raise ConfigError(f"{where}: {name} = {v!r} must be a string")
        meta[name] = None if v is None else str(v)
    return UserEntry(cap=cap, k_by_width=k, path=p, **meta)


# -- writing ---------------------------------------------------------------------------------
def write_cap(model: str, cap: Cap, *, k_by_width: Mapping[int, int] | None = None, machine: str | None = None,
              path: str | Path | None = None, source: str = "sweep-cap") -> Path:
    """Replace the (model, machine) entry, keeping the rest of the file; return the file's path."""
    p = Path(path) if path is not None else config_path()
    value = parse_cap(cap, "write_cap")
    entry: dict[str, Any] = {"speculative_width_cap": value}
    if k_by_width:
        entry["num_draft_tokens_by_width"] = {str(w): kw for w, kw in _parse_k(k_by_width, "write_cap")}
    entry["measured_at"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    entry["source"] = source
    data = dict(load_config(p))  # a file we cannot parse raises here: never clobber it
    mach = machine if machine is not None else machine_key()
    models = data.setdefault("models", {})
    if not isinstance(models, dict) or not isinstance(models.get(model, {}), dict):
        raise ConfigError(f"gmlx config {p}: `models` and {_header('models', model)} must be tables;"
                          " fix or remove them")
    data["models"] = {**models, model: {**models.get(model, {}), mach: entry}}
    atomic_write(p, dumps_toml(data))
    _cache.pop(p, None)
    return p
