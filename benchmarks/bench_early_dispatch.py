"""Early dispatch (gmlx/models/early_dispatch.py), off and on, side by side in one process: plain
decoding, K = 1 every round and the shipped default (online control), each off and on, on SmolLM2 (code and chat
prompts) and the embedded model (its shipped code prompts), at concurrency c.

Both sides run the same engine; GMLX_EARLY_DISPATCH (read at each forward) says which. Closed loops
(benchmarks/common.py) over a kind's prompts, EOS ignored; arms interleaved, the order alternating
per repeat, after one warm-up repeat not counted; each run starts with nothing learnt and measures
its own load-probe costs (the probe times verifies as the engine runs them, so with or without
early dispatch). A cell's figures are medians of per-repeat ratios to plain with early dispatch off,
and (in parentheses) to plain on the same side. Tokens are checked equal across the arms (greedy).

Run: ``python benchmarks/bench_early_dispatch.py --models smollm2-f32,embedded --concurrency 1 --repeats 5``
Writes bench_results/<utc>_early_dispatch.json and .md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import gmlx  # noqa: F401  (OpenBLAS before mlx)

from gmlx import Engine, EngineConfig, switches
from gmlx.decode import probe
from gmlx.machine import describe
from gmlx.policy import control
from gmlx.policy.figures import owner

from bench_matrix import model, prompt_sets
from common import closed_loop, command_line, write_result

# arm -> (engine config, GMLX_EARLY_DISPATCH)
ARMS = {"plain-off": (EngineConfig(speculative=False, prompt_cache_bytes=0), "0"),
        "plain-on": (EngineConfig(speculative=False, prompt_cache_bytes=0), "1"),
        "k1-off": (EngineConfig(num_draft_tokens=1, prompt_cache_bytes=0), "0"),
        "k1-on": (EngineConfig(num_draft_tokens=1, prompt_cache_bytes=0), "1"),
        "default-off": (EngineConfig(prompt_cache_bytes=0), "0"),
        "default-on": (EngineConfig(prompt_cache_bytes=0), "1")}


def model_prompts(name: str, kinds: list[str]) -> tuple[object, dict[str, list]]:
    """bench_matrix's model and its prompt sets (the embedded model: code only), the kinds asked for."""
    lm = model(name)
    return lm, {k: v for k, v in prompt_sets(lm, name).items() if k in kinds}


def run_cell(lm, prompts: list, c: int, max_tokens: int, repeats: int) -> dict:
    runs: dict[str, list] = {n: [] for n in ARMS}
    names = list(ARMS)
    for rep in range(repeats + 1):  # the first: a warm-up, not counted
        for name in (names if rep % 2 == 0 else names[::-1]):
            cfg, early = ARMS[name]
            switches.EARLY_DISPATCH.put(early)
            control.forget(lm.target)  # each run as a fresh process's: nothing learnt by the other side
            probe._measured.pop(owner(lm.target), None)  # and its own probe, timed as its verifies run
            r = closed_loop(Engine(lm, cfg), prompts, c, max_tokens)
            if rep:
                runs[name].append(r)
    switches.EARLY_DISPATCH.put(None)
    base = runs["plain-off"]
    return {"same_tokens": all(r["out"] == base[0]["out"] for rs in runs.values() for r in rs), "arms": {
        n: {"tok_s": statistics.median(r["tok_s"] for r in rs),
            "ratio": statistics.median(r["tok_s"] / b["tok_s"] for r, b in zip(rs, base)),
            # against plain on the same side: what a user of that side sees speculation give
            "vs_plain_same_side": statistics.median(
                r["tok_s"] / p["tok_s"] for r, p in zip(rs, runs["plain-" + n.split("-")[1]])),
            "per_rep": [round(r["tok_s"] / b["tok_s"], 3) for r, b in zip(rs, base)],
            "spec_share": statistics.median(r["spec_share"] for r in rs)}
        for n, rs in runs.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2-f32,embedded", help="smollm2-f32, smollm2-q, embedded")
    ap.add_argument("--kinds", default="code,chat", help="SmolLM2's prompt kinds (the embedded model: code)")
    ap.add_argument("--concurrency", default="1")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "bench_results")
    a = ap.parse_args()
    cells = []
    for model in a.models.split(","):
        lm, sets = model_prompts(model, a.kinds.split(","))
        for kind, prompts in sets.items():
            for c in [int(x) for x in a.concurrency.split(",")]:
                cell = {"model": model, "kind": kind, "c": c, **run_cell(lm, prompts, c, a.max_tokens, a.repeats)}
                cells.append(cell)
                print(model, kind, c, cell["same_tokens"], {n: round(v["ratio"], 3) for n, v in cell["arms"].items()},
                      flush=True)
    result = {"command": command_line("bench_early_dispatch.py", a), "machine": describe(), "cells": cells}
    path = write_result(a.out, "early_dispatch", result)
    names = list(ARMS)
    lines = [f"`{result['command']}`", "", "Tokens/s relative to plain with early dispatch off (in parentheses: to"
             " plain on the same side), medians of per-repeat ratios; tokens identical across arms: "
             + str(all(c["same_tokens"] for c in cells)), "",
             "| model | prompts | c | plain-off tok/s | " + " | ".join(names[1:]) + " |",
             "|---|---|---|---|" + "---|" * (len(names) - 1)]
    for c in cells:
        lines.append(f"| {c['model']} | {c['kind']} | {c['c']} | {c['arms']['plain-off']['tok_s']:.1f} | " + " | ".join(
            f"{c['arms'][n]['ratio']:.3f}x ({c['arms'][n]['vs_plain_same_side']:.3f}x)" for n in names[1:]) + " |")
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(path)


if __name__ == "__main__":
    sys.exit(main())
