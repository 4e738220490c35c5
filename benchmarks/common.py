"""What the benchmark scripts share: interleaved repeats over arms, medians and per-repeat ratios,
and one burst of requests through an engine."""

from __future__ import annotations

import json
import shlex
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

from gmlx import Engine, EngineConfig, SamplingParams
from gmlx.config import Switches


def interleave(arms: dict, prompts: list, repeats: int) -> dict[str, list[dict]]:
    """Each arm over all prompts once per repeat, the order alternating between repeats (the
    machine's drift hits every arm alike); `arm(prompt) -> (tokens, seconds, drafted, accepted)`.
    Two prompts warm every arm up first (kernels, allocator caches)."""
    for p in prompts[:2]:
        for fn in arms.values():
            fn(p)
    per_rep: dict[str, list[dict]] = {name: [] for name in arms}
    for rep in range(repeats):
        order = list(arms) if rep % 2 == 0 else list(reversed(arms))
        for name in order:
            toks, secs, drafted, accepted = 0, 0.0, 0, 0
            for p in prompts:
                n, dt, d, acc = arms[name](p)
                toks, secs, drafted, accepted = toks + n, secs + dt, drafted + d, accepted + acc
            per_rep[name].append({"tok_s": toks / secs, "drafted": drafted, "accepted": accepted})
            print(f"rep {rep} {name:26s} {toks / secs:8.1f} tok/s  acc {accepted / drafted if drafted else 0:.3f}",
                  flush=True)
    return per_rep


def summarize(per_rep: dict[str, list[dict]]) -> dict:
    out = {}
    for name, reps in per_rep.items():
        d = sum(r["drafted"] for r in reps)
        out[name] = {"tok_s_median": statistics.median(r["tok_s"] for r in reps),
                     "draft_acceptance_rate": (sum(r["accepted"] for r in reps) / d) if d else None}
    return out


def ratio(per_rep: dict[str, list[dict]], x: str, y: str, key: str = "tok_s") -> float:
    """Median over repeats of x's rate / y's rate in the same repeat (`key`: which rate)."""
    return statistics.median(rx[key] / ry[key] for rx, ry in zip(per_rep[x], per_rep[y]))


def run_burst(lm, prompts, max_tokens: int, config: EngineConfig, switches: Switches = Switches(),
              predictions: list | None = None, **engine_kwargs) -> dict:
    """Submit every prompt at once (greedy, fixed length, EOS ignored; `predictions`: each
    request's predicted output) and step the engine to the end: aggregate tokens/s including
    prefill, acceptance, transitions, and every request's tokens."""
    eng = Engine(lm, config, switches=switches, **engine_kwargs)
    preds = predictions or [None] * len(prompts)
    t0 = time.perf_counter()
    streams = [eng.submit(p, SamplingParams(max_tokens=max_tokens, seed=0, ignore_eos=True, prediction=pred),
                          start=False) for p, pred in zip(prompts, preds)]
    while eng.has_work:
        eng.step()
    dt = time.perf_counter() - t0
    recs = [s.wait(5) for s in streams]
    eng.close()
    toks = sum(len(r.tokens) for r in recs)
    drafted = sum(r.stats["num_drafted"] for r in recs)
    accepted = sum(r.stats["num_accepted"] for r in recs)
    return {"tok_s": toks / dt, "tokens": toks, "acc": accepted / drafted if drafted else None,
            "transitions": dict(eng.counters.transitions), "out": [r.tokens for r in recs], **decode_rate(recs)}


def decode_rate(recs: list) -> dict:
    """The requests' decode after their first token, as `gmlx generate` reports a request's rate
    (request_stats.tokens_per_s; mlx-lm's "Generation" figure): their tokens after the first over
    the sum of their decode intervals — prefill and the first token left out. With c > 1 requests
    overlapping, each request's own rate, pooled."""
    timed = [r.stats for r in recs if r.stats.get("tokens_per_s")]  # (None: no decode interval)
    n = sum(s["num_generated"] - 1 for s in timed)
    secs = sum((s["num_generated"] - 1) / s["tokens_per_s"] for s in timed)
    return {"decode_tokens": n, "decode_s": secs, "decode_tok_s": n / secs if secs else None}


def command_line(script: str, args) -> str:
    """The command that reproduces a run (every option but --out; a flag only when set)."""
    return f"python benchmarks/{script} " + " ".join(
        f"--{k.replace('_', '-')}" if v is True else
        f"--{k.replace('_', '-')} {' '.join(map(shlex.quote, map(str, v))) if isinstance(v, list) else shlex.quote(str(v))}"
        for k, v in vars(args).items() if k != "out" and v is not None and v is not False)


def write_result(out: Path, name: str, result: dict) -> Path:
    """bench_results/<UTC stamp>_<name>.json"""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{datetime.now(timezone.utc).strftime('%Y%m%dT%H%M%SZ')}_{name}.json"
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return path


def closed_loop(eng, prompts: list, c: int, max_tokens: int, ignore_eos: bool = True) -> dict:
    """c requests of `prompts` in flight on `eng` (stepped here) until all are done; the engine is
    closed after. Aggregate tokens/s over first submit .. last end, acceptance (drafts accepted /
    drafted, None when none was drafted), the share of rounds that drafted, the last request's
    `speculation` stat, and every request's tokens in the order of `prompts` (`out`)."""
    params = SamplingParams(max_tokens=max_tokens, seed=0, ignore_eos=ignore_eos)
    todo, live, recs, streams = list(prompts), [], [], []
    t0 = time.perf_counter()
    while todo or live:
        while todo and len(live) < c:
            live.append(eng.submit(todo.pop(0), params, start=False))
            streams.append(live[-1])
        eng.step()
        for s in [s for s in live if s.done]:
            live.remove(s)
            recs.append(s.result)
    dt = time.perf_counter() - t0
    eng.close()
    toks = sum(len(r.tokens) for r in recs)
    drafted = sum(r.stats["num_drafted"] for r in recs)
    return {"tok_s": toks / dt, "tokens": toks, "acc": sum(r.stats["num_accepted"] for r in recs) / drafted
            if drafted else None, "speculation": recs[-1].stats.get("speculation", ""),
            "spec_share": eng.counters.speculative_rounds / max(1, eng.counters.rounds),
            "out": [s.result.tokens for s in streams]}
