"""Would token trees pay in the batch lane? (issue 20, part 1: "the batch lane where the cost model
says it pays — or a written reason why not yet").

The scalar lane's tree (gmlx/decode/tree_verify.py) verifies 2 paths of K drafts as 2 rows over the shared
prefix; a batch of B rows would verify 2B rows. What that costs, per width, against the chain's B
rows: one forward of the target over [B, 1] (a plain step), [B, K+1] (the chain's verify) and
[2B, K+1] (a 2-path tree per row), each at the prompts' context, fastest of repeats, relative to
the plain step at the same width. The tree pays only where its extra tokens per round (measured in
the scalar lane: bench_results/*_tree.md) exceed the extra verify cost tree/chain.

Run: ``python benchmarks/bench_tree_width.py --models embedded,smollm2-f32 --widths 1,2,4,8``
Writes bench_results/<utc>_tree_width.json and .md.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import gmlx  # noqa: F401  (OpenBLAS before mlx)

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from gmlx.data import load_prompts
from gmlx.machine import describe
from gmlx.models.loading import load

from common import command_line, write_result


def model(name: str):
    if name == "embedded":
        return load()
    from gmlx.gguf.smollm2 import converted

    return load(converted("float32"))


def forward_seconds(m, prompt: list[int], rows: int, width: int, reps: int) -> float:
    """Fastest forward of `rows` rows x `width` new tokens over a cache holding the prompt."""
    cache = make_prompt_cache(m)
    mx.eval(m(mx.array([prompt] * rows, dtype=mx.int32), cache=cache))  # sync: the prefill, untimed
    x = mx.array([prompt[-width:]] * rows, dtype=mx.int32)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(m(x, cache=cache))  # sync: the timed forward
        best = min(best, time.perf_counter() - t0)
        trim_prompt_cache(cache, width)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="embedded,smollm2-f32")
    ap.add_argument("--widths", default="1,2,4,8")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--out", type=Path, default=Path("bench_results"))
    a = ap.parse_args()
    result = {"machine": describe(), "command": command_line("bench_tree_width.py", a), "cells": []}
    for name in a.models.split(","):
        lm = model(name)
        m = lm.target.model
        prompt = lm.tokenizer.encode(load_prompts()[0])[:96]
        forward_seconds(m, prompt, 1, 1, 2)  # warm-up
        for b in (int(w) for w in a.widths.split(",")):
            plain = forward_seconds(m, prompt, b, 1, a.reps)
            chain = forward_seconds(m, prompt, b, a.k + 1, a.reps)
            tree = forward_seconds(m, prompt, 2 * b, a.k + 1, a.reps)
            cell = {"model": name, "width": b, "context": len(prompt), "plain_ms": 1e3 * plain,
                    "chain_verify": chain / plain, "tree_verify": tree / plain, "tree_over_chain": tree / chain}
            result["cells"].append(cell)
            print(cell, flush=True)
    path = write_result(a.out, "tree_width", result)
    lines = [f"K = {a.k}; forward costs relative to one plain step at the same width (fastest of {a.reps}).", "",
             "| model | width B | plain step ms | chain verify [B, K+1] | tree verify [2B, K+1] | tree / chain |",
             "|---|---|---|---|---|---|"]
    for c in result["cells"]:
        lines.append(f"| {c['model']} | {c['width']} | {c['plain_ms']:.2f} | {c['chain_verify']:.2f} | "
                     f"{c['tree_verify']:.2f} | {c['tree_over_chain']:.2f} |")
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
