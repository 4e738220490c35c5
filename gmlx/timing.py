"""Fastest-of-N wall times for small measurements at run time (the round-cost probe, the
quantized target's choice of decode path): the functions are warmed up, then timed in turn, a
few times over, each keeping its fastest time — on a shared machine the minimum is the estimate
that load spikes do not move."""

from __future__ import annotations

import time

REPS = 5


def fastest(fns: list, reps: int = REPS, warm: bool = True) -> list[float]:
    """Each function's fastest wall time over `reps` interleaved turns, after one warm-up call each
    (`warm`; False where others warmed the same kernels up)."""
    for fn in fns if warm else ():
        fn()  # warm-up: kernels, allocator
    best = [float("inf")] * len(fns)
    for _ in range(reps):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best
