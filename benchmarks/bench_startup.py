"""`gmlx generate` end to end, as a user runs it: the console script in a fresh process per run,
timed from start to exit, speculating or not (--no-speculative), with the load-time measurements
kept across processes (gmlx/measured.py, the default) or measured in every process
(GMLX_KEEP_MEASURED=0). Arms interleaved, the order reversed every other repeat; one warm-up run of
each arm first (it keeps the measurements the "kept" arms then read).

Why: a process that measures at load what an earlier one measured pays for it every time — on this
CPU ~4.3 s of `gmlx generate --model smollm2`'s start when speculating, more than speculation
saves on a 200-token answer (docs/speculation.md, "A start that costs more than speculation saves").

Run: ``python benchmarks/bench_startup.py --model smollm2 --max-tokens 200 --repeats 4``.
Writes bench_results/<utc>_startup.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import command_line, write_result

from gmlx.machine import describe

GMLX = Path(sys.executable).with_name("gmlx")
ARMS = {"speculative, kept": ([], "1"), "speculative, measured": ([], "0"),
        "plain, kept": (["--no-speculative"], "1"), "plain, measured": (["--no-speculative"], "0")}


def run(model: str, prompt: str, max_tokens: int, extra: list[str], keep: str) -> dict:
    env = {**os.environ, "GMLX_KEEP_MEASURED": keep}
    argv = [str(GMLX), "generate", *(["--model", model] if model else []), prompt, "--max-tokens", str(max_tokens),
            "--json", *extra]
    t0 = time.perf_counter()
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
    seconds = time.perf_counter() - t0
    if out.returncode:
        raise SystemExit(f"{' '.join(argv)} failed: {out.stderr[-2000:]}")
    got = json.loads(out.stdout)  # (tokens_per_s: None for one token, which has no decode interval)
    return {"seconds": seconds, "tokens": got["num_generated"], "tok_s": got["tokens_per_s"], "text": got["text"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2", help="as `gmlx generate --model` takes it ('' the embedded model)")
    ap.add_argument("--prompt", default="Explain how vaccines train the immune system.")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--out", type=Path, default=Path("bench_results"))
    a = ap.parse_args()
    for extra, keep in ARMS.values():  # warm-up: the page cache, and the measurements kept
        run(a.model, a.prompt, a.max_tokens, extra, keep)
    runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for rep in range(a.repeats):
        for arm in (list(ARMS) if rep % 2 == 0 else list(reversed(ARMS))):
            runs[arm].append(run(a.model, a.prompt, a.max_tokens, *ARMS[arm]))
            last = runs[arm][-1]
            print(f"rep {rep} {arm:22s} {last['seconds']:6.2f} s  decode {last['tok_s'] or '-'} tok/s", flush=True)
    texts = {r["text"] for rs in runs.values() for r in rs}
    rows = {arm: {"seconds": statistics.median(r["seconds"] for r in rs),
                  "tok_s": statistics.median(r["tok_s"] for r in rs) if rs[0]["tok_s"] is not None else None,
                  "per_repeat_s": [round(r["seconds"], 2) for r in rs]} for arm, rs in runs.items()}
    cmd = command_line("bench_startup.py", a)
    path = write_result(a.out, "startup", {"command": cmd, "machine": describe(), "arms": rows, "same_text": len(texts) == 1})
    lines = [f"`{cmd}`", "", "`gmlx generate` start to exit, a fresh process per run; medians of the repeats; the"
             " decode rate is the one `gmlx generate` reports.", "",
             "| arm | seconds, start to exit | per repeat | decode tokens/s |", "|---|---|---|---|"]
    rate = {arm: "-" if r["tok_s"] is None else f"{r['tok_s']:.1f}" for arm, r in rows.items()}
    lines += [f"| {arm} | {r['seconds']:.2f} | {' / '.join(map(str, r['per_repeat_s']))} | {rate[arm]} |"
              for arm, r in rows.items()]
    lines += ["", f"Same text in every run: {len(texts) == 1}."]
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(path)


if __name__ == "__main__":
    main()
