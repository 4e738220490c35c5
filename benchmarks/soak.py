"""Soak (issue 5 item 6): 1,000 requests with random arrivals, lengths, seeds, temperatures and
cancellations through the engine's own thread while GMLX_MTP_WIDTH_CAP flips live; every
stream is checked against its solo plain reference and memory at the end against the start.
The work is in `tests/soak_harness.py` (shared with `tests/test_soak.py`); this script runs it and
writes the report.

Run: ``python benchmarks/soak.py --requests 1000 --seed 0``  (``--quick``: the test's profile)
Writes bench_results/<utc>_soak.json and .md; exits 1 on any mismatch, engine error, hang,
speculative round over the cap, or end memory above start * 1.05.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import gmlx  # noqa: F401  (OpenBLAS before mlx)

from gmlx.machine import describe
from gmlx.models.loading import load
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the soak, shared with the tests
from soak_harness import FULL, QUICK, soak  # noqa: E402


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.2f} MiB"


def summary_md(r: dict, command: str) -> str:
    m, mem = r["machine"], r["memory"]
    start, end = mem["start"], mem["end"] or {}
    lines = [
        f"# Soak {r['stamp']}", "", f"`{command}`", "",
        f"Machine: {m['cpu']}, {m['cores']} cores, BLAS {m['blas']}, mlx {m['mlx']}, mlx-lm {m['mlx_lm']},"
        f" gmlx {m['gmlx']}, commit {m['git_commit']}", "",
        f"**{'PASS' if not r['failures'] else 'FAIL: ' + '; '.join(r['failures'])}**", "",
        "| figure | value |", "|---|---|",
        f"| requests | {r['requests']} |",
        f"| completed / cancelled / errored / client errors | {r.get('completed', 0)} / {r.get('cancelled', 0)}"
        f" / {r.get('errored', 0)} / {r.get('client_error', 0)} |",
        f"| cancels sent (cancelled before the first token) | {r.get('cancel_sent', 0)}"
        f" ({r.get('cancelled_before_first_token', 0)}) |",
        f"| stream mismatches vs solo plain | {r['mismatches']} (ties forgiven: {r['ties']}) |",
        f"| transitions (engine counters) | {r['transitions']['counters']} |",
        f"| transition events | {r['transitions']['events']} |",
        f"| rounds by kind | {r['rounds']} |",
        f"| rounds by cap in force | {r['rounds_by_cap']} |",
        f"| cap flips / speculative rounds over the cap | {r['cap_flips']} / {len(r['cap_violations'])} |",
        f"| tokens, wall time | {r['tokens']} tokens in {r['wall_s']:.1f} s ({r['tokens_per_s']:.0f} tok/s);"
        f" oracle check {r['check_s']:.0f} s |",
        f"| MLX active memory start / peak / end | {_mib(start['active'])} / {_mib(mem['peak'])} /"
        f" {_mib(end.get('active'))} (end/start {mem['end_over_start'] or float('nan'):.4f}) |",
        f"| prompt cache held at end (emptied before the end figure) | {_mib(end.get('prompt_cache_bytes'))}"
        f" in {end.get('prompt_cache_entries')} entries; active with it {_mib(end.get('active_with_prompt_cache'))} |",
    ]
    for d in r["mismatch_details"][:20]:
        lines += ["", f"- mismatch `{d['kind']}` request #{d['index']}: params {d['params']}, cancel {d['cancel']}"
                      f" {d['cancel_at']}, finish {d['finish_reason']}, error {d['error']}"]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=None, help="default: 1000 (--quick: 48)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-concurrency", type=int, default=None, help="live streams at most (default 16, quick 8)")
    ap.add_argument("--max-tokens", type=int, default=None, help="budgets drawn from 1..this (default 64)")
    ap.add_argument("--quick", action="store_true", help="the shortened profile of tests/test_soak.py")
    ap.add_argument("--mem-tolerance", type=float, default=0.05)
    ap.add_argument("--out", type=Path, default=Path("bench_results"))
    a = ap.parse_args()
    profile = QUICK if a.quick else FULL
    for name in ("requests", "max_concurrency", "max_tokens"):
        if getattr(a, name) is not None:
            profile = replace(profile, **{name: getattr(a, name)})
    lm = load()
    with tempfile.TemporaryDirectory(prefix="gmlx-soak-") as tmp:  # the run's own user config
        r = soak(lm, profile, a.seed, Path(tmp) / "config.toml", mem_tolerance=a.mem_tolerance)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    command = "python " + " ".join(["benchmarks/soak.py"] + sys.argv[1:])
    r = {"benchmark": "soak", "stamp": stamp, "command": command, "machine": describe(), "model": str(lm.path), **r}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"{stamp}_soak.json").write_text(json.dumps(r, indent=2, default=str) + "\n")
    (a.out / f"{stamp}_soak.md").write_text(summary_md(r, command))
    print(summary_md(r, command))
    return 1 if r["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
