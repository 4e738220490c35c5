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
# Steady samples (`Pairs(warm=...)`, the lone request's width): a speculative run's first periods after plain
# ones can run dear — ~10 % for ~7 rounds on SmolLM2 float32 on an AMD EPYC (the drafter catching up on the plain
# steps, the re-arm), and the plain periods next to a boundary miss the shadow replays of a plain stretch — so there
# the boundary's pairs read a K = 1 round 6-10 % dearer than the two sorts cost mid-run (docs/speculation.md,
# "Pairs past the boundary periods"); on the simulated clock that bias alone took the lone chat request from K = 1
# every round's 1.10x of plain to 1.05x ("Steady pairs", the same doc). Where no switch costs, both read alike.
STEADY_WARM = 6  # a speculative run's periods after this many (after plain ones) are steady
STEADY_SPAN = 8  # the steady periods of each sort a sample is the medians of ...
STEADY_SECONDS = 10.0  # ... all timed within this long (drift on this scale is small)
STEADY_MIN = 3  # periods of each sort a sample needs, and new ones since the last sample of that k


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
    warm: int = 0  # > 0: steady samples too (STEADY_WARM), preferred where there are MIN_PAIRS of a k
    position: int = 0  # periods timed in the current run
    after_plain: bool = False  # the current (speculative) run follows plain periods
    recent: dict[int, deque] = field(default_factory=dict)  # k -> steady (now, seconds), plain's all
    fresh: dict[int, int] = field(default_factory=dict)  # k -> steady periods since k's last steady sample
    steady: dict[int, deque] = field(default_factory=dict)  # k -> recent steady log(T(k) / T(0)) samples

    def add(self, k: int, seconds: float, now: float) -> None:
        if (k == 0) is not self.run_plain:  # a boundary: a run of the other sort starts
            self._emit()  # the run that ends, when it was shorter than PAIR_SPAN
            if self.warm:
                self._emit_steady(now)
            self.after_plain = self.run_plain is True
            self.before, self.ended, self.started = list(self.tail), self.last, now
            self.run, self.tail, self.run_plain, self.emitted = [], deque(maxlen=PAIR_SPAN), k == 0, False
            self.position = 0
        self.position += 1
        if self.warm and (k == 0 or not self.after_plain or self.position > self.warm):
            self.recent.setdefault(k, deque(maxlen=STEADY_SPAN)).append((now, seconds))
            self.fresh[k] = self.fresh.get(k, 0) + 1
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

    def _emit_steady(self, now: float) -> None:
        """At a boundary, one steady sample per speculative k with STEADY_MIN new steady periods (or with new
        plain ones): the medians of each sort's last steady periods timed within STEADY_SECONDS."""
        plain = [s for t, s in self.recent.get(0, ()) if now - t <= STEADY_SECONDS]
        if len(plain) < STEADY_MIN:
            return
        sampled = False
        for k in [k for k in self.recent if k]:
            spec = [s for t, s in self.recent[k] if now - t <= STEADY_SECONDS]
            if len(spec) < STEADY_MIN or max(self.fresh.get(k, 0), self.fresh.get(0, 0)) < STEADY_MIN:
                continue
            self.steady.setdefault(k, deque(maxlen=SAMPLES)).append(
                math.log(statistics.median(spec) / statistics.median(plain)))
            self.fresh[k], self.samples, sampled = 0, self.samples + 1, True
            self.memo.clear()
        if sampled:
            self.fresh[0] = 0

    def _samples(self, k: int):
        """k's steady samples where there are MIN_PAIRS of them, else its boundary pairs."""
        d = self.steady.get(k)
        return d if d is not None and len(d) >= MIN_PAIRS else self.logs.get(k)

    def ratio(self, k: int) -> float | None:
        """T(k) / T(0) from pairs (None below MIN_PAIRS of them). Kept until the next sample: the
        control asks every step, samples come at boundaries."""
        if ("ratio", k) not in self.memo:
            d = self._samples(k)
            self.memo["ratio", k] = (math.exp(statistics.median(d)) if d is not None and len(d) >= MIN_PAIRS
                                     else None)
        return self.memo["ratio", k]

    def error(self, k: int) -> float:
        """The relative standard error of ratio(k) (from the pairs' MAD; 0 below MIN_PAIRS)."""
        d = self._samples(k) or ()
        if len(d) < MIN_PAIRS:
            return 0.0
        if ("error", k) in self.memo:
            return self.memo["error", k]
        med = statistics.median(d)
        self.memo["error", k] = 1.2533 * 1.4826 * statistics.median(abs(x - med) for x in d) / math.sqrt(len(d))
        return self.memo["error", k]

    def paired(self) -> list[int]:
        """The k with a ratio."""
        return [k for k in {*self.logs, *self.steady} if len(self._samples(k) or ()) >= MIN_PAIRS]

    def nearest(self, k: int) -> int | None:
        """The paired k nearest k (the smaller when two are as near): k's ratio comes from it."""
        paired = self.paired()
        return min(paired, key=lambda j: (abs(j - k), j)) if paired else None
