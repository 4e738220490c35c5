"""The batch width's rules of 2026-12-05 side by side with the rules before them, in one process:
plain, the default (a width's costs read off its rows' forwards, `Costs.at_width`; a width whose
rounds shadow starts plain, `SHADOW_FIRST`; a plain width's shadows stop where nothing pays,
`Controller.far_from_paying`), `before` (the same engine with those three undone: width 1's
costs at every width, a new width's first try on the prior, shadows for as long as a width is
plain; the exploration's gate on a shadowed width's prediction stays), and K = 1 every round.
bench_control's closed loop (8 prompts, every request the same budget, EOS ignored unless
`--eos`); every arm starts from nothing learnt (a fresh process's state), arms interleaved per
repeat with the order alternating; ratios are medians of per-repeat ratios to plain.

`--arms` picks others: any arm with `-nohold` appended runs without admission's hold for grouped
refills (gmlx/policy/admission.py HOLD_ROUNDS = 0; 2026-12-05, later), e.g. `--arms
plain,plain-nohold,default,default-nohold,k1,k1-nohold`; with `-stop90`, a plain width's shadows stop
only where every K is predicted under 0.9 (thresholds.SHADOW_STOP before 2026-12-05's last change: 1.05);
with `-span8`, after 8 rounds predicting no gain instead of 24 (thresholds.SHADOW_SPAN); with
`-noagain`, a width whose shadows stopped explores by a try whatever K is predicted (before
thresholds.SHADOW_AGAIN, 2026-12-06 later).

Run: ``python benchmarks/bench_batch_rules.py --model smollm2-f32 --concurrency 2,4 --repeats 6``
Writes bench_results/<utc>_batch_rules.json and .md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from contextlib import contextmanager
from pathlib import Path

import gmlx  # noqa: F401  (OpenBLAS before mlx)

from gmlx.data import load_prompts
from gmlx.machine import describe
from gmlx.policy import admission, control, costs, width_control

import bench_control
from common import command_line, write_result

ARMS = ("plain", "default", "before", "k1")


@contextmanager
def rules(arm: str):
    """The engine's rules for this arm: `before` undoes the three, `-nohold` the hold, every other
    arm runs as shipped."""
    saved = (costs.Costs.at_width, control.Controller.far_from_paying, width_control.SHADOW_FIRST,
             admission.HOLD_ROUNDS, width_control.SHADOW_STOP, width_control.SHADOW_SPAN, width_control.SHADOW_AGAIN)
    if "-span8" in arm:
        width_control.SHADOW_SPAN = 8
    if "-noagain" in arm:
        width_control.SHADOW_AGAIN = False
    if "-nohold" in arm:
        admission.HOLD_ROUNDS = 0
    if "-stop90" in arm:
        width_control.SHADOW_STOP = 0.9
    if base_arm(arm) == "before":
        costs.Costs.at_width = lambda self, width: self
        control.Controller.far_from_paying = lambda self, width: False
        width_control.SHADOW_FIRST = False
    try:
        yield
    finally:
        (costs.Costs.at_width, control.Controller.far_from_paying, width_control.SHADOW_FIRST,
         admission.HOLD_ROUNDS, width_control.SHADOW_STOP, width_control.SHADOW_SPAN, width_control.SHADOW_AGAIN) = saved


def base_arm(arm: str) -> str:
    """The arm without its suffixes (`-nohold`, `-stop90`, `-span8`, `-noagain`)."""
    return arm.split("-")[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-f32", choices=("smollm2-f32", "smollm2-q"))
    ap.add_argument("--concurrency", default="2,4")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--eos", action="store_true", help="requests stop at EOS (else every one runs its budget)")
    ap.add_argument("--arms", default=",".join(ARMS), help="plain first; -nohold: without admission's hold;"
                    " -stop90: shadows stopped at the level before")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "bench_results")
    a = ap.parse_args()
    arms = tuple(a.arms.split(","))
    assert arms[0] == "plain", "--arms starts with plain (the ratios' base)"
    lm = bench_control.model(a.model)
    prompts = [lm.tokenizer.encode(p) for p in load_prompts()][:8]
    cells = []
    for c in [int(x) for x in a.concurrency.split(",")]:
        runs = []
        for rep in range(a.repeats):
            run = {}
            for arm in arms if rep % 2 == 0 else arms[::-1]:
                control.forget(lm.target)  # nothing learnt: each arm as a fresh process
                base = base_arm(arm)
                with rules(arm):
                    r = bench_control.closed_loop(lm, "default" if base == "before" else base, prompts, c,
                                                  a.max_tokens, a.eos)
                run[arm] = r
            same = all(r["out"] == run["plain"]["out"] for r in run.values())
            runs.append({arm: {"tok_s": r["tok_s"], "spec_share": r["spec_share"]} for arm, r in run.items()}
                        | {"same_tokens": same})
            print(c, rep, {arm: round(run[arm]["tok_s"] / run["plain"]["tok_s"], 3) for arm in arms}, flush=True)
        ratio = {arm: statistics.median(r[arm]["tok_s"] / r["plain"]["tok_s"] for r in runs) for arm in arms}
        cells.append({"c": c, "ratio": ratio, "same_tokens": all(r["same_tokens"] for r in runs), "runs": runs})
        print("==", c, {arm: round(v, 3) for arm, v in ratio.items()}, flush=True)
    result = {"command": command_line("bench_batch_rules.py", a), "machine": describe(), "cells": cells}
    path = write_result(a.out, "batch_rules", result)
    vs = next((("default", o) for o in ("before", "default-stop90", "default-nohold", "default-noagain", "default-span8")
               if o in arms), ("default", "before"))
    lines = [f"`{result['command']}`", "", "Medians of per-repeat ratios to plain (wall time, interleaved);"
             " `before`: the rules before 2026-12-05's batch-width changes; `-nohold`: without admission's hold;"
             " `-stop90`: shadows stopped only under 0.9",
             "", "| c | plain tok/s | " + " | ".join(arms) + f" | {vs[0]} beat {vs[1]} | same tokens |",
             "|---|---|" + "---|" * (len(arms) + 2)]
    for cell in cells:
        wins = sum(r[vs[0]]["tok_s"] > r[vs[1]]["tok_s"] for r in cell["runs"]) if set(vs) <= set(arms) else 0
        rate = statistics.median(r["plain"]["tok_s"] for r in cell["runs"])
        lines.append(f"| {cell['c']} | {rate:.1f} | " + " | ".join(f"{cell['ratio'][arm]:.3f}" for arm in arms)
                     + f" | {wins} of {len(cell['runs'])} | {cell['same_tokens']} |")
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(path)


if __name__ == "__main__":
    sys.exit(main())
