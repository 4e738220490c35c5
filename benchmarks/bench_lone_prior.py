"""A lone request's prior (gmlx/policy/figures.py, LONE_PRIOR_ROUNDS): code and chat requests
alternating in one process, one at a time, as shipped (the online control on), with a new request's
own acceptance estimate starting from the pool's rates worth LONE_PRIOR_ROUNDS rounds ("light")
or at the pool's full weight ("heavy", ~33 rounds at DECAY: gmlx before the change) — beside
plain. Both default arms share the one pool (the control's figures are kept per target), so
they differ only in what a new request copies from it.

Greedy, EOS ignored, c = 1 (each repeat: one code request, then one chat request, each arm; the
arm order alternates between repeats). Speedups: medians of per-repeat ratios to plain.

Run: ``python benchmarks/bench_lone_prior.py --model smollm2-f32 --repeats 16 --max-tokens 48``
Writes bench_results/<utc>_lone_prior.json and .md.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import gmlx  # noqa: F401  (OpenBLAS before mlx)

from gmlx.machine import describe
from gmlx.policy import control

from bench_matrix import ARMS, model, prompt_sets
from common import command_line, ratio, run_burst, write_result

PRIORS = {"light": control.LONE_PRIOR_ROUNDS, "heavy": None}  # None: the pool's full (DECAY-scaled) weight


def one(lm, arm: str, prompt: list[int], max_tokens: int) -> dict:
    config, switches, _ = ARMS["plain" if arm == "plain" else "default"]
    if arm != "plain":
        control.LONE_PRIOR_ROUNDS = PRIORS[arm]
    try:
        return run_burst(lm, [prompt], max_tokens, config, switches)
    finally:
        control.LONE_PRIOR_ROUNDS = PRIORS["light"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-f32")
    ap.add_argument("--repeats", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--out", type=Path, default=Path("bench_results"))
    a = ap.parse_args()
    lm = model(a.model)
    pools = prompt_sets(lm, a.model)
    arms = ["plain", "light", "heavy"]
    for arm in arms:  # warm-up: kernels, the probe, the allocator
        one(lm, arm, pools["code"][0], 8)
    reps = {kind: {arm: [] for arm in arms} for kind in pools}
    for rep in range(a.repeats):
        for kind, pool in pools.items():
            for arm in arms if rep % 2 == 0 else list(reversed(arms)):
                r = one(lm, arm, pool[rep % len(pool)], a.max_tokens)
                reps[kind][arm].append(r)
                print(f"rep {rep} {kind} {arm:6s} {r['tok_s']:6.1f} tok/s acc {r['acc']}", flush=True)
    cells = []
    for kind, by_arm in reps.items():
        plain = by_arm["plain"]
        cell = {"kind": kind,
                "same_tokens": {arm: all(x["out"] == p["out"] for x, p in zip(by_arm[arm], plain)) for arm in arms},
                "tok_s": {arm: statistics.median(x["tok_s"] for x in by_arm[arm]) for arm in arms},
                "speedup": {arm: ratio(by_arm, arm, "plain") for arm in arms},
                "drafted_share": {arm: sum(x["acc"] is not None for x in by_arm[arm]) / len(plain) for arm in arms},
                "per_rep": {arm: [round(x["tok_s"] / p["tok_s"], 3) for x, p in zip(by_arm[arm], plain)]
                            for arm in arms}}
        cells.append(cell)
    result = {"machine": describe(), "command": command_line("bench_lone_prior.py", a), "cells": cells}
    path = write_result(a.out, "lone_prior", result)
    lines = [f"`{result['command']}`", "",
             "| prompts | plain tok/s | light (8 rounds) | heavy (pool's weight) | same tokens |",
             "|---|---|---|---|---|"]
    for c in cells:
        lines.append(f"| {c['kind']} | {c['tok_s']['plain']:.1f} | {c['speedup']['light']:.2f}x "
                     f"(drafted in {c['drafted_share']['light']:.0%}) | {c['speedup']['heavy']:.2f}x "
                     f"(drafted in {c['drafted_share']['heavy']:.0%}) | {all(c['same_tokens'].values())} |")
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
