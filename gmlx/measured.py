"""Load-time measurements kept across processes.

Why: gmlx measures a few things when it loads a model — whether a quantized target's one-token
steps run faster on its float32 twin (gmlx/models/dequantized.py), that the twin agrees with the
model (gmlx/models/adapter.py `Target.check`), and what a speculative round costs here (the load
probe, gmlx/decode/probe.py). Each process measured them again: `gmlx generate --model smollm2`
(4-bit) spent ~2.7 s of its ~6.8 s start on them plain and ~4.3 s of ~8.5 s speculating, more
than speculation saves on a 200-token answer on this CPU (2026-12-06). The answers depend on the
model's files, the machine, the software and the switches that change a forward, so they are kept
under $GMLX_CACHE/measured/, keyed by all of those, for MAX_AGE, and read instead of measured on
the same key. A check is kept only when it passed. A small quantized target's float32 twin is kept
too (gmlx/models/dequantized.py, KEEP_MAX_BYTES: dequantizing SmolLM2 4-bit took ~1.7 s of each
start, reading it back and checking rows of it ~0.3 s); what is older than MAX_AGE is removed
when something is kept. The online control still measures every round it runs (its pairs replace
the probe's ratio within a few switches), and a lone request gives speculation up on the probe's
figures only after a fresh second measurement agrees (probe.reconfirmed). GMLX_KEEP_MEASURED=0:
redone in every process, nothing read or written; `gmlx doctor` says what is kept.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import time
import warnings
from pathlib import Path

from gmlx import switches
from gmlx.atomic_file import write_atomic

MAX_AGE = 7 * 24 * 3600.0  # seconds: a machine's load and speed drift; its software is in the key
# The switches that change what a forward computes or how fast: part of every key.
_KEYED = (switches.COMPILE, switches.EARLY_DISPATCH, switches.OPENBLAS, switches.SMALL_GEMM,
          switches.DEQUANTIZED_VERIFY, switches.EAGLE3_LAYERS)
_said = False  # that something could not be kept (`cannot_keep`: once a process)


def files_of(path: Path) -> tuple:
    """A model directory's identity: its resolved path and each config and weights file's name,
    size and modification time (a file rewritten in place is a new model)."""
    path = Path(path).resolve()
    files = sorted(f for f in path.iterdir() if f.suffix in (".json", ".safetensors") and f.is_file())
    return (str(path), tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files))


def context() -> dict:
    """The machine, the software and the switches (read now) a measurement depends on."""
    return {**_machine_and_software(), "switches": {s.name: s.raw() for s in _KEYED}}


@functools.cache  # (once a process: a start asks for it a few times)
def _machine_and_software() -> dict:
    from gmlx import blas
    from gmlx.machine import accelerator, cpu_name, version

    return {"cpu": cpu_name(), "cores": os.cpu_count(), "device": accelerator(), "blas": blas.active_blas(),
            "mlx": version("mlx"), "mlx_lm": version("mlx-lm"), "gmlx": version("gmlx"), "code": _code()}


def _code() -> str:
    """gmlx's own source files, by name, size and modification time: an editable install keeps its
    version number through every change to them (a new kernel changes what a round costs)."""
    root = Path(__file__).resolve().parent
    files = sorted(root.rglob("*.py")) + sorted(root.rglob("*.c"))
    return hashlib.sha256(repr([(str(f.relative_to(root)), f.stat().st_size, f.stat().st_mtime_ns)
                                for f in files]).encode()).hexdigest()[:16]


def _file(kind: str, key, ctx: dict | None = None) -> tuple[Path, str]:
    text = json.dumps({"kind": kind, "key": key, "context": context() if ctx is None else ctx}, sort_keys=True,
                      default=str)
    digest = hashlib.sha256(text.encode()).hexdigest()[:24]
    return switches.cache_root() / "measured" / f"{kind}-{digest}.json", text


def recall(kind: str, key) -> tuple[object, float] | None:
    """(the value kept for this kind and key on this machine and software, when it was measured),
    or None: none kept, older than MAX_AGE, unreadable, or GMLX_KEEP_MEASURED off."""
    if not switches.KEEP_MEASURED.value():
        return None
    path, text = _file(kind, key)
    try:
        kept = json.loads(path.read_text())
        if kept["of"] != text or not time.time() - kept["when"] < MAX_AGE:
            return None
        return kept["value"], kept["when"]
    except (OSError, ValueError, KeyError, TypeError):
        return None  # none kept, or a file cut short: measured again (and written anew)


def keep(kind: str, key, value) -> None:
    """Keep `value` (JSON) for this kind and key; a cache that cannot be written costs only the
    measurement next time (said once per process, `cannot_keep`)."""
    if not switches.KEEP_MEASURED.value():
        return
    path, text = _file(kind, key)
    try:
        write_atomic(path, json.dumps({"of": text, "when": time.time(), "value": value}))  # (a reader: old or new)
        prune()
    except OSError as e:
        cannot_keep(kind, path.parent, e)


def cannot_keep(kind: str, where: Path, e: Exception) -> None:
    """Say once per process that something could not be kept (it is then redone in every process):
    a read-only cache would otherwise warn for each kind."""
    global _said
    if not _said:
        _said = True
        warnings.warn(f"gmlx: could not keep the {kind} measurement under {where} ({e}); it is measured again in"
                      " every process (GMLX_CACHE picks another directory)", RuntimeWarning, stacklevel=3)


def artifact(kind: str, key) -> Path | None:
    """Where a file derived at load for this kind and key is kept (a quantized target's float32 twin:
    gmlx/models/dequantized.py), or None: GMLX_KEEP_MEASURED off. Read it only while `fresh`. Its
    values depend on the model's files and MLX's kernels alone: keyed by those and the device, so a
    change to gmlx's code or a switch does not write another copy (the reader checks every shape)."""
    if not switches.KEEP_MEASURED.value():
        return None
    ctx = {k: v for k, v in _machine_and_software().items() if k in ("device", "mlx")}
    return _file(kind, key, ctx)[0].with_suffix(".safetensors")


def fresh(path: Path) -> bool:
    """A kept file younger than MAX_AGE (older ones are written anew, and removed by `prune`)."""
    try:
        return time.time() - path.stat().st_mtime < MAX_AGE
    except OSError:
        return False


def prune() -> None:
    """Remove what was kept longer ago than MAX_AGE (a model's old files, a twin no load reads)."""
    try:
        for f in (switches.cache_root() / "measured").iterdir():
            if not fresh(f):
                f.unlink(missing_ok=True)
    except OSError:
        pass


def summary() -> str:
    """What is kept, for `gmlx doctor`."""
    if not switches.KEEP_MEASURED.value():
        return "nothing (GMLX_KEEP_MEASURED=0): redone in every process"
    where = switches.cache_root() / "measured"
    files = [f for f in where.iterdir() if f.is_file()] if where.is_dir() else []
    size = sum(f.stat().st_size for f in files)
    return (f"{len(files)} file{'' if len(files) == 1 else 's'}, {size / 1e6:.0f} MB under {where} (round costs,"
            f" twins, checks; kept {MAX_AGE / 86400:.0f} days)")


def when(seconds: float) -> str:
    """A kept measurement's time, as a source note says it."""
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(seconds))
