"""Two checkpoints of a model's drafter, side by side: plain decoding vs the default engine (online
control on, no calibration; or a fixed K) on each model directory given (the same target, a drafter retrained,
say `train_drafters --resume-assistant` into a copy) or, with `--model smollm2-f32|smollm2-q`, each
EAGLE-3 checkpoint given (`--heads`, as `--drafter eagle3 --draft-model PATH`), at concurrency c. Closed loop, as
bench_control.py: c requests in flight until all are done; arms interleaved per repeat, the
order alternating; ratios are medians of per-repeat ratios to plain. Live acceptance is drafts
accepted / drafted over the arm's requests.

Run: ``python benchmarks/bench_heads.py --dirs old=gmlx/weights/default_model new=runs/dm_train --concurrency 1,2,4,8 --repeats 7``
or ``python benchmarks/bench_heads.py --model smollm2-f32 --heads old=gmlx/weights/smollm2/eagle3 new=runs/e3
--prompt-set chat --concurrency 1`` (bench_matrix.py's code or chat questions through the chat template).
Writes bench_results/<utc>_heads.json and .md.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import gmlx  # noqa: F401  (OpenBLAS before mlx)

from gmlx import Engine, EngineConfig
from gmlx.data import load_prompts
from gmlx.machine import describe
from gmlx.models.loading import load

from common import closed_loop as run_closed_loop, command_line, write_result


def closed_loop(lm, config: EngineConfig, prompts: list, c: int, max_tokens: int) -> dict:
    return run_closed_loop(Engine(lm, config), prompts, c, max_tokens)


def arms_for(a) -> tuple[dict, dict]:
    """{arm: (loaded model, EngineConfig)} with plain first, and the drafting arms' names."""
    fixed = {} if a.num_draft_tokens is None else {"num_draft_tokens": a.num_draft_tokens, "width_cap": 0}
    pairs = [d.split("=", 1) for d in (a.dirs or a.heads)]
    if a.dirs:
        lms = {name: load(path) for name, path in pairs}
        drafting = {name: (lm, EngineConfig(**fixed)) for name, lm in lms.items()}
    else:
        from gmlx.gguf.smollm2 import converted

        lm = load(converted("float32" if a.model == "smollm2-f32" else "q"))
        drafting = {name: (lm, EngineConfig(drafter="eagle3", draft_model=path, **fixed)) for name, path in pairs}
    plain = (next(iter(drafting.values()))[0], EngineConfig(speculative=False))
    return {"plain": plain, **drafting}, drafting


def prompt_set(lm, name: str) -> list:
    """The shipped prompts (text, encoded by the engine), or bench_matrix.py's code / chat
    questions through the model's chat template (token ids)."""
    if name == "shipped":
        return load_prompts()
    from bench_matrix import CHAT_ASKS, CODE_ASKS

    tok = lm.tokenizer
    return [list(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True))
            for q in (CODE_ASKS if name == "code" else CHAT_ASKS)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--dirs", nargs="+", help="NAME=PATH model directories (the same target)")
    src.add_argument("--heads", nargs="+", help="NAME=PATH EAGLE-3 checkpoints for --model")
    ap.add_argument("--model", choices=("smollm2-f32", "smollm2-q"),
                    help="the target of --heads (default smollm2-f32); --dirs name their own")
    ap.add_argument("--prompt-set", choices=("shipped", "code", "chat"), default="shipped")
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--num-draft-tokens", type=int, default=None,
                    help="an explicit K for the drafting arms (K drafts every round, uncapped): acceptance"
                         " then compares the heads at one K; default: the engine's own choice")
    ap.add_argument("--out", type=Path, default=Path("bench_results"))
    a = ap.parse_args()
    if a.dirs and a.model:
        ap.error("--model is the target of --heads; each --dirs directory is its own model")
    if a.heads and a.model is None:
        a.model = "smollm2-f32"  # recorded in the command line, which then reproduces the run
    arms, lms = arms_for(a)
    prompts = prompt_set(arms["plain"][0], a.prompt_set)[: a.prompts]
    result = {"command": command_line("bench_heads.py", a), "machine": describe(), "cells": []}
    for lm, config in arms.values():  # warm-up: kernels, the probe, the allocator
        closed_loop(lm, config, prompts[:2], 2, 8)
    for c in map(int, a.concurrency.split(",")):
        reps = {arm: [] for arm in arms}
        for rep in range(a.repeats):
            for arm in (list(arms) if rep % 2 == 0 else list(arms)[::-1]):
                reps[arm].append(closed_loop(*arms[arm], prompts, c, a.max_tokens))
        cell = {"c": c, "reps": reps, **{f"{arm}_tok_s": statistics.median(r["tok_s"] for r in reps[arm]) for arm in arms},
                **{f"{arm}_vs_plain": statistics.median(x["tok_s"] / p["tok_s"] for x, p in zip(reps[arm], reps["plain"]))
                   for arm in lms},
                **{f"{arm}_acc": statistics.median(r["acc"] or 0.0 for r in reps[arm]) for arm in lms}}
        result["cells"].append(cell)
        print(f"c={c} " + "  ".join(f"{arm} {cell[f'{arm}_vs_plain']:.2f}x acc {cell[f'{arm}_acc']:.2f}" for arm in lms),
              flush=True)
    path = write_result(a.out, "heads", result)
    lines = [f"`{result['command']}`", "", f"Machine: {result['machine']}", "",
             "| c | plain tok/s | " + " | ".join(f"{n} tok/s, / plain, acceptance" for n in lms) + " |",
             "|---|---|" + "---|" * len(lms)]
    for x in result["cells"]:
        lines.append(f"| {x['c']} | {x['plain_tok_s']:.1f} | " + " | ".join(
            f"{x[f'{n}_tok_s']:.1f}, {x[f'{n}_vs_plain']:.2f}, {x[f'{n}_acc']:.2f}" for n in lms) + " |")
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
