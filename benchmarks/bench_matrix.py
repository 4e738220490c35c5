"""Drafts side by side (issue 20, part 5): plain, the chain (MTP head), the tree (GMLX_TREE=1, the
lone request only), prompt lookup (ngram), a predicted output (re-asking with the previous answer
as `prediction`) and what a user gets by default (the online control on) — per model, per prompt
kind (code, chat), at c = 1, 2, 4 requests submitted together. Greedy, EOS ignored (every arm
emits the same number of tokens: an arm that moved a token would show in `same tokens`).
Where gmlx ships an EAGLE-3 head for the model (SmolLM2, the embedded model): `eagle3` (a chain)
and `eagle3_tree` (trees, c = 1) beside the MTP head. Where a draft model applies (the embedded model's shipped draft): gmlx's `draft` drafter, and
mlx-lm's own speculative decoding (`speculative_generate_step`, the same draft and K) at c = 1
(mlx-lm decodes one request at a time). SmolLM2-135M has no smaller model in its family here.

Every arm but `default` runs uncapped with GMLX_CONTROL=0 (the drafter's K every round, at every
width) — the drafter's own figure; `default` is the engine as shipped; `plain_again` (only when
named) is plain a second time, an A/A test whose ratio is the noise the others read against. Aggregate tokens/s =
tokens / wall time from submit to the last token (prefill included), median of interleaved
repeats (the arm order alternates); speedups are medians of per-repeat ratios to plain, of that
rate and ("decode") of the decode after each request's first token, what `gmlx generate` reports
as a request's tokens/s (common.decode_rate; prefill and the first token left out).

Run: ``python benchmarks/bench_matrix.py --models smollm2-f32,smollm2-q,embedded --concurrency 1,2,4``
Writes bench_results/<utc>_matrix.json and .md.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import gmlx  # noqa: F401  (OpenBLAS before mlx)

import mlx.core as mx

from gmlx import EngineConfig
from gmlx.config import Switches
from gmlx.data import load_prompts
from gmlx.machine import describe
from gmlx.models.cpu_fused import as_mlx_lm
from gmlx.models.loading import default_model_path, load
from gmlx.drafters.select import shipped_eagle3

from common import command_line, run_burst, write_result

# Held out from the SmolLM2 head's training prompts (gmlx_training/smollm2_prompts.py's templates).
CODE_ASKS = ["Write a Python function that returns the second largest number in a list.",
             "Write a Python class for a bank account with deposit and withdraw methods.",
             "Write a Python function that splits a list into chunks of size n.",
             "Write a Python function that counts how often each character appears in a string."]
CHAT_ASKS = ["Explain how vaccines train the immune system.", "What are the benefits of regular exercise?",
             "Describe how a rainbow forms.", "Why do leaves change colour in autumn?"]

FIXED = dict(width_cap=0, prompt_cache_bytes=0)
ARMS = {  # name: (EngineConfig, Switches, uses the previous answer as prediction)
    "plain": (EngineConfig(speculative=False, **FIXED), Switches(control=False), False),
    # plain a second time as its own arm (an A/A test, asked for by name: `--arms ...,plain_again`): its
    # ratio to plain is this machine's noise on the cell's repeats, beside which the other arms' read
    "plain_again": (EngineConfig(speculative=False, **FIXED), Switches(control=False), False),
    "chain": (EngineConfig(drafter="mtp", **FIXED), Switches(control=False), False),
    "tree": (EngineConfig(drafter="mtp", **FIXED), Switches(control=False, tree=True), False),
    "ngram": (EngineConfig(drafter="ngram", **FIXED), Switches(control=False), False),
    "prediction": (EngineConfig(drafter="mtp", **FIXED), Switches(control=False), True),
    "default": (EngineConfig(prompt_cache_bytes=0), Switches(control=True), False),
    # the model's shipped EAGLE-3 head (gmlx_training/train_smollm2_eagle3.py), as a chain and as trees
    "eagle3": (EngineConfig(drafter="eagle3", **FIXED), Switches(control=False), False),
    "eagle3_tree": (EngineConfig(drafter="eagle3", **FIXED), Switches(control=False, tree=True), False),
    # the embedded model's shipped draft model, as gmlx runs it (beside mlx-lm's own, below)
    "draft": (EngineConfig(drafter="draft", draft_model=str(default_model_path() / "draft"), **FIXED),
              Switches(control=False), False),
}


def model(name: str):
    if name == "embedded":
        return load()
    from gmlx.gguf.smollm2 import converted

    return load(converted("float32" if name == "smollm2-f32" else "q"))


def prompt_sets(lm, name: str) -> dict[str, list[list[int]]]:
    tok = lm.tokenizer
    if name == "embedded":  # a code model without a chat template: raw code continuations only
        return {"code": [tok.encode(p) for p in load_prompts()[:4]]}
    chat = lambda text: list(tok.apply_chat_template([{"role": "user", "content": text}],  # noqa: E731
                                                     add_generation_prompt=True))
    return {"code": [chat(q) for q in CODE_ASKS], "chat": [chat(q) for q in CHAT_ASKS]}


def burst(lm, arm: str, prompts: list[list[int]], previous: list[str] | None, max_tokens: int) -> dict:
    config, switches, predicted = ARMS[arm]
    return run_burst(lm, prompts, max_tokens, config, switches, predictions=previous if predicted else None)


@as_mlx_lm()  # mlx-lm's own operations (gmlx/models/cpu_fused.py)
def mlx_lm_draft(lm, draft, prompts: list[list[int]], max_tokens: int, k: int) -> dict:
    """mlx-lm's speculative decoding, one request after another (it has no batched speculation)."""
    from mlx_lm.generate import speculative_generate_step

    toks, t0, outs = 0, time.perf_counter(), []
    for p in prompts:
        it = speculative_generate_step(mx.array(p, dtype=mx.int32), lm.target.model, draft.target.model,
                                       num_draft_tokens=k, max_tokens=max_tokens)
        out = [int(t) for t, _, _ in it]
        toks, outs = toks + len(out), outs + [out]
    return {"tok_s": toks / (time.perf_counter() - t0), "out": outs, "acc": None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2-f32,smollm2-q,embedded")
    ap.add_argument("--concurrency", default="1,2,4")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--arms", default=",".join([*(a for a in ARMS if a != "plain_again"), "mlx_lm"]),
                    help="arms to run (plain always runs; plain_again only when named)")
    ap.add_argument("--out", type=Path, default=Path("bench_results"))
    a = ap.parse_args()
    cs = [int(x) for x in a.concurrency.split(",")]
    result = {"machine": describe(), "command": command_line("bench_matrix.py", a), "cells": []}
    for name in a.models.split(","):
        lm = model(name)
        draft = load(default_model_path() / "draft") if name == "embedded" else None
        for kind, pool in prompt_sets(lm, name).items():
            previous = [lm.tokenizer.decode(o) for o in burst(lm, "plain", pool, None, a.max_tokens)["out"]]
            chosen = {"plain", *a.arms.split(",")}
            names = [arm for arm in ARMS if arm in chosen and (arm != "draft" or draft is not None)
                     and (not arm.startswith("eagle3") or shipped_eagle3(lm)[0] is not None)]
            for arm in names:  # warm-up: kernels, the probe, the allocator
                burst(lm, arm, pool[:1], previous, 8)
            for c in cs:
                arms = ([arm for arm in names if not arm.endswith("tree") or c == 1]
                        + (["mlx_lm"] if draft and c == 1 and "mlx_lm" in chosen else []))
                reps: dict[str, list[dict]] = {arm: [] for arm in arms}
                for rep in range(a.repeats):
                    for arm in arms if rep % 2 == 0 else list(reversed(arms)):
                        sel = [(i + rep) % len(pool) for i in range(c)]
                        prompts, prev = [pool[i] for i in sel], [previous[i] for i in sel]
                        r = (mlx_lm_draft(lm, draft, prompts, a.max_tokens, lm.default_k) if arm == "mlx_lm"
                             else burst(lm, arm, prompts, prev, a.max_tokens))
                        reps[arm].append(r)
                        print(f"{name} {kind} c={c} rep {rep} {arm:10s} {r['tok_s']:7.1f} tok/s acc {r['acc']}",
                              flush=True)
                same = {arm: all(x["out"] == p["out"] for x, p in zip(reps[arm], reps["plain"])) for arm in arms}
                cell = {"model": name, "kind": kind, "c": c, "same_tokens": same,
                        "tok_s": {arm: statistics.median(r["tok_s"] for r in reps[arm]) for arm in arms},
                        "speedup": {arm: statistics.median(r["tok_s"] / p["tok_s"] for r, p in zip(reps[arm], reps["plain"]))
                                    for arm in arms},
                        # ... of the decode after each request's first token (common.decode_rate; not mlx_lm's)
                        "decode_speedup": {arm: statistics.median(r["decode_tok_s"] / p["decode_tok_s"] for r, p in zip(
                            reps[arm], reps["plain"])) if arm != "mlx_lm" else None for arm in arms},
                        "acceptance": {arm: (statistics.median(x["acc"] for x in reps[arm] if x["acc"] is not None)
                                             if any(x["acc"] is not None for x in reps[arm]) else None) for arm in arms}}
                for r in (x for rs in reps.values() for x in rs):
                    r.pop("out")
                cell["reps"] = reps
                result["cells"].append(cell)
                print("== " + ", ".join(f"{arm} {cell['speedup'][arm]:.2f}x" for arm in arms), flush=True)
    path = write_result(a.out, "matrix", result)
    # mlx_lm: mlx-lm's speculative_generate_step with the same draft model
    cols = [arm for arm in [*ARMS, "mlx_lm"] if any(arm in x["speedup"] for x in result["cells"])]
    lines = ["| model | prompts | c | plain tok/s | " + " | ".join(c for c in cols if c != "plain") + " |",
             "|---|---|---|---|" + "---|" * (len(cols) - 1)]
    for x in result["cells"]:
        cells = []
        for arm in cols[1:]:
            if arm not in x["speedup"]:
                cells.append("-")
                continue
            acc = x["acceptance"][arm]
            dec = x.get("decode_speedup", {}).get(arm)
            cells.append(f"{x['speedup'][arm]:.2f}x" + (f", decode {dec:.2f}x" if dec is not None else "")
                         + (f" (acc {acc:.2f})" if acc is not None else "")
                         + ("" if x["same_tokens"][arm] else " DIFFERENT TOKENS"))
        lines.append(f"| {x['model']} | {x['kind']} | {x['c']} | {x['tok_s']['plain']:.1f} | " + " | ".join(cells) + " |")
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
