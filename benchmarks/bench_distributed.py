"""One rank vs two (tensor parallelism over the ring backend, loopback), on the embedded model.

Each repeat launches the one-rank arm (a plain process) and the two-rank arm (two processes with
a hostfile of free loopback ports), in alternating order. Every launch measures, in this order:
1. forwards, every rank alike: the median time of a decode forward (1 token per row) and of a
   verify forward (4 tokens per row) at each width, with the model's all_sums (2 per layer) and,
   for the two-rank arm, without them (the sharded layers' all_sum skipped, for timing only):
   the difference is the in-graph communication cost per forward;
2. engine cells, driven by rank 0: `width` greedy requests submitted together (EOS ignored,
   `--max-tokens` each), speculative and plain; aggregate tokens/s including prefill, steps, and
   the time rank 0 spent in its one exchange per step (the broadcast of the step's inputs and
   plan, with every rank's checksum), median per step.
The machine is shared and has 2 cores, so two ranks share them with each other and with other
work: this measures the protocol's costs, not what two Macs would gain.

Run: ``python benchmarks/bench_distributed.py --repeats 3 --max-tokens 32 --widths 1,4``
Writes bench_results/<utc>_distributed.json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKER_TIMEOUT_S = 600


# ---- the worker: one launch, every rank ------------------------------------------------------
def time_forwards(lm, widths, reps: int) -> dict:
    """Median forward times in ms, by (width, tokens per row), with and without the all_sums."""
    import mlx.core as mx
    from mlx.nn.layers.distributed import ShardedToAllLinear
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    class NoComm(ShardedToAllLinear):  # timing only: this rank's share of the work, no all_sum
        def __call__(self, x):
            x = x @ self["weight"].T
            return x + self["bias"] if "bias" in self else x

    model = lm.target.model
    sharded = [m for _, m in model.named_modules() if isinstance(m, ShardedToAllLinear)]
    out = {}
    for w in widths:
        for length in (1, 4):
            cache = make_prompt_cache(model)
            mx.eval(model(mx.ones((w, 32), dtype=mx.int32), cache=cache))
            x = mx.ones((w, length), dtype=mx.int32)
            row = {}
            for arm in ("with_all_sums", "without") if sharded else ("with_all_sums",):
                for m in sharded:
                    m.__class__ = ShardedToAllLinear if arm == "with_all_sums" else NoComm
                times = []
                for i in range(reps + 3):
                    t0 = time.perf_counter()
                    mx.eval(model(x, cache=cache))
                    if i >= 3:
                        times.append(time.perf_counter() - t0)
                    trim_prompt_cache(cache, length)
                row[arm] = 1000 * statistics.median(times)
            for m in sharded:
                m.__class__ = ShardedToAllLinear
            out[f"w{w}_l{length}"] = {**row, "all_sums": 2 * len(model.layers) if sharded else 0}
    return out


def run_cells(lm, new_engine, widths, max_tokens: int, channel) -> list[dict]:
    from gmlx import EngineConfig, SamplingParams
    from gmlx.data import load_prompts

    prompts = [lm.tokenizer.encode(p) for p in load_prompts()]
    params = SamplingParams(max_tokens=max_tokens, seed=0, ignore_eos=True)
    cells = []
    for w in widths:
        for spec in (True, False):
            eng = new_engine(lm, EngineConfig(speculative=spec, prompt_cache_bytes=0))
            before = (channel.stats.exchanges, len(channel.stats.samples)) if channel else (0, 0)
            t0 = time.perf_counter()
            streams = [eng.submit(prompts[i], params, start=False) for i in range(w)]
            steps = 0
            while eng.has_work:
                eng.step()
                steps += 1
            dt = time.perf_counter() - t0
            recs = [s.wait(5) for s in streams]
            eng.close()
            toks = sum(len(r.tokens) for r in recs)
            drafted = sum(r.stats["num_drafted"] for r in recs)
            cell = {"width": w, "speculative": spec, "tok_s": toks / dt, "tokens": toks, "steps": steps,
                    "acceptance": sum(r.stats["num_accepted"] for r in recs) / drafted if drafted else None}
            if channel:
                ex = channel.stats.samples[before[1]:]
                cell["exchange_ms_median"] = 1000 * statistics.median(ex) if ex else None
                cell["exchanges"] = len(ex)
            cells.append(cell)
    return cells


def worker(out: Path, widths, max_tokens: int, reps: int) -> int:
    import gmlx  # noqa: F401  (OpenBLAS before mlx)

    if "MLX_RANK" not in os.environ:
        from gmlx import Engine
        from gmlx.models.loading import load

        lm = load()
        result = {"ranks": 1, "forward_ms": time_forwards(lm, widths, reps),
                  "cells": run_cells(lm, Engine, widths, max_tokens, None)}
        (out / "result.json").write_text(json.dumps(result))
        return 0
    from gmlx.distributed import start

    cluster = start()
    lm = cluster.load()
    forwards = time_forwards(lm, widths, reps)  # every rank runs it: the all_sums pair up
    if not cluster.leader:
        return cluster.follow(lm)
    with cluster:
        cells = run_cells(lm, cluster.engine, widths, max_tokens, cluster.channel)
    result = {"ranks": cluster.size, "forward_ms": forwards, "cells": cells, "comm": cluster.stats}
    (out / "result.json").write_text(json.dumps(result))
    return 0


# ---- the orchestrator ----------------------------------------------------------------------
def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def launch(ranks: int, args) -> dict:
    """One worker launch of `ranks` processes; rank 0's result."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        cmd = [sys.executable, __file__, "--worker", str(out), "--widths", args.widths,
               "--max-tokens", str(args.max_tokens), "--forward-reps", str(args.forward_reps)]
        envs = [dict(os.environ)]
        if ranks > 1:
            (out / "hosts.json").write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(ranks)]))
            envs = [{**os.environ, "MLX_HOSTFILE": str(out / "hosts.json"), "MLX_RANK": str(r)} for r in range(ranks)]
        procs = [subprocess.Popen(cmd, env=e) for e in envs]
        try:
            codes = [p.wait(timeout=WORKER_TIMEOUT_S) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        if any(codes):
            raise SystemExit(f"a {ranks}-rank launch failed: exit codes {codes}")
        return json.loads((out / "result.json").read_text())


def summarize(runs: dict[int, list[dict]]) -> dict:
    out = {}
    for ranks, results in runs.items():
        cells = {}
        for res in results:
            for c in res["cells"]:
                cells.setdefault((c["width"], c["speculative"]), []).append(c)
        out[f"{ranks}_ranks"] = {
            f"w{w}_{'spec' if s else 'plain'}": {
                "tok_s_median": statistics.median(c["tok_s"] for c in cs),
                "steps_median": statistics.median(c["steps"] for c in cs),
                "acceptance": statistics.median(c["acceptance"] for c in cs) if cs[0]["acceptance"] is not None
                else None,
                "exchange_ms_median": statistics.median(c["exchange_ms_median"] for c in cs)
                if "exchange_ms_median" in cs[0] else None}
            for (w, s), cs in sorted(cells.items())}
        fwd = {}
        for key in results[0]["forward_ms"]:
            rows = [r["forward_ms"][key] for r in results]
            fwd[key] = {arm: statistics.median(r[arm] for r in rows) for arm in rows[0] if arm != "all_sums"}
            fwd[key]["all_sums"] = rows[0]["all_sums"]
        out[f"{ranks}_ranks"]["forward_ms"] = fwd
    one, two = out["1_ranks"], out["2_ranks"]
    out["two_over_one"] = {k: two[k]["tok_s_median"] / one[k]["tok_s_median"] for k in one if k != "forward_ms"}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--widths", default="1,4")
    ap.add_argument("--forward-reps", type=int, default=15)
    ap.add_argument("--out", type=Path, default=Path("bench_results"))
    ap.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    if args.worker is not None:
        raise SystemExit(worker(args.worker, widths, args.max_tokens, args.forward_reps))

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import gmlx  # noqa: F401
    from common import command_line, write_result
    from gmlx.machine import describe

    runs: dict[int, list[dict]] = {1: [], 2: []}
    t0 = time.perf_counter()
    for rep in range(args.repeats):
        for ranks in (1, 2) if rep % 2 == 0 else (2, 1):
            res = launch(ranks, args)
            runs[ranks].append(res)
            print(f"rep {rep} {ranks} rank(s): " + ", ".join(
                f"w{c['width']} {'spec' if c['speculative'] else 'plain'} {c['tok_s']:.1f} tok/s" for c in res["cells"]),
                flush=True)
    summary = summarize(runs)
    result = {"benchmark": "distributed", "command": command_line("bench_distributed.py", args),
              "machine": describe(), "wall_s": time.perf_counter() - t0, "repeats": args.repeats,
              "max_tokens": args.max_tokens, "widths": widths, "summary": summary, "per_repeat": runs,
              "note": "2-core shared VM: both ranks share the 2 cores with each other and other sessions' work"}
    path = write_result(args.out, "distributed", result)
    print(json.dumps(summary, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
