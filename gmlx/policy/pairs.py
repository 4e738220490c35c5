"""Paired round costs: the cost of a k round relative to a plain one, T(k) / T(0), from periods
timed side by side (the online control's, gmlx/policy/width_control.py). Pure host arithmetic."""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

SAMPLES = 32  # the recent samples a ratio is the median of
PAIR_SPAN = 3  # periods on each side of a plain / speculative boundary that form one pair
PAIR_SECONDS = 3.0  # ... at most this far apart in time (drift on this scale is small)
MIN_PAIRS = 2  # pairs before their ratio replaces the medians' (or the probe's)


@dataclass
class Pairs:
    """The cost of a k round relative to a plain one, T(k) / T(0), from periods timed side by side.
    Two medians measured minutes apart carry the machine's drift in their ratio (on a shared VM
    the same plain round took 60 ms in one minute, 75 in the next: a K=1 round then looked
    cheaper than a plain one); drift multiplies both kinds alike, so where a run of one sort
    meets a run of the other (a switch, a plain window, an exploration) the medians of the
    PAIR_SPAN periods on each side of the boundary, at most PAIR_SECONDS apart, give one sample
    of log T(k) - log T(0) without it (k: the speculative side's, its rounds of that k only).
    The ratio is the median of the last SAMPLES samples: it holds while absolute times drift,
    and the samples' spread is the machine's noise at this timescale."""

    logs: dict[int, deque] = field(default_factory=dict)  # k -> recent log(T(k) / T(0)) samples
    run: list = field(default_factory=list)  # the current run's first periods: (k, seconds)
    tail: deque = field(default_factory=lambda: deque(maxlen=PAIR_SPAN))  # ... and its last ones
    run_plain: bool | None = None
    before: list = field(default_factory=list)  # the previous run's last periods (the other sort)
    ended: float = -math.inf  # when the previous run's last period was timed
    started: float = 0.0  # when the current run's first was
    last: float = -math.inf
    emitted: bool = True
    samples: int = 0  # samples taken so far (the deques stop growing at their length)
    memo: dict = field(default_factory=dict, repr=False)  # ratio and error per k until the next sample

    def add(self, k: int, seconds: float, now: float) -> None:
        if (k == 0) is not self.run_plain:  # a boundary: a run of the other sort starts
            self._emit()  # the run that ends, when it was shorter than PAIR_SPAN
            self.before, self.ended, self.started = list(self.tail), self.last, now
            self.run, self.tail, self.run_plain, self.emitted = [], deque(maxlen=PAIR_SPAN), k == 0, False
        if len(self.run) < PAIR_SPAN:
            self.run.append((k, seconds))
        self.tail.append((k, seconds))
        self.last = now
        if len(self.run) == PAIR_SPAN:
            self._emit()

    def _emit(self) -> None:
        """One sample from the boundary between the previous run and this one (once per boundary)."""
        if self.emitted or not self.run or not self.before or self.started - self.ended > PAIR_SECONDS:
            return
        self.emitted = True
        plain, spec = (self.run, self.before[::-1]) if self.run_plain else (self.before, self.run)
        k = spec[0][0]  # the speculative side's k nearest the boundary, and its periods of that k
        t0 = statistics.median(s for _, s in plain)
        tk = statistics.median(s for j, s in spec if j == k)
        if t0 > 0 and tk > 0:
            self.logs.setdefault(k, deque(maxlen=SAMPLES)).append(math.log(tk / t0))
            self.samples += 1
            self.memo.clear()

    def ratio(self, k: int) -> float | None:
        """T(k) / T(0) from pairs (None below MIN_PAIRS of them). Kept until the next sample: the
        control asks every step, samples come at boundaries."""
        if ("ratio", k) not in self.memo:
            d = self.logs.get(k)
            self.memo["ratio", k] = (math.exp(statistics.median(d)) if d is not None and len(d) >= MIN_PAIRS
                                     else None)
        return self.memo["ratio", k]

    def error(self, k: int) -> float:
        """The relative standard error of ratio(k) (from the pairs' MAD; 0 below MIN_PAIRS)."""
        d = self.logs.get(k, ())
        if len(d) < MIN_PAIRS:
            return 0.0
        if ("error", k) in self.memo:
            return self.memo["error", k]
        med = statistics.median(d)
        self.memo["error", k] = 1.2533 * 1.4826 * statistics.median(abs(x - med) for x in d) / math.sqrt(len(d))
        return self.memo["error", k]

    def paired(self) -> list[int]:
        """The k with a ratio."""
        return [k for k, d in self.logs.items() if len(d) >= MIN_PAIRS]

    def nearest(self, k: int) -> int | None:
        """The paired k nearest k (the smaller when two are as near): k's ratio comes from it."""
        paired = self.paired()
        return min(paired, key=lambda j: (abs(j - k), j)) if paired else None
