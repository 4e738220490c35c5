"""The CPU backend's fused norms and rotary embeddings (gmlx/models/cpu_fused.py), on and off, side
by side in one process: plain decoding and the shipped default (EAGLE-3 head, online control) on
SmolLM2, code and chat prompts, at c = 1 and 4.

Both sides run the same model objects; "off" gives their norms and rotary embeddings back their
mlx-lm classes for its runs (what GMLX_COMPILE=0 loads, without its other effects). Closed loops
(benchmarks/common.py) over a kind's prompts, EOS ignored; arms interleaved, the order alternating
per repeat; each run starts with nothing learnt (the control's figures from the other side would
mix in); the load probe's costs are the fused model's. A cell's figure is the median of per-repeat
ratios to the first arm (plain unfused). Tokens are checked equal across the arms (greedy). `--sides
noangles,fused` compares the fused modules with and without the rotary angles shared within a forward.

Run: ``python benchmarks/bench_cpu_fused.py --models smollm2-f32,smollm2-q --concurrency 1,4 --repeats 5``
Writes bench_results/<utc>_cpu_fused.json and .md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import gmlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.nn as nn

from gmlx import Engine, EngineConfig
from gmlx.config import Switches
from gmlx.gguf.smollm2 import converted
from gmlx.machine import describe
from gmlx.models import cpu_fused
from gmlx.models.cpu_fused import FUSED
from gmlx.models.loading import load
from gmlx.policy import control

from bench_matrix import prompt_sets
from common import closed_loop, command_line, write_result

ARMS = {"plain": (EngineConfig(speculative=False, prompt_cache_bytes=0), Switches(control=False)),
        "default": (EngineConfig(prompt_cache_bytes=0), Switches(control=True))}
_BASE = {fused: base for base, fused in FUSED.items()}


def modules(lm) -> list:
    """Every module the engine runs: the target (and its dequantized twin), the head."""
    roots = [lm.target.model] + ([lm.target.twin] if lm.target.twin is not None else [])
    if lm.head is not None and isinstance(getattr(lm.head, "module", None), nn.Module):
        roots.append(lm.head.module)
    return [m for r in roots for _, m in r.named_modules()]


def set_fused(mods: list, on: bool) -> None:
    """Each fused module (as `load` left them) to its fused class (on) or back to mlx-lm's (off)."""
    for m, base in mods:
        m.__class__ = FUSED[base] if on else base


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2-f32,smollm2-q")
    ap.add_argument("--kinds", default="code,chat")
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sides", default="unfused,fused", help="unfused, fused, noangles (fused, each rotary call"
                    " computing its angles: cpu_fused.ANGLES off); the first is the base")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "bench_results")
    a = ap.parse_args()
    cells = []
    for model in a.models.split(","):
        lm = load(converted("float32" if model == "smollm2-f32" else "q"))
        mods = [(m, _BASE[type(m)]) for m in modules(lm) if type(m) in _BASE]
        for kind in a.kinds.split(","):
            prompts = prompt_sets(lm, "smollm2")[kind]
            for c in [int(x) for x in a.concurrency.split(",")]:
                names = [f"{arm}-{side}" for arm in ARMS for side in a.sides.split(",")]
                runs: dict[str, list] = {n: [] for n in names}
                for rep in range(a.repeats + 1):  # the first: a warm-up, not counted
                    for name in (names if rep % 2 == 0 else names[::-1]):
                        arm, side = name.split("-")
                        set_fused(mods, side != "unfused")
                        cpu_fused.ANGLES = side != "noangles"
                        cfg, sw = ARMS[arm]
                        control.forget(lm.target)  # each run as a fresh process's: no figures of the other side
                        r = closed_loop(Engine(lm, cfg, switches=sw), prompts, c, a.max_tokens)
                        if rep:
                            runs[name].append(r)
                set_fused(mods, True)
                cpu_fused.ANGLES = True
                base = runs[names[0]]
                same = all(r["out"] == base[0]["out"] for rs in runs.values() for r in rs)
                cell = {"model": model, "kind": kind, "c": c, "same_tokens": same, "arms": {
                    n: {"tok_s": statistics.median(r["tok_s"] for r in rs),
                        "ratio": statistics.median(r["tok_s"] / b["tok_s"] for r, b in zip(rs, base)),
                        "per_rep": [round(r["tok_s"] / b["tok_s"], 3) for r, b in zip(rs, base)]}
                    for n, rs in runs.items()}}
                cells.append(cell)
                print(model, kind, c, same, {n: round(v["ratio"], 3) for n, v in cell["arms"].items()}, flush=True)
    result = {"command": command_line("bench_cpu_fused.py", a), "machine": describe(), "cells": cells}
    path = write_result(a.out, "cpu_fused", result)
    names = list(cells[0]["arms"]) if cells else []
    lines = [f"`{result['command']}`", "", f"Tokens/s relative to {names[0]} (median of per-repeat ratios);"
             " tokens identical across arms: " + str(all(c["same_tokens"] for c in cells)), "",
             f"| model | prompts | c | {names[0]} tok/s | " + " | ".join(names) + " |",
             "|---|---|---|---|" + "---|" * len(names)]
    for c in cells:
        lines.append(f"| {c['model']} | {c['kind']} | {c['c']} | {c['arms'][names[0]]['tok_s']:.1f} | "
                     + " | ".join(f"{c['arms'][n]['ratio']:.3f}x" for n in names) + " |")
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(path)


if __name__ == "__main__":
    sys.exit(main())
