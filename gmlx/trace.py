"""Where a round's host time goes: an opt-in breakdown by phase, for benchmarks.

Off by default: every mark is one global lookup and a None check. `recording()` turns it on for
one block; the engine marks the end of each phase of a step, and the time since the previous
mark is charged to that phase. Phases, in the order a round meets them:

    admission    reaping cancellations, the cap, the plan, applying transitions, prefill
    build        building the round's graphs (drafts, verify or decode forward, sampling)
    dispatch     handing them to the device (async_eval)
    wait         the round's one host sync: waiting for the device
    readback     host work on the read tokens (acceptance)
    commit       rollback of the rejected positions and the drafter's commit
    emit         emission: stop checks, detokenizing (Row.take)
    deliver      handing pieces to the streams
    bookkeeping  counters, events, listeners, retiring finished rows
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

PHASES = ("admission", "build", "dispatch", "wait", "readback", "commit", "emit", "deliver", "bookkeeping")


class Recorder:
    def __init__(self):
        self.totals: dict[str, int] = defaultdict(int)  # nanoseconds per phase
        self.rounds = 0
        self._t: int | None = None

    def begin(self) -> None:
        self._t = time.perf_counter_ns()

    def mark(self, phase: str) -> None:
        now = time.perf_counter_ns()
        if self._t is not None:
            self.totals[phase] += now - self._t
        self._t = now

    def end_round(self) -> None:
        self.mark("bookkeeping")
        self.rounds += 1
        self._t = None

    def summary(self) -> dict:
        """Mean microseconds per round by phase, and their total."""
        n = max(self.rounds, 1)
        per = {p: round(self.totals.get(p, 0) / n / 1000, 1) for p in PHASES}
        return {"rounds": self.rounds, "us_per_round": per, "total_us_per_round": round(sum(per.values()), 1)}


_active: Recorder | None = None


def begin() -> None:
    if _active is not None:
        _active.begin()


def mark(phase: str) -> None:
    if _active is not None:
        _active.mark(phase)


def end_round() -> None:
    if _active is not None:
        _active.end_round()


@contextlib.contextmanager
def recording():
    """Record every step's phases (any thread) until the block ends."""
    global _active
    rec = Recorder()
    _active = rec
    try:
        yield rec
    finally:
        _active = None
