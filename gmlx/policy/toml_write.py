"""Write the user config safely: a small TOML serialiser (tomllib only reads) and an atomic write
that keeps the file's mode and writes through a symlink."""

from __future__ import annotations

import datetime as dt
import math
import re
from pathlib import Path
from typing import Any, Mapping

from gmlx.atomic_file import write_atomic
from gmlx.errors import ConfigError


def atomic_write(path: Path, text: str) -> None:
    try:
        write_atomic(path, text)
    except OSError as e:
        raise ConfigError(f"cannot write gmlx config {path}: {e}") from None


# A minimal TOML writer: what tomllib can return (tables, arrays, strings, ints, floats,
# bools, dates) is written so that tomllib reads back the same data.
_INLINE_KEYS = frozenset({"num_draft_tokens_by_width"})
_BARE = re.compile(r"[A-Za-z0-9_-]+\Z")
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _string(s: str) -> str:
    out = (_ESCAPES.get(c) or (f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else c) for c in s)
    return '"' + "".join(out) + '"'


def toml_key(k: str) -> str:
    return k if _BARE.match(k) else _string(k)


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
    if isinstance(v, str):
        return _string(v)
    if isinstance(v, (dt.date, dt.time)):  # datetime is a date
        return v.isoformat()
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, Mapping):
        return "{" + ", ".join(f"{toml_key(str(k))} = {_value(x)}" for k, x in v.items()) + "}"
    raise ConfigError(f"cannot write {v!r} ({type(v).__name__}) to the gmlx config")


def dumps_toml(data: Mapping[str, Any]) -> str:
    """Serialise nested dicts as TOML; `tomllib.loads(dumps_toml(d)) == d` for tomllib data."""
    lines: list[str] = []

    def table(t: Mapping[str, Any], path: tuple[str, ...]) -> None:
        is_sub = {k: isinstance(v, Mapping) and k not in _INLINE_KEYS for k, v in t.items()}
        plain = [k for k in t if not is_sub[k]]
        # Pure containers need no header (their children's dotted headers create them); an
        # empty table does, or it would vanish.
        if path and (plain or not t):
            lines.extend(([""] if lines else []) + ["[" + ".".join(toml_key(p) for p in path) + "]"])
        lines.extend(f"{toml_key(k)} = {_value(t[k])}" for k in plain)  # before sub-tables: TOML scoping
        for k in t:
            if is_sub[k]:
                table(t[k], path + (k,))

    table(data, ())
    return "\n".join(lines) + "\n" if lines else ""
