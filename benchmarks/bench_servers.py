"""Compare OpenAI-compatible servers on one model and one workload: `gmlx serve` against
`mlx_lm.server`, each with and without a draft model, all driven over HTTP by the same client
(`gmlx bench --url`'s driver, gmlx_cli/bench/http_backend.py) with the same requests.

    python benchmarks/bench_servers.py --arrivals burst,poisson --concurrency 1,4 --requests 8 \
        --max-tokens 64 --repeats 3

What it does, in order:
1. starts every server as a subprocess on a free loopback port (bounded wait for GET /v1/models;
   each one's log in a temp dir, its tail shown if it fails to start) and stops them all at the end
   (SIGTERM, then SIGKILL after a bounded wait), whatever happens in between;
2. picks prompts whose greedy continuation runs the whole budget on the first server (EOS would
   otherwise end requests early, and mlx_lm.server does not know `ignore_eos`, so the servers
   would not do the same work); `--ignore-eos` is still sent (gmlx honours it);
3. per arrival pattern, every (concurrency, repeat) runs every server in turn, the order
   alternating (ABBA), after two unrecorded warm-up requests per server;
4. checks that the servers saw the same prompt token counts and, greedy, returned the same text;
5. writes bench_results/<utc>_servers.json (machine, versions, commit, the exact server commands,
   the cells and per-request rows) and a Markdown table beside it.

mlx_lm.server runs with OpenBLAS loaded first, as gmlx does (`import gmlx` before its main), so
both sides use the same BLAS; its HF cache points at an empty temp dir (its /v1/models scans the
cache and fails without one; nothing is downloaded). Greedy requests are sent without a seed:
mlx_lm.server serves a request with a seed outside its batch. Both servers keep a prompt cache,
so repeats after the first may reuse cached prompts on either side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import gmlx  # noqa: F401  (OpenBLAS before mlx)
import httpx

from gmlx.models.loading import default_model_path
from gmlx_cli.bench import results
from gmlx_cli.bench.url import run_matrix_http, warm_up
from gmlx_cli.bench.http_backend import drive_http
from gmlx_cli.bench.target import probe
from gmlx_cli.bench.live import LiveView
from gmlx_cli.bench.workload import Arrival, build_requests, load_prompt_specs, parse_int_list

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
MLX_LM_MAIN = "import sys, gmlx; from mlx_lm.server import main; sys.argv[0] = 'mlx_lm.server'; main()"
KINDS = ("gmlx", "gmlx-draft", "gmlx-ngram", "mlx-lm", "mlx-lm-draft")


def command(kind: str, model: str, draft: str, port: int, k: int) -> list[str]:
    if kind.startswith("gmlx"):
        cmd = [str(BIN / "gmlx"), "serve", "--model", model, "--port", str(port), "--log-level", "warning"]
        return cmd + {"gmlx-draft": ["--draft-model", draft], "gmlx-ngram": ["--drafter", "ngram"]}.get(kind, [])
    cmd = [sys.executable, "-c", MLX_LM_MAIN, "--model", model, "--port", str(port), "--log-level", "WARNING"]
    return cmd + (["--draft-model", draft, "--num-draft-tokens", str(k)] if kind == "mlx-lm-draft" else [])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Servers:
    """The servers as subprocesses; a context manager that always stops them."""

    def __init__(self, kinds: list[str], model: str, draft: str, k: int, start_s: float):
        self.logs = Path(tempfile.mkdtemp(prefix="gmlx-bench-servers-"))
        (self.logs / "hf").mkdir()
        self.env = os.environ | {"HF_HUB_CACHE": str(self.logs / "hf"), "HF_HUB_OFFLINE": "1"}
        self.kinds, self.model, self.draft, self.k, self.start_s = kinds, model, draft, k, start_s
        self.procs: dict[str, subprocess.Popen] = {}
        self.urls: dict[str, str] = {}
        self.commands: dict[str, list[str]] = {}

    def __enter__(self) -> "Servers":
        try:
            for kind in self.kinds:
                port = free_port()
                self.commands[kind] = command(kind, self.model, self.draft, port, self.k)
                self.urls[kind] = f"http://127.0.0.1:{port}"
                log = open(self.logs / f"{kind}.log", "wb")
                self.procs[kind] = subprocess.Popen(self.commands[kind], stdout=log, stderr=subprocess.STDOUT,
                                                    env=self.env, cwd=ROOT, start_new_session=True)
            for kind in self.kinds:
                self._wait_ready(kind)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, kind: str) -> None:
        deadline = time.monotonic() + self.start_s
        while time.monotonic() < deadline:
            if self.procs[kind].poll() is not None:
                break
            try:
                if httpx.get(self.urls[kind] + "/v1/models", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        tail = (self.logs / f"{kind}.log").read_text(errors="replace")[-2000:]
        raise SystemExit(f"{kind} did not start within {self.start_s:.0f} s: {shlex.join(self.commands[kind])}\n{tail}")

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for kind, proc in self.procs.items():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                print(f"{kind} did not stop within 20 s: killed", file=sys.stderr)
                proc.kill()
                proc.wait(10)

    def __exit__(self, *exc) -> None:
        self.stop()


def full_budget_prompts(target, n: int, max_tokens: int, seed: int) -> list[int]:
    """Indices of shipped prompts whose greedy continuation on `target` spends the whole budget."""
    specs = load_prompt_specs(None)
    keep: list[int] = []
    for start in range(0, len(specs), 8):
        batch = [replace(r, request_id=start + i) for i, r in enumerate(
            build_requests(specs[start:start + 8], min(8, len(specs) - start), Arrival(), (max_tokens, max_tokens),
                           0.0, seed))]
        outs = asyncio.run(drive_http(target, batch, 4))
        keep += sorted(o.request.request_id for o in outs if o.finish_reason == "length")
        if len(keep) >= n:
            return keep[:n]
    raise SystemExit(f"only {len(keep)} of {len(specs)} prompts run {max_tokens} tokens without EOS; lower"
                     " --max-tokens or --requests")


def per_repeat_ratio(runs, arm: str, base: str, c: int) -> float | None:
    """Median over repeats of arm's aggregate tok/s / base's in the same repeat."""
    def agg(name: str, rep: int) -> float | None:
        outs = [o for r in runs if r.arm.name == name and r.concurrency == c and r.repeat == rep for o in r.outcomes]
        ends = [o.chunks[-1][0] for o in outs if o.chunks]
        span = max(ends) - min(o.submit_s for o in outs) if ends else 0
        return sum(o.num_generated for o in outs) / span if span > 0 else None

    reps = sorted({r.repeat for r in runs if r.concurrency == c})
    pairs = [(agg(arm, k), agg(base, k)) for k in reps]
    ratios = [a / b for a, b in pairs if a and b]
    return statistics.median(ratios) if ratios else None


def cross_checks(runs) -> dict:
    """Same prompt token counts everywhere; the same text as the first server (greedy)."""
    first = runs[0].arm.name
    ref = {(r.concurrency, r.repeat, o.request.request_id): o for r in runs if r.arm.name == first for o in r.outcomes}
    out: dict = {"reference": first, "per_server": {}}
    for r in runs:
        if r.arm.name == first:
            continue
        d = out["per_server"].setdefault(r.arm.name, {"compared": 0, "same_text": 0, "same_prompt_tokens": 0})
        for o in r.outcomes:
            other = ref.get((r.concurrency, r.repeat, o.request.request_id))
            if other is None:
                continue
            d["compared"] += 1
            d["same_text"] += o.text == other.text
            d["same_prompt_tokens"] += o.num_prompt_tokens == other.num_prompt_tokens
    return out


def markdown(tables: dict, kinds: list[str]) -> str:
    base = "mlx-lm" if "mlx-lm" in kinds else None
    lines = []
    for arrival, t in tables.items():
        lines += [f"**{arrival}**", "", "| server | c | TTFT p50 ms | TTFT p95 ms | ITL p50 ms | req tok/s p50 |"
                  f" agg tok/s |{' agg vs mlx-lm |' if base else ''} tokens |",
                  "|---|---|---|---|---|---|---|" + ("---|" if base else "") + "---|"]
        for c in t["cells"]:
            ratio = t["ratios"].get(f"{c['arm']}@{c['concurrency']}")
            lines.append(f"| {c['arm']} | {c['concurrency']} | {c['ttft_p50_s'] * 1e3:.0f} | {c['ttft_p95_s'] * 1e3:.0f}"
                         f" | {c['itl_p50_s'] * 1e3:.1f} | {c['tokens_per_s_p50']:.1f} | {c['aggregate_tokens_per_s']:.1f}"
                         + (f" | {ratio:.2f}" if base and ratio else " | -" if base else "") + f" | {c['tokens']} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--servers", default=",".join(KINDS), help=f"comma list of {', '.join(KINDS)}")
    ap.add_argument("--model", default=str(default_model_path()), help="an mlx-lm directory (default: embedded)")
    ap.add_argument("--draft-model", default=str(default_model_path() / "draft"))
    ap.add_argument("--num-draft-tokens", type=int, default=3, help="mlx_lm.server's K (gmlx: adaptive, <= its K)")
    ap.add_argument("--arrivals", default="burst,poisson")
    ap.add_argument("--rate", type=float, default=4.0, help="poisson: arrivals per second")
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-timeout", type=float, default=240.0)
    ap.add_argument("--tag", default="servers", help="the file name's suffix")
    ap.add_argument("--out", type=Path, default=ROOT / "bench_results")
    a = ap.parse_args(argv)
    kinds = [k for k in a.servers.split(",") if k]
    assert all(k in KINDS for k in kinds), f"--servers: one of {KINDS}"
    concs = parse_int_list(a.concurrency, "--concurrency")
    model, draft = str(Path(a.model).resolve()), str(Path(a.draft_model).resolve())
    t_start = time.perf_counter()
    with Servers(kinds, model, draft, a.num_draft_tokens, a.start_timeout) as srv:
        targets = {k: probe(srv.urls[k]) for k in kinds}
        chosen = full_budget_prompts(targets[kinds[0]], a.requests, a.max_tokens, a.seed)
        specs = [load_prompt_specs(None)[i] for i in chosen]
        print(f"prompts (shipped indices) that run {a.max_tokens} tokens greedy: {chosen}", flush=True)
        health = {k: _health(srv.urls[k]) for k in kinds}
        tables, all_requests = {}, {}
        for arrival in a.arrivals.split(","):
            reqs = build_requests(specs, a.requests, Arrival(arrival, rate=a.rate).validated(),
                                  (a.max_tokens, a.max_tokens), 0.0, a.seed, ignore_eos=True)
            warm_up(targets, reqs, True)
            before = {k: _drafts(srv.urls[k]) for k in kinds}
            runs: list = []
            view = LiveView(len(kinds) * len(concs) * a.repeats * len(reqs), sys.stdout, rich=False)
            run_matrix_http(targets, reqs, concs, a.repeats, view, runs, ignore_eos=True)
            req_df = results.requests_frame(runs)
            cells = results.records(results.cells_frame(runs, req_df, a.repeats))
            ratios = {f"{k}@{c}": per_repeat_ratio(runs, k, "mlx-lm", c) for k in kinds for c in concs
                      if "mlx-lm" in kinds}
            tables[arrival] = {"cells": [_short(c) for c in cells], "ratios": ratios, "checks": cross_checks(runs),
                               "errors": [o.error for r in runs for o in r.outcomes if o.error],
                               "drafts": {k: _delta(before[k], _drafts(srv.urls[k])) for k in kinds}}
            all_requests[arrival] = results.records(req_df.drop(columns=["prompt_tokens", "tokens", "itl_s"]))
    meta = results.metadata(command="benchmarks/bench_servers.py", argv=[sys.executable, *sys.argv],
                            servers={k: {"command": srv.commands[k], "url": srv.urls[k], "model": targets[k].model,
                                         "health": health[k]} for k in kinds},
                            workload={"arrivals": a.arrivals, "rate": a.rate, "concurrency": concs,
                                      "requests": a.requests, "max_tokens": a.max_tokens, "repeats": a.repeats,
                                      "seed": a.seed, "temperature": 0.0, "ignore_eos_sent": True,
                                      "prompt_indices": chosen},
                            wall_s=time.perf_counter() - t_start)
    table = markdown(tables, kinds)
    print(table)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / f"{stamp}_{a.tag}.json"
    path.write_text(json.dumps({"meta": meta, "arrivals": tables, "requests": all_requests, "markdown": table},
                               indent=1, default=str) + "\n")
    path.with_suffix(".md").write_text(table + "\n")
    print(f"results: {path} and {path.with_suffix('.md')}")


def _short(cell: dict) -> dict:
    drop = ("speculative", "switch_preempt", "switch_resume", "num_drafted", "num_accepted", "draft_acceptance_rate",
            "mean_acceptance_length", "preempt", "gate", "resume", "capture")
    return {k: v for k, v in cell.items() if k not in drop}


def _drafts(url: str) -> tuple[float, float] | None:
    """(drafted, accepted) tokens so far from a gmlx server's /metrics; None for a server without them."""
    try:
        text = httpx.get(url + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return None
    got = {}
    for line in text.splitlines():
        for key in ("spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total"):
            if not line.startswith("#") and key in line.split("{")[0]:
                got[key] = got.get(key, 0.0) + float(line.split()[-1])
    return (got["spec_decode_num_draft_tokens_total"], got["spec_decode_num_accepted_tokens_total"]) \
        if len(got) == 2 else None


def _delta(a, b) -> dict | None:
    if a is None or b is None:
        return None
    drafted, accepted = b[0] - a[0], b[1] - a[1]
    return {"drafted": drafted, "accepted": accepted, "acceptance": accepted / drafted if drafted else None}


def _health(url: str):
    try:
        r = httpx.get(url + "/health", timeout=5)
        return r.json()
    except (httpx.HTTPError, ValueError):
        return None


if __name__ == "__main__":
    main()
