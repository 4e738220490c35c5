"""Load test of `gmlx serve` (issue 14 item 4): 200+ requests over HTTP from the async openai client
with random prompts, budgets, temperatures, seeds, stop strings and disconnects, while
GMLX_MTP_WIDTH_CAP flips live; every completed stream is checked against its solo plain decode
(tie-aware), every stream its client cut as a prefix, statuses >= 500 are counted, and MLX active
memory at the end (idle, prompt cache emptied) is compared with the start. The work is in
`gmlx/serve/loadgen.py` (shared with `tests/test_serve_load.py`).

Run: ``nice -n 10 python benchmarks/load_serve.py --requests 240 --seed 0``
Writes bench_results/<utc>_load_serve.json and .md; exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import gmlx  # noqa: F401  (OpenBLAS before mlx)

from gmlx.data import load_prompts
from gmlx.machine import describe, version
from gmlx.models.loading import load
from gmlx.serve.loadgen import FULL, QUICK, run_load


def _mib(n) -> str:
    return "n/a" if n is None else f"{n / 2**20:.2f} MiB"


def summary_md(r: dict) -> str:
    m, mem, p = r["machine"], r["memory"], r["profile"]
    ttft = r["client_ttft_s"]
    lines = [
        f"# Load test of gmlx serve, {r['stamp']}", "", f"`{r['command']}`", "",
        f"Machine: {m['cpu']}, {m['cores']} cores, load average {m['load_avg_1m']:.1f} at start, BLAS {m['blas']};"
        f" mlx {m['mlx']}, mlx-lm {m['mlx_lm']}, gmlx {m['gmlx']}, commit {m['git_commit']}; starlette"
        f" {r['versions']['starlette']}, uvicorn {r['versions']['uvicorn']}, openai {r['versions']['openai']}", "",
        f"**{'PASS' if not r['failures'] else 'FAIL: ' + '; '.join(r['failures'])}**", "",
        "| figure | value |", "|---|---|",
        f"| requests (streamed) | {r['requests']} ({r['streams']}); at most {p['max_concurrency']} in flight;"
        f" budgets 1-{p['max_tokens']}; T in 0/0.5/0.8/1.0, seeded |",
        f"| HTTP statuses | {r['statuses']} |",
        f"| responses >= 500 | {r['status_5xx']} |",
        f"| completed / clients that left mid-request | {r['completed']} / {r['left']} |",
        f"| finish reasons seen by clients | {r['finish_reasons']} |",
        f"| streams checked vs solo plain decode | {r['checked']}: **{r['mismatches']} mismatches**"
        f" (ties forgiven: {r['ties']}) |",
        f"| cap flips (GMLX_MTP_WIDTH_CAP) | {r['cap_flips']} |",
        f"| engine transitions | {r['transitions']} in {r['rounds']} rounds |",
        f"| tokens to clients, wall time | {r['tokens']} in {r['wall_s']:.1f} s |",
        f"| client TTFT p50 / p90 (streams) | {ttft['p50'] or 0:.3f} s / {ttft['p90'] or 0:.3f} s |",
        f"| MLX active memory start / end (idle, prompt cache emptied) | {_mib(mem['start']['active'])} /"
        f" {_mib(mem['end']['active'])} (end/start {mem['end_over_start']:.4f}) |",
        f"| prompt cache at the end (emptied before the end figure) | {_mib(mem['end']['prompt_cache_bytes'])}"
        f" in {mem['end']['prompt_cache_entries']} entries |",
    ]
    for d in r["mismatch_details"][:20]:
        lines.append(f"- mismatch #{d['index']} ({d['kind']}): {d.get('params')}, finish {d.get('finish_reason')}")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=None, help=f"default {FULL.requests} (--quick: {QUICK.requests})")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=None, help="budgets drawn from 1..this")
    ap.add_argument("--quick", action="store_true", help="the profile of tests/test_serve_load.py")
    ap.add_argument("--mem-tolerance", type=float, default=0.05)
    ap.add_argument("--out", type=Path, default=Path("bench_results"))
    a = ap.parse_args()
    profile = QUICK if a.quick else FULL
    for name in ("requests", "max_concurrency", "max_tokens"):
        if getattr(a, name) is not None:
            profile = replace(profile, **{name: getattr(a, name)})
    machine = describe()  # before the run: the load average is the machine's, not ours
    lm = load()
    r = run_load(lm, profile, a.seed, load_prompts(), mem_tolerance=a.mem_tolerance)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    command = "python " + " ".join(["benchmarks/load_serve.py"] + sys.argv[1:])
    r = {"benchmark": "load_serve", "stamp": stamp, "command": command, "machine": machine, "model": str(lm.path),
         "versions": {k: version(k) for k in ("starlette", "uvicorn", "openai", "prometheus_client", "httpx")}, **r}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"{stamp}_load_serve.json").write_text(json.dumps(r, indent=2, default=str) + "\n")
    (a.out / f"{stamp}_load_serve.md").write_text(summary_md(r))
    print(summary_md(r))
    return 1 if r["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
