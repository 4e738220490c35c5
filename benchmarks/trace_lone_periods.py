"""Where a lone request's round periods go, by their place in their run: every period the online
control times at width 1 (WidthControl.add_time), grouped by kind (plain / K) and by its distance
from the plain / speculative boundary before it (first1..first4) or after it (last1..last4), else
"mid"; and every pair sample (pairs.Pairs) by the boundary's direction. Why: a pair at a boundary
is the control's drift-free T(K) / T(0) (gmlx/policy/pairs.py), and a switch's own work — the
drafter catching up on plain steps, a plain step dispatched by the switching round — lands in the
periods next to it; this shows how much (docs/speculation.md, "Pairs past the boundary periods").

Run: ``python benchmarks/trace_lone_periods.py --model smollm2-f32 --kind chat --repeats 3``: the
bench's fresh loop as shipped (bench_lone_prior.py's `light`: each of the kind's prompts in turn,
one at a time, nothing learnt before the first). ``--forced S,P``: the control's choice at width 1
replaced by S rounds of K = 1, then P plain, repeating within each request (the control still
observes every round): periods by place with no decision in the way. Prints a table; writes nothing.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import math
import statistics

import bench_lone_prior as lone
from bench_matrix import model, prompt_sets

from gmlx.engine import lanes
from gmlx.policy import control, pairs, width_control
from gmlx.policy.admission import Round

PLACES = 4  # periods named by their distance from a boundary; the rest are "mid"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-f32")
    ap.add_argument("--kind", default="chat", help="code or chat (the embedded model: code)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--forced", help="S,P: S rounds of K = 1, then P plain, repeating within each request")
    a = ap.parse_args()
    lm = model(a.model)
    prompts = prompt_sets(lm, a.model)[a.kind]
    periods, samples, rounds = [], [], {"n": 0}
    add_time, emit, choose, run = (width_control.WidthControl.add_time, pairs.Pairs._emit,
                                   control.Controller.choose, lanes.Lanes.run)

    def timed(self, k, seconds):
        periods.append((k, seconds))
        return add_time(self, k, seconds)

    def sampled(self):
        taken = self.samples
        emit(self)
        if self.samples > taken:  # the sample just taken: its K is the speculative side's nearest the boundary
            k = (self.before[-1] if self.run_plain else self.run[0])[0]
            samples.append(("spec -> plain" if self.run_plain else "plain -> spec", k, math.exp(self.logs[k][-1])))

    def forced(self, width, max_k, acceptance=None, *args, **kw):
        c = choose(self, width, max_k, acceptance, *args, **kw)
        if width != 1 or not a.forced:
            return c
        s, p = map(int, a.forced.split(","))
        k = 1 if rounds["n"] % (s + p) < s else 0
        return dataclasses.replace(c, k=k, window=False, best_spec=(1, c.best_spec[1] if c.best_spec else 1.0))

    def counted(self, kind, width):
        res = run(self, kind, width)
        if kind in (Round.SCALAR, Round.SCALAR_LAST):
            rounds["n"] += 1
        return res

    width_control.WidthControl.add_time, pairs.Pairs._emit = timed, sampled
    control.Controller.choose, lanes.Lanes.run = forced, counted
    for _ in range(a.repeats):
        for i, p in enumerate(prompts):
            rounds["n"] = 0
            lone.one(lm, "light", [p], a.max_tokens, fresh=i == 0)
            periods.append(None)  # a request's end ends its runs
    print(f"{a.model} {a.kind}, {a.repeats} x {len(prompts)} requests of {a.max_tokens} tokens"
          + (f", forced {a.forced}" if a.forced else ", as shipped"))
    by = collections.defaultdict(list)
    for kind, place, k, seconds in _placed(periods):
        by[kind, k, place].append(seconds)
    order = [f"first{i}" for i in range(1, PLACES + 1)] + ["mid"] + [f"last{i}" for i in range(PLACES, 0, -1)]
    print("| kind | K | " + " | ".join(order) + " |")
    print("|---|---|" + "---|" * len(order))
    for kind, k in sorted({(kind, k) for kind, k, _ in by}):
        cells = [f"{1000 * statistics.median(by[kind, k, o]):.1f} ({len(by[kind, k, o])})" if by[kind, k, o] else "-"
                 for o in order]
        print(f"| {kind} | {k} | " + " | ".join(cells) + " |")
    mid = by["spec", 1, "mid"], by["plain", 0, "mid"]
    if all(mid):
        print(f"K = 1 / plain, mid-run periods: {statistics.median(mid[0]) / statistics.median(mid[1]):.3f}")
    for d in ("plain -> spec", "spec -> plain"):
        xs = [r for dd, k, r in samples if dd == d and k == 1]
        if xs:
            print(f"pairs at {d} boundaries, K = 1: median {statistics.median(xs):.3f} of {len(xs)}")


def _placed(periods: list[tuple[int, float] | None]) -> list[tuple[str, str, int, float]]:
    """(kind, place, k, seconds) per period: its run is the periods of one sort (plain or
    speculative) in a row within one request (None: a request's end); its place, first1.. from
    the run's start, last1.. from its end, else mid."""
    out, i = [], 0
    while i < len(periods):
        if periods[i] is None:
            i += 1
            continue
        j = i
        while j < len(periods) and periods[j] is not None and (periods[j][0] > 0) == (periods[i][0] > 0):
            j += 1
        for q in range(i, j):
            ahead, behind = q - i + 1, j - q
            place = f"first{ahead}" if ahead <= PLACES else f"last{behind}" if behind <= PLACES else "mid"
            out.append(("spec" if periods[q][0] else "plain", place, periods[q][0], periods[q][1]))
        i = j
    return out


if __name__ == "__main__":
    main()
