"""Batch benchmark (issue 3): aggregate tokens/s at several concurrencies with speculation
(uncapped and at the model's cap) vs the same engine plain vs mlx-lm's BatchGenerator, and
waiter TTFT with PREEMPT on vs off on a join-late workload. Interleaved repeats, medians.

Run: ``python benchmarks/bench_batch.py --concurrency 1,2,4,8,16 --max-tokens 64 --repeats 3``
Writes bench_results/<utc>_batch.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import gmlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from gmlx import Engine, EngineConfig, SamplingParams
from gmlx.config import Switches
from gmlx.data import load_prompts
from gmlx.machine import describe
from gmlx.models.cpu_fused import as_mlx_lm
from gmlx.models.loading import load

from common import run_burst, write_result


def run_engine(lm, prompts, max_tokens, *, speculative, cap, switches=Switches()):
    return run_burst(lm, prompts, max_tokens, EngineConfig(speculative=speculative, width_cap=cap), switches)


@as_mlx_lm()  # mlx-lm's own operations (gmlx/models/cpu_fused.py)
def run_mlx_lm(lm, prompts, max_tokens):
    gen = BatchGenerator(lm.target.model, max_tokens=max_tokens, completion_batch_size=64, prefill_batch_size=16)
    t0 = time.perf_counter()
    gen.insert(prompts, max_tokens=[max_tokens] * len(prompts))
    toks, done = 0, 0
    while done < len(prompts):
        for r in gen.next_generated():
            toks += 1
            done += r.finish_reason is not None
    dt = time.perf_counter() - t0
    gen.close()
    return {"tok_s": toks / dt, "tokens": toks, "acc": None, "transitions": {}}


def join_late(lm, prompts, *, preempt, incumbent_tokens, waiter_tokens, delay_rounds):
    """One long request alone, then waiters after `delay_rounds` rounds: their TTFT."""
    eng = Engine(lm, EngineConfig(), switches=Switches(preempt=preempt))
    long = eng.submit(prompts[0], SamplingParams(max_tokens=incumbent_tokens, seed=1, ignore_eos=True), start=False)
    for _ in range(delay_rounds):
        eng.step()
    waiters = [eng.submit(p, SamplingParams(max_tokens=waiter_tokens, seed=2, ignore_eos=True), start=False)
               for p in prompts[1:4]]
    while eng.has_work:
        eng.step()
    recs = [w.wait(5) for w in waiters]
    inc = long.wait(5)
    eng.close()
    return {"waiter_ttft_s": [r.stats["ttft_s"] for r in recs], "incumbent_tokens_left_at_join":
            incumbent_tokens - min(incumbent_tokens, delay_rounds), "incumbent_tok_s": inc.stats["tokens_per_s"],
            "transitions": dict(eng.counters.transitions)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", default="1,2,4,8,16")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--join-late-repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("bench_results"))
    a = ap.parse_args()
    lm = load()
    all_prompts = [lm.tokenizer.encode(p) for p in load_prompts()]
    widths = [int(x) for x in a.concurrency.split(",")]
    cap = lm.default_cap
    arms = {
        "spec_uncapped": lambda ps: run_engine(lm, ps, a.max_tokens, speculative=True, cap=0),
        f"spec_cap{cap}": lambda ps: run_engine(lm, ps, a.max_tokens, speculative=True, cap=cap),
        "plain": lambda ps: run_engine(lm, ps, a.max_tokens, speculative=False, cap=None),
        "mlx_lm_batchgenerator": lambda ps: run_mlx_lm(lm, ps, a.max_tokens),
    }
    for fn in arms.values():  # warm-up
        fn(all_prompts[:2])
    cells = {}
    for w in widths:
        ps = [all_prompts[i % len(all_prompts)] for i in range(w)]
        reps = {name: [] for name in arms}
        for rep in range(a.repeats):
            for name in (list(arms) if rep % 2 == 0 else list(reversed(arms))):
                reps[name].append(arms[name](ps))
                print(f"W={w} rep {rep} {name:24s} {reps[name][-1]['tok_s']:8.1f} tok/s"
                      f" acc {reps[name][-1]['acc']}", flush=True)

        def ratio(x, y, reps=reps):
            return statistics.median(rx["tok_s"] / ry["tok_s"] for rx, ry in zip(reps[x], reps[y]))

        cells[w] = {"median_tok_s": {n: statistics.median(r["tok_s"] for r in v) for n, v in reps.items()},
                    "acceptance": {n: v[0]["acc"] for n, v in reps.items()},
                    "ratios": {"spec_uncapped/plain": ratio("spec_uncapped", "plain"),
                               f"spec_cap{cap}/plain": ratio(f"spec_cap{cap}", "plain"),
                               "plain/mlx_lm": ratio("plain", "mlx_lm_batchgenerator"),
                               f"spec_cap{cap}/mlx_lm": ratio(f"spec_cap{cap}", "mlx_lm_batchgenerator")},
                    "transitions": {n: v[0]["transitions"] for n, v in reps.items()},
                    "per_repeat": reps}
    jl = {"preempt_on": [], "preempt_off": []}
    for rep in range(a.join_late_repeats):
        for name in (["preempt_on", "preempt_off"] if rep % 2 == 0 else ["preempt_off", "preempt_on"]):
            jl[name].append(join_late(lm, all_prompts, preempt=name == "preempt_on", incumbent_tokens=260,
                                      waiter_tokens=16, delay_rounds=10))
            print(f"join-late rep {rep} {name}: waiter TTFT {jl[name][-1]['waiter_ttft_s']}", flush=True)
    ttft = {n: statistics.median(t for r in v for t in r["waiter_ttft_s"]) for n, v in jl.items()}
    result = {"benchmark": "batch", "command": f"python benchmarks/bench_batch.py --concurrency {a.concurrency}"
              f" --max-tokens {a.max_tokens} --repeats {a.repeats} --join-late-repeats {a.join_late_repeats}",
              "machine": describe(), "model": str(lm.path), "k": lm.default_k, "model_cap": cap,
              "cells": cells, "join_late": {"waiter_ttft_p50_s": ttft,
                                             "ttft_ratio_off_over_on": ttft["preempt_off"] / ttft["preempt_on"],
                                             "runs": jl}}
    write_result(a.out, "batch", result)
    print(json.dumps({w: {k: c[k] for k in ("median_tok_s", "ratios")} for w, c in cells.items()}, indent=2))
    print(json.dumps(result["join_late"]["waiter_ttft_p50_s"]), result["join_late"]["ttft_ratio_off_over_on"])
    mx.clear_cache()


if __name__ == "__main__":
    main()
