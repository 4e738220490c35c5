"""mx.compile for the engine's small hot graphs (the sampler, the acceptance), with an opt-out.

A compiled function replays one fused graph instead of building a dozen small ops in Python each
round: on a host-bound decode step (small models on a GPU, the micro model here) that is a
visible share of the round. The first call of each new input shape traces the function (and on
the CPU backend compiles fused kernels once, cached by MLX), so the first round of a shape is
slower. GMLX_COMPILE=0 runs the same functions uncompiled (identical ops, for debugging).
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx

from gmlx import switches


def enabled() -> bool:
    return switches.COMPILE.value()


def compiled(fn: Callable, **kw) -> Callable:
    """`mx.compile(fn, **kw)` (e.g. `inputs=`: module parameters it reads, so that new weights
    are seen), or `fn` itself under GMLX_COMPILE=0."""
    return mx.compile(fn, **kw) if enabled() else fn
