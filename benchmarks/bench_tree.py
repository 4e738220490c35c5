"""Tree verification benchmark (issue 20): plain vs chain vs tree in the scalar lane, width 1.

Per model (the embedded model, SmolLM2-135M-Instruct float32), greedy, EOS ignored, the same
prompts: plain decode, the chain (MTP head, K drafts), the tree always (top-2 at depth 1, then
greedy chains: 2 paths of K drafts, verified as 2 rows of one forward over the shared prefix
K/V), and the tree chosen by measurement (GMLX_TREE=1's default: `auto`). 3 interleaved
repeats, medians of per-repeat rates. Decode only (the prefill is outside the timed loop).

Also the cost the tree adds per round, measured alone at each prompt's context length (fastest of
repeats): the verify forward of 2 rows x (K+1) over the shared prefix vs the chain's 1 row x
(K+1), both relative to one plain step, and the prefix copy (the broadcast+concatenate of every
layer's K/V the 2-row attention reads) alone.

Run (from the repository root): ``python benchmarks/bench_tree.py --max-tokens 48 --prompts 3 --repeats 3``
Writes bench_results/<utc>_tree.json and .md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import gmlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import numpy as np

from gmlx import SamplingParams
from gmlx.data import load_prompts
from gmlx.decode.prefill import prefill_row
from gmlx.decode.scalar import ScalarLane
from gmlx.decode.tree_verify import TreeKV, TreeScalarLane
from gmlx.drafters.select import select_drafter
from gmlx.machine import describe
from gmlx.gguf import smollm2
from gmlx.models.loading import load
from gmlx.engine.oracle import make_row

from common import command_line, write_result


def lanes(lm, k: int, a_min_q: float) -> dict:
    d = select_drafter(lm)
    return {
        "plain": lambda: ScalarLane(lm.target, None, k),
        "chain": lambda: ScalarLane(lm.target, d, k, may_go_plain=False),
        "tree": lambda: TreeScalarLane(lm.target, d, k, may_go_plain=False, tree="always"),
        "tree_pruned": lambda: TreeScalarLane(lm.target, d, k, may_go_plain=False, tree="always", min_q=a_min_q),
        "tree_auto": lambda: TreeScalarLane(lm.target, d, k, may_go_plain=False, tree="auto"),
    }


ROUND_TIMES: list[float] = []


def decode(lm, lane, prompt, params) -> tuple[int, float, int, int, int]:
    tree_before = getattr(lane, "tree_rounds", 0)
    row = make_row(lm, prompt, params)
    lane.start(row)
    t0 = time.perf_counter()
    rounds = drafted = accepted = 0
    last = t0
    while not row.is_done:
        res = lane.round()
        rounds += 1
        drafted, accepted = drafted + res.drafted, accepted + res.accepted
        row.take(res, time.perf_counter())
        now = time.perf_counter()
        ROUND_TIMES.append(now - last)  # between round reads (the pipeline's period)
        last = now
    dt = time.perf_counter() - t0
    tree_rounds = getattr(lane, "tree_rounds", 0) - tree_before
    lane.clear()
    return len(row.tokens), dt, rounds, accepted, tree_rounds


def run_model(name, lm, prompts, a) -> dict:
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, seed=0, ignore_eos=True)
    arms = {n: make() for n, make in lanes(lm, a.k, a.min_q).items()}  # one lane per arm, kept (as an engine's)
    for p in prompts[:2]:  # warm-up
        for mk in arms.values():
            decode(lm, mk, p, params)
    per_rep = {n: [] for n in arms}
    for rep in range(a.repeats):
        for n in (list(arms) if rep % 2 == 0 else list(reversed(arms))):
            toks = secs = rounds = acc = trees = 0
            ROUND_TIMES.clear()
            for p in prompts:
                t, s, r, ac, tr = decode(lm, arms[n], p, params)
                toks, secs, rounds, acc, trees = toks + t, secs + s, rounds + r, acc + ac, trees + tr
            p25 = float(np.percentile(ROUND_TIMES, 25))
            per_rep[n].append({"tok_s": toks / secs, "tokens_per_round": toks / rounds, "accepted": acc,
                               "round_ms_p25": 1e3 * p25, "robust_tok_s": toks / rounds / p25,
                               "rounds": rounds, "tree_rounds": trees,
                               "paths_per_tree_round": getattr(arms[n], "paths", 0) / max(getattr(arms[n], "tree_rounds", 0), 1)})
            print(f"{name} rep {rep} {n:10s} {toks / secs:7.1f} tok/s  {toks / rounds:.2f} tok/round"
                  f"  tree rounds {trees}/{rounds}", flush=True)
    summary = {n: {"tok_s_median": statistics.median(r["tok_s"] for r in reps),
                   "tokens_per_round": statistics.median(r["tokens_per_round"] for r in reps),
                   "tree_round_share": statistics.median(r["tree_rounds"] / r["rounds"] for r in reps),
                   "round_ms_p25": statistics.median(r["round_ms_p25"] for r in reps),
                   "robust_tok_s": statistics.median(r["robust_tok_s"] for r in reps)}
               for n, reps in per_rep.items()}
    pairs = (("chain", "plain"), ("tree", "plain"), ("tree", "chain"), ("tree_pruned", "chain"), ("tree_auto", "chain"))
    robust = {f"{x}/{y}": statistics.median(rx["robust_tok_s"] / ry["robust_tok_s"]
                                            for rx, ry in zip(per_rep[x], per_rep[y])) for x, y in pairs}
    ratios = {f"{x}/{y}": statistics.median(rx["tok_s"] / ry["tok_s"] for rx, ry in zip(per_rep[x], per_rep[y]))
              for x, y in (("chain", "plain"), ("tree", "plain"), ("tree", "chain"), ("tree_pruned", "chain"),
                           ("tree_auto", "chain"))}
    return {"summary": summary, "ratios_median_of_repeats": ratios, "robust_ratios": robust, "per_repeat": per_rep,
            "costs": costs(lm, prompts, a.k)}


def _fastest(fn, reps=7) -> float:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts)


def costs(lm, prompts, k: int) -> dict:
    """Per-round costs at each prompt's context, relative to one plain step (fastest of repeats)."""
    out = []
    for p in prompts:
        row = make_row(lm, p, SamplingParams(max_tokens=8, seed=0))
        cache = prefill_row(lm.target, row, 512, want_hidden=False).cache
        one = mx.array([[p[-1]]], dtype=mx.int32)
        chain_in = mx.array([[p[-1]] * (k + 1)], dtype=mx.int32)
        tree_in = mx.array([[p[-1]] * (k + 1)] * 2, dtype=mx.int32)

        def step(inputs, rows):
            if rows == 1:  # the chain's own path: the request's cache, rolled back after
                logits, _ = lm.target(inputs, cache)
                mx.eval(logits)
                for c in cache:
                    c.trim(inputs.shape[1])
                return
            views = [TreeKV(c, rows) for c in cache]  # reads the prefix, never writes the cache
            logits, _ = lm.target(inputs, views)
            mx.eval(logits)

        def copy_only():
            parts = []
            for c in cache:
                n, (_, h, _, d) = c.offset, c.keys.shape
                parts.append(mx.concatenate([mx.broadcast_to(c.keys[:, :, :n], (2, h, n, d)),
                                             mx.zeros((2, h, k + 1, d), c.keys.dtype)], axis=2))
            mx.eval(parts)

        t1 = _fastest(lambda: step(one, 1))
        out.append({"context": len(p) - 1,
                    "plain_step_ms": 1e3 * t1,
                    "chain_verify": _fastest(lambda: step(chain_in, 1)) / t1,
                    "tree_verify_2rows": _fastest(lambda: step(tree_in, 2)) / t1,
                    "prefix_copy_2rows_keys_only": _fastest(copy_only) / t1})
    med = {key: statistics.median(o[key] for o in out) for key in out[0] if key != "context"}
    return {"per_prompt": out, "median": med}


def markdown(result: dict) -> str:
    lines = [f"# Tree verification vs chain, width 1, greedy ({result['utc']})", "",
             f"Load average at the start (1 min): {result['machine'].get('load_avg_1m')}", "",
             f"Command: `{result['command']}`", "",
             f"Machine: {json.dumps(result['machine'], default=str)[:400]}", "",
             "tok/s: wall-clock decode rate (median of repeats). robust tok/s: tokens per round / the 25th"
             " percentile of the interval between round reads (load spikes on a shared host move the wall"
             " clock, much less the low percentile).", "",
             "| model | arm | tok/s (median) | tokens/round | round ms (p25) | robust tok/s | tree-round share |",
             "|---|---|---|---|---|---|---|"]
    for m, r in result["models"].items():
        for n, s in r["summary"].items():
            lines.append(f"| {m} | {n} | {s['tok_s_median']:.1f} | {s['tokens_per_round']:.2f} |"
                         f" {s['round_ms_p25']:.2f} | {s['robust_tok_s']:.1f} | {s['tree_round_share']:.2f} |")
    lines += ["", "| model | ratio | median of per-repeat wall ratios | median of per-repeat robust ratios |",
              "|---|---|---|---|"]
    for m, r in result["models"].items():
        for k, v in r["ratios_median_of_repeats"].items():
            lines.append(f"| {m} | {k} | {v:.3f} | {r['robust_ratios'][k]:.3f} |")
    lines += ["", "Per-round costs (in plain steps at the prompt's context; medians over prompts):", "",
              "| model | plain step ms | chain verify (1x(K+1)) | tree verify (2x(K+1)) | prefix copy to 2 rows (K only) |",
              "|---|---|---|---|---|"]
    for m, r in result["models"].items():
        c = r["costs"]["median"]
        lines.append(f"| {m} | {c['plain_step_ms']:.2f} | {c['chain_verify']:.2f} | {c['tree_verify_2rows']:.2f} |"
                     f" {c['prefix_copy_2rows_keys_only']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--models", default="embedded,smollm2")
    ap.add_argument("--min-q", type=float, default=0.15, help="the tree_pruned arm's depth-1 confidence threshold")
    ap.add_argument("--out", type=Path, default=Path("bench_results"))
    a = ap.parse_args()
    result = {"benchmark": "tree", "command": command_line("bench_tree.py", a), "machine": describe(),
              "k": a.k, "prompts": a.prompts, "max_tokens": a.max_tokens, "repeats": a.repeats, "models": {}}
    for name in a.models.split(","):
        lm = load() if name == "embedded" else load(smollm2.converted("float32"))
        prompts = [lm.tokenizer.encode(p) for p in load_prompts()[: a.prompts]]
        result["models"][name] = run_model(name, lm, prompts, a)
    path = write_result(a.out, "tree", result)
    result["utc"] = path.stem.split("_")[0]
    path.with_suffix(".md").write_text(markdown(result))
    print(path)
    print(markdown(result))


if __name__ == "__main__":
    main()
