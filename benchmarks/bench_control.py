"""Never lose (issue 19): the default engine (online control on) vs plain decoding vs the static
setting (GMLX_CONTROL=0: the configured cap and K alone, the default before the control) vs fixed
K = 1, 2, 3 at every width (the best fixed setting is the best of plain, static and these), at
concurrency c = 1, 2, 4, 8, per model. Closed loop: c requests in flight until all are done;
aggregate tokens/s = tokens / (last end - first submit); arms interleaved per repeat, the order
alternating; ratios are medians of per-repeat ratios. No calibration: no user config, and the
arms share this process's learnt figures exactly as a long-running server would. `plain_again`
(`--arms plain,plain_again,default`) runs plain a second time as its own arm: its ratio to plain per
repeat is how far two identical arms fall apart on this machine (an A/A test), beside default / plain.

Run: ``python benchmarks/bench_control.py --models default,smollm2-f32,smollm2-q --concurrency 1,2,4,8``
Writes bench_results/<utc>_control.json and .md.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

import gmlx  # noqa: F401  (OpenBLAS before mlx)

from gmlx import Engine, EngineConfig
from gmlx.config import Switches
from gmlx.data import load_prompts
from gmlx.decode import batch_shadow
from gmlx.machine import describe
from gmlx.models.loading import load

from common import closed_loop as run_closed_loop, command_line, write_result

ARMS = {
    "plain": (EngineConfig(speculative=False), Switches(control=False)),
    # plain again, as its own arm: the ratio of two identical arms is this machine's noise on the cell
    # (an A/A test), the yardstick for "default / plain" beside it
    "plain_again": (EngineConfig(speculative=False), Switches(control=False)),
    "default": (EngineConfig(), Switches(control=True)),
    "static": (EngineConfig(), Switches(control=False)),
    # fixed settings: K drafts every round at every width (uncapped, control off). With plain and
    # static they span what sweep-cap chooses among (a cap, and a K per width): the best of them
    # at a concurrency is at least as good as the setting sweep-cap would write for that width.
    **{f"k{k}": (EngineConfig(num_draft_tokens=k, width_cap=0), Switches(control=False)) for k in (1, 2, 3)},
}
FIXED = [arm for arm in ARMS if arm not in ("default", "plain_again")]


def per_repeat(reps: dict, x: str, y: str) -> list[float]:
    """Arm x's tokens/s over arm y's, repeat by repeat (the arms ran side by side in each)."""
    return [a["tok_s"] / b["tok_s"] for a, b in zip(reps[x], reps[y])]


def model(name: str):
    if name == "default":
        return load()
    if name == "micro":  # random weights, no head: drafts by prompt lookup (--drafter ngram)
        import tempfile

        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the micro model, shared with the tests
        from micro import make_micro_model

        return load(make_micro_model(Path(tempfile.mkdtemp()) / "micro"))
    from gmlx.gguf.smollm2 import converted

    return load(converted("float32" if name == "smollm2-f32" else "q"))


def closed_loop(lm, arm: str, prompts: list, c: int, max_tokens: int, eos: bool = False) -> dict:
    config, switches = ARMS[arm]
    if lm.head is None and config.speculative is not False:
        config = dataclasses.replace(config, drafter="ngram")
    return run_closed_loop(Engine(lm, config, switches=switches), prompts, c, max_tokens, ignore_eos=not eos)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="default,smollm2-f32,smollm2-q")
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--arms", default=",".join(ARMS), help="a subset of the arms (plain and default always run)")
    ap.add_argument("--no-shadows", action="store_true",
                    help="a gated batch without shadow rounds (gmlx/decode/batch_shadow.py; before 2026-12-05)")
    ap.add_argument("--eos", action="store_true",
                    help="requests stop at EOS (default: EOS ignored, every request its full --max-tokens, so plain's"
                         " rows finish together and its refills prefill together: docs/cpu_kernel.md)")
    ap.add_argument("--out", type=Path, default=Path("bench_results"))
    a = ap.parse_args()
    batch_shadow.SHADOWS = not a.no_shadows
    arms = [arm for arm in ARMS if arm in {"plain", "default", *a.arms.split(",")}]
    fixed = [arm for arm in arms if arm in FIXED]
    cs = [int(x) for x in a.concurrency.split(",")]
    result = {"machine": describe(), "command": command_line("bench_control.py", a), "cells": []}
    for name in a.models.split(","):
        lm = model(name)
        prompts = [lm.tokenizer.encode(p) for p in load_prompts()][: a.prompts]
        for arm in arms:  # warm-up: kernels, the probe, the allocator
            closed_loop(lm, arm, prompts[:2], 2, 8)
        for c in cs:
            reps = {arm: [] for arm in arms}
            for rep in range(a.repeats):
                for arm in (arms if rep % 2 == 0 else arms[::-1]):
                    r = closed_loop(lm, arm, prompts, c, a.max_tokens, a.eos)
                    reps[arm].append(r)
                    print(f"{name} c={c} rep {rep} {arm:8s} {r['tok_s']:7.1f} tok/s acc {r['acc']} drafting"
                          f" {r['spec_share']:.0%} of rounds  {r['speculation']}",
                          flush=True)
            cell = {"model": name, "c": c,
                    **{f"{arm}_tok_s": statistics.median(r["tok_s"] for r in reps[arm]) for arm in arms},
                    "default_vs_plain": statistics.median(per_repeat(reps, "default", "plain")),
                    "default_vs_plain_per_repeat": per_repeat(reps, "default", "plain"),
                    "static_vs_plain": statistics.median(per_repeat(reps, "static", "plain")) if "static" in reps else None,
                    # the A/A ratios per repeat: how far two identical arms fall apart here
                    "plain_again_vs_plain": per_repeat(reps, "plain_again", "plain") if "plain_again" in reps else None,
                    # the best fixed arm is the one with the best median; the ratio is the median of
                    # per-repeat ratios to it (the max over five noisy arms per repeat would be biased)
                    "best_fixed": (best := max(fixed, key=lambda arm: statistics.median(r["tok_s"] for r in reps[arm]))),
                    "default_vs_best_fixed": statistics.median(per_repeat(reps, "default", best)),
                    "default_speculation": reps["default"][-1]["speculation"],
                    # the decision run to run: the share of the default arm's rounds that drafted, per repeat
                    "default_spec_share": [r["spec_share"] for r in reps["default"]], "reps": reps}
            result["cells"].append(cell)
            print(f"== {name} c={c}: default/plain {cell['default_vs_plain']:.2f}  default/best"
                  f" {cell['default_vs_best_fixed']:.2f} ({best})", flush=True)
    path = write_result(a.out, "control", result)
    lines = ["| model | c | plain tok/s | default tok/s | static tok/s | k1 / k2 / k3 tok/s | best fixed | default/plain"
             " | static/plain | default/best fixed | default's rounds drafting, per repeat | default / plain, per repeat"
             " | plain again / plain, per repeat (A/A) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for x in result["cells"]:
        ks = " / ".join(f"{x[f'k{k}_tok_s']:.1f}" if f"k{k}_tok_s" in x else "-" for k in (1, 2, 3))
        static = (f"{x['static_tok_s']:.1f}", f"{x['static_vs_plain']:.2f}") if "static" in arms else ("-", "-")
        lines.append(f"| {x['model']} | {x['c']} | {x['plain_tok_s']:.1f} | {x['default_tok_s']:.1f} | {static[0]}"
                     f" | {ks} | {x['best_fixed']} | {x['default_vs_plain']:.2f} | {static[1]}"
                     f" | {x['default_vs_best_fixed']:.2f} | {' '.join(f'{v:.0%}' for v in x['default_spec_share'])}"
                     f" | {' '.join(f'{v:.2f}' for v in x['default_vs_plain_per_repeat'])}"
                     f" | {' '.join(f'{v:.2f}' for v in x['plain_again_vs_plain'] or [])} |")
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
