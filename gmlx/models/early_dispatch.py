"""Early dispatch: a forward starts computing while Python still builds its graph.

Why: MLX computes nothing until an array is evaluated, so a forward built and then evaluated costs
its graph's build (Python: SmolLM2-135M's ~2,200 operations take ~3 ms here, ~10 % of a step) plus
its compute, one after the other. A speculative round pays that on every round: its inputs (the
bonus, the drafts, the cache's length) come from the acceptance the round before read back, so its
verify was built with the device idle. Plain decoding builds step p+1 while step p computes
(gmlx/decode/plain.py, as mlx-lm's generate_step), but MLX lets only ~100 operations wait in flight
(below), so on a small model even that build outlasts the work queued ahead of it.

How: inside `early()` (the target's forwards enter it: gmlx/models/adapter.py `one_forward`) every
decoder layer hands its output to `mx.async_eval` as soon as it is built, so the device computes
layer i while Python builds layer i+1. No host read (an async_eval is a dispatch, not a sync); the
same operations on the same inputs, so the same values. MLX's scheduler keeps about 100 operations
in flight (10 tasks of 10 dispatches on the CPU stream) and `async_eval` waits for room past that,
so the build is paced by the device, never far ahead of it. mlx-lm's own loops over the same model
objects (a benchmark's mlx-lm arm) never enter `early()`: they run as mlx-lm runs them.

Measured here (2-core CPU): a SmolLM2 float32 forward of 1 / 2 / 4 tokens, built, evaluated and read
(100-token context, 60 interleaved each), 29.5 / 34.5 / 48.4 -> 27.7 / 32.1 / 47.1 ms with every
layer dispatched early (every 2nd or 4th layer: less); the engine's runs in docs/speculation.md.
On the CPU backend by default; on Metal and CUDA only under GMLX_EARLY_DISPATCH=1 (not measured
there: each async_eval commits a command buffer).
"""

from __future__ import annotations

import contextlib
import threading

import mlx.core as mx
import mlx.nn as nn

from gmlx import switches

_local = threading.local()  # .on: this thread's forwards dispatch their layers early
_classes: dict[type, type] = {}  # a decoder layer's class -> its early-dispatching subclass


def wanted() -> bool:
    """GMLX_EARLY_DISPATCH, else on the CPU backend only (the module docstring)."""
    forced = switches.EARLY_DISPATCH.value()
    return mx.default_device().type == mx.cpu if forced is None else forced


@contextlib.contextmanager
def early():
    """Within this block this thread's forwards dispatch each layer as it is built (when `wanted`).
    Nests; the flag is per thread (an engine's forwards run on its own thread, a benchmark's
    mlx-lm arm on another or outside it)."""
    before = getattr(_local, "on", False)
    _local.on = wanted()
    try:
        yield
    finally:
        _local.on = before


def _call(self, *args, **kwargs):
    out = super(type(self), self).__call__(*args, **kwargs)
    if getattr(_local, "on", False) and isinstance(out, mx.array):
        mx.async_eval(out)  # dispatch, not a sync: the device starts on this layer (the module docstring)
    return out


def install(layers: list) -> int:
    """Give each decoder layer a subclass whose call dispatches its output early inside `early()`
    (its weights and attributes stay the same objects); the number changed. Idempotent."""
    n = 0
    for layer in layers:
        cls = type(layer)
        if not isinstance(layer, nn.Module) or cls in _classes.values():
            continue
        if cls not in _classes:
            _classes[cls] = type(cls.__name__, (cls,), {"__call__": _call, "__module__": cls.__module__,
                                                        "__qualname__": cls.__qualname__})
        layer.__class__ = _classes[cls]
        n += 1
    return n
