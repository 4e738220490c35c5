"""The drafter kinds side by side (issue 6) on the embedded model: plain, MTP head, draft model,
KV-sharing assistant head, at concurrency 1, 2, 4 (uncapped, so every width speculates).
Each cell submits `c` requests together (fixed length, EOS ignored) and steps the engine to the
end: aggregate tokens/s including prefill, acceptance. Interleaved repeats (alternating order),
medians; speedups are medians of per-repeat ratios to plain at the same concurrency.

Run: ``python benchmarks/bench_drafters.py --concurrency 1,2,4 --max-tokens 64 --repeats 3``
Writes bench_results/<utc>_drafters.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import gmlx  # noqa: F401  (OpenBLAS before mlx)

from gmlx import EngineConfig
from gmlx.data import load_prompts
from gmlx.machine import describe
from gmlx.models.loading import default_model_path, load

from common import command_line, run_burst, write_result

KINDS = {"plain": None, "mtp": "mtp", "draft": "draft", "assistant": "assistant"}


def run_cell(lm, draft, kind: str, prompts, max_tokens: int, k: int | None) -> dict:
    config = EngineConfig(speculative=kind != "plain", drafter=KINDS[kind], width_cap=0, num_draft_tokens=k,
                          prompt_cache_bytes=0)
    return run_burst(lm, prompts, max_tokens, config, draft_model=draft if kind == "draft" else None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", default="1,2,4")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--k", type=int, default=None, help="drafts per round (default: the model's)")
    ap.add_argument("--draft-model", type=Path, default=default_model_path() / "draft")
    ap.add_argument("--out", type=Path, default=Path("bench_results"))
    a = ap.parse_args()
    lm, draft = load(), load(a.draft_model)
    all_prompts = [lm.tokenizer.encode(p) for p in load_prompts()]
    concs = [int(x) for x in a.concurrency.split(",")]
    cells = [(kind, c) for c in concs for kind in KINDS]
    for kind in KINDS:  # warm-up: compile kernels, fill allocator caches
        run_cell(lm, draft, kind, all_prompts[:2], 8, a.k)
    per_rep: dict[str, list[dict]] = {f"{kind}@{c}": [] for kind, c in cells}
    for rep in range(a.repeats):
        order = cells if rep % 2 == 0 else list(reversed(cells))
        for kind, c in order:
            prompts = all_prompts[rep * 4 : rep * 4 + c] if c <= 4 else all_prompts[:c]
            r = run_cell(lm, draft, kind, prompts, a.max_tokens, a.k)
            per_rep[f"{kind}@{c}"].append(r)
            acc = "-" if r["acc"] is None else f"{r['acc']:.3f}"
            print(f"rep {rep} {kind:9s} c={c} {r['tok_s']:8.1f} tok/s  acc {acc}", flush=True)
    summary = {}
    for kind, c in cells:
        reps = per_rep[f"{kind}@{c}"]
        plain = per_rep[f"plain@{c}"]
        accs = [r["acc"] for r in reps if r["acc"] is not None]
        summary[f"{kind}@{c}"] = {
            "tok_s_median": statistics.median(r["tok_s"] for r in reps),
            "acceptance_median": statistics.median(accs) if accs else None,
            "speedup_vs_plain": statistics.median(r["tok_s"] / p["tok_s"] for r, p in zip(reps, plain))}
    result = {"benchmark": "drafters", "command": command_line("bench_drafters.py", a),
        "machine": describe(), "model": str(lm.path), "draft_model": str(draft.path), "k": a.k or lm.default_k,
        "max_tokens": a.max_tokens, "repeats": a.repeats, "summary": summary, "per_repeat": per_rep}
    write_result(a.out, "drafters", result)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
