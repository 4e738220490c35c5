"""SmolLM2-135M-Instruct (issue 13): plain vs its drafters at width 1, fp32 and 4-bit, greedy and
T=0.8, on code and chat prompts. One engine per (dtype, arm), reused across requests; each request
goes through `Engine.generate` (natural EOS, `--max-tokens` at most) and its decode rate is
`FinalRecord.stats["tokens_per_s"]` (first token to last: prefill excluded). Per prompt and repeat
the arms run back to back in alternating order (interleaved pairs); speedups are medians of the
per-pair ratios to plain, so the machine's drift hits both sides of a pair alike.

Arms: plain; mtp (the shipped head, `gmlx/weights/smollm2/`); ngram (prompt lookup) when this
gmlx has it (`EngineConfig(drafter="ngram")`; skipped with a note otherwise). mlx-lm's own
speculative decoding takes a draft *model*, and there is none for SmolLM2-135M here (it is the
family's smallest), so that comparison is recorded as not applicable.

Run: ``python benchmarks/bench_smollm2.py --dtypes float32,q --temps 0,0.8 --max-tokens 128 --repeats 3``
Writes bench_results/<utc>_smollm2.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import gmlx  # noqa: F401  (OpenBLAS before mlx)

from gmlx import Engine, EngineConfig, SamplingParams
from gmlx.data import load_prompts
from gmlx.errors import GmlxError
from gmlx.machine import describe
from gmlx.gguf import smollm2
from gmlx.models.loading import load

from common import command_line, write_result

CHAT = ["Write a Python function that returns the sum of the squares of a list of numbers.",
        "Explain how a binary search tree works.",
        "What are the benefits of regular exercise?",
        "Write a haiku about the sea."]
ARMS = {"plain": None, "mtp": "mtp", "ngram": "ngram"}


def prompts(lm, n_code: int, n_chat: int) -> list[tuple[str, list[int]]]:
    """Code: raw continuations of held-out standard-library code (gmlx/data/prompts.jsonl); chat:
    user messages through the model's chat template."""
    code = [("code", lm.tokenizer.encode(p)) for p in load_prompts()[:n_code]]
    chat = [("chat", list(lm.tokenizer.apply_chat_template([{"role": "user", "content": c}],
                                                          add_generation_prompt=True))) for c in CHAT[:n_chat]]
    return code + chat


def engine(lm, arm: str, k: int | None) -> Engine | str:
    """The arm's engine (prompt cache off: repeats must not reuse a prefill), or why it cannot run."""
    try:
        return Engine(lm, EngineConfig(speculative=arm != "plain", drafter=ARMS[arm], num_draft_tokens=k,
                                       width_cap=0, prompt_cache_bytes=0))
    except GmlxError as e:  # e.g. no prompt-lookup drafter in this gmlx yet
        return f"skipped: {e}"


def run_one(eng: Engine, ids: list[int], temp: float, seed: int, max_tokens: int) -> dict:
    rec = eng.generate(ids, SamplingParams(temperature=temp, seed=seed, max_tokens=max_tokens))
    s = rec.stats
    return {"tok_s": s["tokens_per_s"], "tokens": s["num_generated"], "drafted": s["num_drafted"],
            "accepted": s["num_accepted"], "out": rec.tokens}


def cell(engines: dict, items, temp: float, repeats: int, max_tokens: int) -> dict:
    per: dict[str, list[dict]] = {arm: [] for arm in engines}
    for rep in range(repeats):
        for i, (kind, ids) in enumerate(items):
            order = list(engines) if (rep + i) % 2 == 0 else list(reversed(engines))
            for arm in order:
                r = run_one(engines[arm], ids, temp, seed=1000 * rep + i, max_tokens=max_tokens)
                per[arm].append({"rep": rep, "prompt": i, "kind": kind, **r})
    out = {}
    for kind in ("code", "chat", "all"):
        sel = {arm: [r for r in rs if kind == "all" or r["kind"] == kind] for arm, rs in per.items()}
        if not sel["plain"]:
            continue
        out[kind] = {}
        for arm, rs in sel.items():
            d = sum(r["drafted"] for r in rs)
            out[kind][arm] = {
                "tok_s_median": statistics.median(r["tok_s"] for r in rs),
                "tokens_mean": statistics.mean(r["tokens"] for r in rs),
                "draft_acceptance_rate": sum(r["accepted"] for r in rs) / d if d else None,
                "speedup_vs_plain": statistics.median(r["tok_s"] / p["tok_s"] for r, p in zip(rs, sel["plain"])),
                # exactness at T=0 (and seeded T>0): the same tokens as plain for the same prompt and seed
                "same_tokens_as_plain": sum(r["out"] == p["out"] for r, p in zip(rs, sel["plain"])) / len(rs)}
    for rs in per.values():
        for r in rs:
            r.pop("out")
    return {"summary": out, "per_request": per}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", default="float32,q")
    ap.add_argument("--temps", default="0,0.8")
    ap.add_argument("--arms", default="plain,mtp,ngram")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--code", type=int, default=4)
    ap.add_argument("--chat", type=int, default=4)
    ap.add_argument("--k", type=int, default=None, help="drafts per round (default: the model's)")
    ap.add_argument("--out", type=Path, default=Path("bench_results"))
    a = ap.parse_args()
    result = {"benchmark": "smollm2", "command": command_line("bench_smollm2.py", a), "machine": describe(),
              "max_tokens": a.max_tokens, "repeats": a.repeats, "width": 1, "cells": {}, "skipped": {},
              "mlx_lm_speculative": "not applicable: mlx-lm's speculative decoding takes a draft model, and"
                                    " there is none for SmolLM2-135M (the family's smallest model)"}
    for dtype in a.dtypes.split(","):
        lm = load(smollm2.converted(dtype))
        result.setdefault("models", {})[dtype] = {"path": str(lm.path), "drafter_kind": lm.drafter_kind,
                                                  "k": a.k or lm.default_k}
        items = prompts(lm, a.code, a.chat)
        engines = {}
        for arm in a.arms.split(","):
            e = engine(lm, arm, a.k)
            if isinstance(e, str):
                result["skipped"][f"{dtype}/{arm}"] = e
                print(f"{dtype} {arm}: {e}", flush=True)
            else:
                engines[arm] = e
        for eng in engines.values():  # warm-up: kernels, allocator caches
            run_one(eng, items[0][1], 0.0, 0, 16)
        for temp in (float(t) for t in a.temps.split(",")):
            c = cell(engines, items, temp, a.repeats, a.max_tokens)
            result["cells"][f"{dtype}/T={temp}"] = c
            print(f"{dtype} T={temp}: {json.dumps(c['summary'], indent=1)}", flush=True)
        for eng in engines.values():
            eng.close()
    path = write_result(a.out, "smollm2", result)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
