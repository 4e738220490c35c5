"""`bench_control.py`'s sequence on `sim_control.py`'s simulated clock: one process for every repeat
(the control's figures carry over from run to run, as in bench_control), its 8 package prompts,
32-token requests, the arms plain / default / K = 1 every round interleaved (the order alternating),
after the same warm-up. The tokens and decisions are the engine's; the clock is the model's table.

Why: bench_control's never-lose cells move 3-15 % between repeats on this VM; a cell under plain
there (the 4-bit model at c = 4, 2026-12-05: 0.96x, the default drafting 68-88 % of rounds) is a
decision or the noise — on this clock only the decisions count.

Run: ``python benchmarks/sim_bench_control.py --model smollm2-q --concurrency 2,4 [-v]`` (-v: each
repeat's decisions, one line per change of width, K or reason; ``--arms plain,k1,k2,k3`` the fixed K's;
``--variant NAME`` one of sim_control.py's rule variants for the default arm; ``--wall`` the same sequence in
wall time, its decisions logged as on the simulated clock). Prints per repeat and cell; writes
bench_results/<utc>_sim_bench_control.json (with --wall, _wall_bench_control.json).
"""

from __future__ import annotations

import argparse
import statistics
from collections import Counter
from pathlib import Path

import gmlx  # noqa: F401  (OpenBLAS before mlx)
from gmlx import Engine
from gmlx.data import load_prompts
from gmlx.decode import batch_shadow
from gmlx.gguf.smollm2 import converted
from gmlx.machine import describe
from gmlx.models.loading import load
from gmlx.policy import control

import sim_control
from bench_control import ARMS
from common import closed_loop, command_line, write_result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-q", choices=("smollm2-f32", "smollm2-q"))
    ap.add_argument("--concurrency", default="2,4")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--arms", default="plain,default,k1", help="bench_control's arms (plain first; k2, k3 too)")
    ap.add_argument("-v", action="store_true", help="print each repeat's decisions")
    ap.add_argument("--no-shadows", action="store_true", help="a gated batch without shadow rounds (before 2026-12-05)")
    ap.add_argument("--wall", action="store_true", help="this machine's clock instead (bench_control's noise; the decisions logged)")
    ap.add_argument("--variant", default=None, help="one of sim_control.py's VARIANTS, in force for the default arm's runs")
    a = ap.parse_args()
    batch_shadow.SHADOWS = not a.no_shadows
    lm = load(converted("float32" if a.model == "smollm2-f32" else "q"))
    clock = sim_control.SimClock(a.model)
    if not a.wall:
        clock.install()
    log: list = []
    choose = control.Controller.choose

    def logged(self, width, max_k, *args, **kw):
        ch = choose(self, width, max_k, *args, **kw)
        log.append((width, ch.k, ch.reason))
        return ch

    control.Controller.choose = logged
    arms = a.arms.split(",")
    prompts = [lm.tokenizer.encode(p) for p in load_prompts()][:8]

    variant = sim_control.VARIANTS.get(a.variant, [])
    shipped = [(obj, name, getattr(obj, name)) for obj, name, _ in variant]

    def run(arm, ps, c, n):
        clock.t, clock.rounds = 0.0, Counter()
        del log[:]
        for obj, name, value in (variant if arm == "default" else shipped):  # the variant: the default arm's alone
            setattr(obj, name, value)
        r = closed_loop(Engine(lm, ARMS[arm][0], switches=ARMS[arm][1]), ps, c, n)
        return {"tok_s": r["tok_s"] if a.wall else r["tokens"] / clock.t, "spec_share": round(r["spec_share"], 2),
                "rounds": {f"{w}:{k}": v for (w, k), v in clock.rounds.items()},
                "decisions": list(log), "out": r["out"]}

    for arm in arms:  # bench_control's warm-up
        run(arm, prompts[:2], 2, 8)
    cells = []
    for c in [int(x) for x in a.concurrency.split(",")]:
        reps = []
        for rep in range(a.repeats):
            res = {arm: run(arm, prompts, c, a.max_tokens) for arm in (arms if rep % 2 == 0 else arms[::-1])}
            assert all(res[arm]["out"] == res["plain"]["out"] for arm in arms)
            ratios = {arm: round(res[arm]["tok_s"] / res["plain"]["tok_s"], 3) for arm in arms[1:]}
            shown = res["default" if "default" in res else arms[-1]]
            print(f"c={c} rep {rep}: {ratios} drafting {shown['spec_share']:.0%} of rounds, rounds "
                  f"{sorted(shown['rounds'].items())}", flush=True)
            if a.v:
                last = None
                for w, k, reason in shown["decisions"]:
                    if (w, k, reason.split(",")[0]) != last:
                        print(f"   w{w} K={k} {reason}")
                    last = (w, k, reason.split(",")[0])
            reps.append({"ratios": ratios, "rounds": shown["rounds"]})
        cells.append({"c": c, **{f"{arm}_vs_plain": statistics.median(r["ratios"][arm] for r in reps) for arm in arms[1:]},
                      "reps": reps})
        print(f"== c={c}: " + ", ".join(f"{arm}/plain {cells[-1][arm + '_vs_plain']:.3f}" for arm in arms[1:]))
    print(write_result(Path(__file__).resolve().parents[1] / "bench_results",
                       "wall_bench_control" if a.wall else "sim_bench_control",
                       {"command": command_line("sim_bench_control.py", a), "machine": describe(), "cells": cells}))


if __name__ == "__main__":
    main()
