"""A lone request's first token, side by side, one request at a time: plain decoding and speculation
as shipped, and each as gmlx ran it before its first token went out alone (`plain_before`: the step
after it dispatched first, plain.FIRST_TOKEN_OUT off; `default_before`: that, and a first round that
drafts from the prompt, FIRST_TOKEN_PLAIN off).

Each arm is one long-lived engine on its own thread (as `gmlx serve` runs one), read from its stream
as a client reads it: time to first token from submit to the first token out of the stream, and the
request's whole time from submit to its last token (prefill included). Per question, every arm in
turn, the order alternating; ratios are medians of per-question ratios to plain. Greedy, EOS ignored,
fixed length; every arm's tokens are checked against plain's.

`--loop`: what the rules cost a batch's throughput instead: each arm runs the kind's prompts as a closed loop
(`--concurrency` in flight, each finished request's place taken at once, so rows keep joining), stepped in
this thread; tokens/s per repeat, medians of per-repeat ratios to plain.

Run: ``python benchmarks/bench_first_token.py --model smollm2-f32 --repeats 3 --max-tokens 64`` (``--concurrency 4``:
bursts; ``--concurrency 4 --loop``: closed loops)
Writes bench_results/<utc>_first_token.json and .md.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path
from unittest.mock import patch

import gmlx  # noqa: F401  (OpenBLAS before mlx)

from gmlx import Engine, EngineConfig, SamplingParams
from gmlx.config import Switches
from gmlx.decode import plain, scalar
from gmlx.machine import describe

from bench_matrix import model, prompt_sets
from common import closed_loop, command_line, write_result

PLAIN = (EngineConfig(speculative=False, prompt_cache_bytes=0), Switches(control=False))
DEFAULT = (EngineConfig(prompt_cache_bytes=0), Switches(control=True))
ARMS = {"plain": (*PLAIN, True, True), "plain_before": (*PLAIN, False, False),  # (..., FIRST_TOKEN_OUT, _PLAIN)
        "default": (*DEFAULT, True, True), "default_before": (*DEFAULT, False, False)}


@contextlib.contextmanager
def rules_of(arm: str):
    """The first-token rules as the arm runs them (gmlx's, or gmlx before them)."""
    out, first_plain = ARMS[arm][2:]
    with patch.object(plain, "FIRST_TOKEN_OUT", out), patch.object(scalar, "FIRST_TOKEN_PLAIN", first_plain):
        yield


def timed(eng: Engine, prompts: list[list[int]], max_tokens: int, arm: str) -> dict:
    """Requests submitted together to a running engine, read as clients read their streams: the first
    token's time from submit (the first request's, read from its stream; with several, the median of the
    engine's `ttft_s`, which times the same), and the whole burst's."""
    with rules_of(arm):
        t0 = time.perf_counter()
        streams = [eng.submit(p, SamplingParams(max_tokens=max_tokens, seed=0, ignore_eos=True)) for p in prompts]
        first = None
        for _ in streams[0]:
            first = time.perf_counter() if first is None else first
        recs = [s.wait(600) for s in streams]
        end = time.perf_counter()
    ttft = first - t0 if len(recs) == 1 else statistics.median(r.stats["ttft_s"] for r in recs)
    return {"ttft": ttft, "total": end - t0, "tokens": [r.tokens for r in recs]}


def loops(lm, a) -> None:
    """--loop: each arm's closed loop over each kind's prompts, interleaved; tokens/s ratios to plain."""
    pools = prompt_sets(lm, a.model)
    reps = {(kind, arm): [] for kind in pools for arm in ARMS}
    for arm, (cfg, sw, *_) in ARMS.items():  # warm-up: kernels, the probe, the allocator
        with rules_of(arm):
            closed_loop(Engine(lm, cfg, switches=sw), next(iter(pools.values()))[:2], a.concurrency, 8)
    for rep in range(a.repeats):
        for kind, pool in pools.items():
            for arm in (list(ARMS) if rep % 2 == 0 else list(reversed(ARMS))):
                cfg, sw, *_ = ARMS[arm]
                with rules_of(arm):
                    reps[kind, arm].append(closed_loop(Engine(lm, cfg, switches=sw), pool * 2, a.concurrency, a.max_tokens))
            print(f"rep {rep} {kind} " + "  ".join(f"{arm} {reps[kind, arm][-1]['tok_s']:.1f}" for arm in ARMS), flush=True)
    cmd = command_line("bench_first_token.py", a)
    lines = [f"`{cmd}`", "", f"Closed loops of {a.concurrency} (each kind's prompts twice), tokens/s: median, and the",
             "median of per-repeat ratios to plain.", "", "| prompts | " + " | ".join(ARMS) + " | same tokens |",
             "|---|" + "---|" * len(ARMS) + "---|"]
    cells = []
    for kind in pools:
        ratio = {arm: statistics.median(r["tok_s"] / p["tok_s"] for r, p in zip(reps[kind, arm], reps[kind, "plain"]))
                 for arm in ARMS}
        same = all(r["out"] == p["out"] for arm in ARMS for r, p in zip(reps[kind, arm], reps[kind, "plain"]))
        cells.append({"kind": kind, "ratio_to_plain": ratio, "same_tokens": same,
                      "tok_s": {arm: [r["tok_s"] for r in reps[kind, arm]] for arm in ARMS}})
        lines.append(f"| {kind} | " + " | ".join(f"{statistics.median(r['tok_s'] for r in reps[kind, arm]):.1f}"
                                                  f" ({ratio[arm]:.2f})" for arm in ARMS) + f" | {same} |")
    print("\n".join(lines))
    path = write_result(a.out, "first_token_loop", {"machine": describe(), "command": cmd, "cells": cells})
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-f32", help="embedded, smollm2-f32 or smollm2-q")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=1, help="requests submitted together (a kind's next ones)")
    ap.add_argument("--loop", action="store_true", help="closed loops of --concurrency: the batch's throughput")
    ap.add_argument("--out", type=Path, default=Path("bench_results"))
    a = ap.parse_args()
    lm = model(a.model)
    if a.loop:
        return loops(lm, a)
    prompts = [(kind, [ps[(i + j) % len(ps)] for j in range(a.concurrency)])
               for kind, ps in prompt_sets(lm, a.model).items() for i in range(len(ps))]
    engines = {arm: Engine(lm, cfg, switches=sw) for arm, (cfg, sw, *_) in ARMS.items()}
    for arm, eng in engines.items():  # warm-up: kernels, the probe, the control's first figures
        timed(eng, prompts[0][1], 16, arm)
    runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for rep in range(a.repeats):
        for i, (kind, p) in enumerate(prompts):
            order = list(ARMS) if (rep + i) % 2 == 0 else list(reversed(ARMS))
            for arm in order:
                runs[arm].append({"kind": kind, **timed(engines[arm], p, a.max_tokens, arm)})
            print(f"rep {rep} {kind} " + "  ".join(f"{arm} ttft {runs[arm][-1]['ttft'] * 1e3:6.1f} ms total "
                                                  f"{runs[arm][-1]['total'] * 1e3:7.1f} ms" for arm in ARMS), flush=True)
    for eng in engines.values():
        eng.close()
    same = {arm: all(r["tokens"] == q["tokens"] for r, q in zip(runs[arm], runs["plain"])) for arm in ARMS}
    cells = []
    for kind in dict.fromkeys(k for k, _ in prompts):
        idx = [j for j, r in enumerate(runs["plain"]) if r["kind"] == kind]
        cell = {"kind": kind, "requests": len(idx)}
        for arm in ARMS:
            cell[arm] = {"ttft_ms": statistics.median(runs[arm][j]["ttft"] for j in idx) * 1e3,
                         "tok_s": sum(len(t) for j in idx for t in runs[arm][j]["tokens"]) / sum(runs[arm][j]["total"] for j in idx),
                         "ttft_vs_plain": statistics.median(runs[arm][j]["ttft"] / runs["plain"][j]["ttft"] for j in idx),
                         "speed_vs_plain": statistics.median(runs["plain"][j]["total"] / runs[arm][j]["total"] for j in idx)}
        cells.append(cell)
    cmd = command_line("bench_first_token.py", a)
    lines = [f"`{cmd}`", "", "Time to first token (median over requests; its ratio to plain's, median of per-request ratios) and",
             "the request's speed (prefill included: plain's whole time over the arm's, median per request); with",
             "--concurrency c, per burst of c requests submitted together (its requests' median first token).", "",
             "| prompts | " + " | ".join(f"{arm}: first token ms (/ plain) | {arm}: speed" for arm in ARMS) + " | same tokens |",
             "|---|" + "---|---|" * len(ARMS) + "---|"]
    for c in cells:
        lines.append(f"| {c['kind']} x {c['requests']}{f' bursts of {a.concurrency}' if a.concurrency > 1 else ''} | " + " | ".join(
            f"{c[arm]['ttft_ms']:.1f} ({c[arm]['ttft_vs_plain']:.2f}) | {c[arm]['speed_vs_plain']:.2f}x" for arm in ARMS)
            + f" | {all(same.values())} |")
    print("\n".join(lines))
    path = write_result(a.out, "first_token", {"machine": describe(), "command": cmd, "cells": cells, "same_tokens": same})
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
