"""Predicted outputs (issue 20): a request re-asked with a prediction, at width 1, greedy.

Cases:
- `reask`: the same prompt asked again with the previous answer as the prediction (the output then
  equals the prediction: the best case, as an editor re-running a request);
- `edit`: the prompt asks to rename a variable in a 26-line snippet; the prediction is the
  original snippet (the answer departs from it at every occurrence of the name, and wherever the
  model's answer differs from a copy).

Arms, one engine each on the same loaded model (prompt cache off, so no repeat reuses a prefill):
`plain` (no speculation), `drafter` (the model's own drafter, no prediction), `prediction` (the
same engine's drafter with the request's prediction). Per case and repeat the arms run back to
back in alternating order; the speedup is the median over repeats of the per-repeat ratio of
end-to-end times (submit to last token, prefill included: the same tokens in every arm, so the
time ratio is the speed ratio). Models: SmolLM2-135M-Instruct converted to float32 and the
embedded model (no chat template: its prompts are raw text).

Run: ``python benchmarks/bench_prediction.py --models smollm2,embedded --repeats 3 --max-tokens 256``
Writes bench_results/<utc>_prediction.json and .md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import gmlx  # noqa: F401  (OpenBLAS before mlx)

from gmlx import Engine, EngineConfig, SamplingParams
from gmlx.data import load_prompts
from gmlx.machine import describe
from gmlx.models.loading import load

from common import command_line, write_result

SNIPPET = '''def summarize(values, weights=None):
    """Return the weighted mean, the minimum and the maximum of values."""
    if not values:
        raise ValueError("values is empty")
    if weights is None:
        weights = [1.0] * len(values)
    total = 0.0
    weight_sum = 0.0
    lowest = values[0]
    highest = values[0]
    for value, weight in zip(values, weights):
        total += value * weight
        weight_sum += weight
        if value < lowest:
            lowest = value
        if value > highest:
            highest = value
    if weight_sum == 0:
        raise ZeroDivisionError("the weights sum to zero")
    mean = total / weight_sum
    return {
        "mean": mean,
        "min": lowest,
        "max": highest,
        "count": len(values),
    }
'''
EDIT_ASK = ("Rename the variable `total` to `running_sum` in this Python code. Reply with the complete code"
            " only.\n\n```python\n" + SNIPPET + "```")
CHAT_ASKS = ["Explain how a binary search tree works.",
             "Write a Python function that checks whether a string is a palindrome, with a docstring."]


def cases(lm, name: str) -> list[tuple[str, list[int], str | None]]:
    """(case, prompt ids, fixed prediction or None: the previous answer)."""
    tok = lm.tokenizer
    if getattr(tok, "chat_template", None) is not None:
        chat = lambda text: list(tok.apply_chat_template([{"role": "user", "content": text}],  # noqa: E731
                                                         add_generation_prompt=True))
        reask = [("reask", chat(q), None) for q in CHAT_ASKS]
        edit = [("edit", chat(EDIT_ASK), "```python\n" + SNIPPET + "```")]
    else:  # a code model: raw continuations; the edit as a comment before the rewritten code
        reask = [("reask", tok.encode(p), None) for p in load_prompts()[:2]]
        edit = [("edit", tok.encode("# Original:\n" + SNIPPET + "\n\n# The same code with `total` renamed to"
                                     " `running_sum`:\n"), SNIPPET)]
    return reask + edit


def model(name: str):
    if name == "smollm2":
        from gmlx.gguf.smollm2 import converted

        return load(converted("float32"))
    if name == "embedded":
        return load(None)
    return load(name)


def run_one(eng: Engine, ids: list[int], max_tokens: int, prediction) -> dict:
    t0 = time.perf_counter()
    rec = eng.generate(ids, SamplingParams(temperature=0.0, seed=0, max_tokens=max_tokens, prediction=prediction))
    wall = time.perf_counter() - t0
    s = rec.stats
    out = {"seconds": wall, "tokens": len(rec.tokens), "tok_s": len(rec.tokens) / wall,
           "decode_tok_s": s["tokens_per_s"], "drafted": s["num_drafted"], "accepted": s["num_accepted"],
           "rounds": s["num_rounds"], "out": rec.tokens}
    for k in ("prediction_tokens", "accepted_prediction_tokens", "rejected_prediction_tokens"):
        if k in s:
            out[k] = s[k]
    return out


def bench_model(name: str, a) -> dict:
    lm = model(name)
    items = cases(lm, name)
    cfg = dict(width_cap=0, prompt_cache_bytes=0)
    engines = {"plain": Engine(lm, EngineConfig(speculative=False, **cfg)), "drafter": Engine(lm, EngineConfig(**cfg))}
    engines["prediction"] = engines["drafter"]  # the same engine; the arm adds the request's prediction
    if a.k_max:
        engines["drafter"].drafter.k_max = a.k_max
    # the previous answers (greedy: the same whatever decodes them), and a warm-up of every arm
    previous = [run_one(engines["plain"], ids, a.max_tokens, None)["out"] for _, ids, _ in items]
    for arm in ("drafter", "plain"):
        run_one(engines[arm], items[0][1], 16, None)
    per: dict[str, list[dict]] = {}
    for rep in range(a.repeats):
        for i, (case, ids, fixed) in enumerate(items):
            pred = fixed if fixed is not None else lm.tokenizer.decode(previous[i])
            arms = ["plain", "drafter", "prediction"]
            for arm in arms if (rep + i) % 2 == 0 else list(reversed(arms)):
                r = run_one(engines[arm], ids, a.max_tokens, pred if arm == "prediction" else None)
                r.update(rep=rep, item=i, case=case)
                per.setdefault(arm, []).append(r)
                print(f"{name} rep {rep} {case}#{i} {arm:10s} {r['tokens']:4d} tokens {r['tok_s']:7.1f} tok/s"
                      f" drafted {r['drafted']:4d} accepted {r['accepted']:4d}", flush=True)
    for eng in {id(e): e for e in engines.values()}.values():
        eng.close()
    summary = {}
    for case in ("reask", "edit", "all"):
        sel = {arm: [r for r in rs if case == "all" or r["case"] == case] for arm, rs in per.items()}
        summary[case] = {}
        for arm, rs in sel.items():
            d = sum(r["drafted"] for r in rs)
            # per repeat: the case's total time in this arm vs plain (the same requests, the same tokens)
            reps = sorted({r["rep"] for r in rs})
            ratios = [sum(p["seconds"] for p in sel["plain"] if p["rep"] == k)
                      / sum(r["seconds"] for r in rs if r["rep"] == k) for k in reps]
            summary[case][arm] = {
                "tok_s_median": statistics.median(r["tok_s"] for r in rs),
                "speedup_vs_plain": statistics.median(ratios),
                "speedup_per_repeat": ratios,
                "tokens_mean": statistics.mean(r["tokens"] for r in rs),
                "draft_acceptance_rate": sum(r["accepted"] for r in rs) / d if d else None,
                "accepted_prediction_tokens": sum(r.get("accepted_prediction_tokens", 0) for r in rs),
                "rejected_prediction_tokens": sum(r.get("rejected_prediction_tokens", 0) for r in rs),
                "same_tokens_as_plain": sum(r["out"] == p["out"] for r, p in zip(rs, sel["plain"])) / len(rs)}
    for rs in per.values():
        for r in rs:
            r.pop("out")
    return {"path": str(lm.path), "drafter_kind": lm.drafter_kind, "k": lm.default_k,
            "cases": [{"case": c, "prompt_tokens": len(ids), "prediction": "the previous answer" if f is None else f}
                      for c, ids, f in items], "summary": summary, "per_request": per}


def markdown(result: dict) -> str:
    lines = [f"# Predicted outputs, width 1, greedy ({result['stamp']})", "",
             f"`{result['command']}`", "",
             f"Machine: {result['machine'].get('cpu', '?')}, {result['machine'].get('cores', '?')} cores; "
             f"mlx {result['machine'].get('mlx', '?')}, mlx-lm {result['machine'].get('mlx_lm', '?')}; "
             f"load average at start {result['machine'].get('load_avg_1m', '?')}", "",
             "End-to-end tokens/s (submit to last token, prefill included), median of "
             f"{result['repeats']} interleaved repeats; speedup = median over repeats of the per-repeat time ratio"
             " to plain.", "",
             "| model | case | arm | tok/s | speedup vs plain | draft acceptance | accepted / rejected prediction"
             " tokens | same tokens as plain |", "|---|---|---|---|---|---|---|---|"]
    for m, res in result["models"].items():
        for case in ("reask", "edit"):
            for arm, s in res["summary"][case].items():
                acc = "-" if s["draft_acceptance_rate"] is None else f"{s['draft_acceptance_rate']:.2f}"
                pt = (f"{s['accepted_prediction_tokens']} / {s['rejected_prediction_tokens']}"
                      if arm == "prediction" else "-")
                lines.append(f"| {m} | {case} | {arm} | {s['tok_s_median']:.1f} | {s['speedup_vs_plain']:.2f}x |"
                             f" {acc} | {pt} | {s['same_tokens_as_plain']:.0%} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2,embedded")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--k-max", type=int, default=None, help="the most drafts a round takes from a prediction")
    ap.add_argument("--out", type=Path, default=Path("bench_results"))
    a = ap.parse_args()
    result = {"benchmark": "prediction", "command": command_line("bench_prediction.py", a), "machine": describe(),
              "max_tokens": a.max_tokens, "repeats": a.repeats, "width": 1, "temperature": 0, "models": {}}
    for name in a.models.split(","):
        result["models"][name] = bench_model(name, a)
        print(json.dumps({c: {arm: round(s["speedup_vs_plain"], 2) for arm, s in v.items()}
                          for c, v in result["models"][name]["summary"].items()}), flush=True)
    path = write_result(a.out, "prediction", result)
    result["stamp"] = path.name.split("_")[0]
    path.with_suffix(".md").write_text(markdown(result))
    print(f"wrote {path} and {path.with_suffix('.md')}")


if __name__ == "__main__":
    main()
