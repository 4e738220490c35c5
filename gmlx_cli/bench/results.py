"""Results of `gmlx bench` and `gmlx sweep-cap`: the per-request and per-cell tables, and the files.

pandas is imported by this module and those that build on it (summary.py, sweep_results.py,
plots.py), and only when a command needs them: the engine and the other commands stay light. Every file records where it was measured (machine, BLAS, versions, git commit, config,
env switches): docs/design.md §8 asks that no figure travels without them. CSV cells that hold lists
(token ids, ITL gaps) are JSON arrays, so `json.loads` reads them back.
"""

from __future__ import annotations

import json
import math
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd

from gmlx.errors import ConfigError
from gmlx.machine import describe
from gmlx import switches
from gmlx.finish import FinishReason
from gmlx_cli.bench.driver import aggregate_tokens_per_s

TRANSITIONS = ("preempt", "gate", "resume", "capture")
ENV_SWITCHES = (switches.PREEMPT, switches.RESUME, switches.WIDTH_CAP, switches.OPENBLAS, switches.CONFIG)
REQUEST_COLUMNS = {  # name -> dtype: the per-request table's contract (tests check it)
    "arm": "object", "concurrency": "int64", "repeat": "int64", "request_id": "int64", "prompt_tokens": "object",
    "tokens": "object", "num_prompt_tokens": "int64", "num_generated": "int64", "max_tokens": "int64",
    "finish_reason": "object", "seed": "int64", "temperature": "float64", "submit_s": "float64",
    "ttft_s": "float64", "e2e_s": "float64", "end_s": "float64", "tokens_per_s": "float64", "itl_s": "object",
    "itl_p50_s": "float64",
    "num_drafted": "int64", "num_accepted": "int64", "num_rounds": "int64", "draft_acceptance_rate": "float64",
    "mean_acceptance_length": "float64", "eos_first": "bool",
}
CELL_COLUMNS = {
    "arm": "object", "concurrency": "int64", "speculative": "bool", "switch_preempt": "bool", "switch_resume": "bool",
    "repeats": "int64", "requests": "int64", "tokens": "int64", "ttft_p50_s": "float64", "ttft_p95_s": "float64",
    "itl_p50_s": "float64", "itl_p95_s": "float64", "tokens_per_s_p50": "float64",
    "aggregate_tokens_per_s": "float64", "num_drafted": "int64", "num_accepted": "int64",
    "draft_acceptance_rate": "float64", "mean_acceptance_length": "float64",
    **{t: "int64" for t in TRANSITIONS}, "partial": "bool", "eos_first": "int64", "num_rounds": "int64",
    "speedup_vs_plain": "float64", "ideal_speedup": "float64", "achieved_over_ideal": "float64",
    "rejected": "int64", "control_switches": "int64", "max_draft_tokens": "int64", "speculation": "object",
}
# What only the in-process engine knows: absent (not guessed) from a server's rows (bench --url).
# A server's acceptance comes from its /metrics counters per cell (num_drafted, num_accepted and
# the rates; null where it exposes none), never per request.
ENGINE_ONLY_CELL = ("speculative", "switch_preempt", "switch_resume", *TRANSITIONS, "num_rounds", "speedup_vs_plain",
                    "ideal_speedup", "achieved_over_ideal", "control_switches", "max_draft_tokens", "speculation")
ENGINE_ONLY_REQUEST = ("num_drafted", "num_accepted", "num_rounds", "draft_acceptance_rate", "mean_acceptance_length")
SERVER_CELL_DTYPES = {"num_drafted": "Int64", "num_accepted": "Int64"}  # null: the server exposes no counters


def metadata(**extra) -> dict:
    """Machine, BLAS, versions and git commit, the env switches, and what the caller adds."""
    return {"machine": describe(), "env": {s.name: s.raw() for s in ENV_SWITCHES},
            "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"), **extra}


def _q(values, q: float) -> float:
    s = pd.Series(values, dtype="float64").dropna()
    return float(s.quantile(q)) if len(s) else math.nan


def _served(runs) -> bool:
    """Every run went to a server (bench --url): the engine-only columns are left out."""
    runs = list(runs)
    return bool(runs) and all(r.arm.backend == "http" for r in runs)


def requests_frame(runs) -> pd.DataFrame:
    """One row per request and run. `end_s`: when it ended, whatever the reason; `e2e_s` = end -
    submit, defined for every request (one that ended at EOS first, was cancelled or rejected too)."""
    rows = []
    for run in runs:
        for o in run.outcomes:
            s, end = o.stats, o.ended_s
            drafted = s.get("num_drafted", 0)
            # Over HTTP the counts may come from `usage` without the ids (gmlx_cli/http_backend.py).
            n_out = getattr(o, "num_generated", len(o.tokens))
            n_prompt = getattr(o, "num_prompt_tokens", len(o.prompt_tokens))
            rows.append({
                "arm": run.arm.name, "concurrency": run.concurrency, "repeat": run.repeat,
                "request_id": o.request.request_id, "prompt_tokens": list(o.prompt_tokens), "tokens": list(o.tokens),
                "num_prompt_tokens": n_prompt, "num_generated": n_out,
                "max_tokens": o.request.params.max_tokens, "finish_reason": o.finish_reason,
                "seed": o.request.params.seed, "temperature": float(o.request.params.temperature),
                "submit_s": o.submit_s, "ttft_s": o.ttft_s, "e2e_s": end - o.submit_s, "end_s": end,
                "tokens_per_s": o.tokens_per_s,  # NaN where undefined (one token, or one instant)
                "itl_s": o.itl_s, "itl_p50_s": _q(o.itl_s, 0.5),
                "num_drafted": drafted, "num_accepted": s.get("num_accepted", 0), "num_rounds": s.get("num_rounds", 0),
                # Nothing drafted (plain arm, over the cap, EOS first): no acceptance to report, not 0.
                "draft_acceptance_rate": s.get("draft_acceptance_rate", 0.0) if drafted else math.nan,
                "mean_acceptance_length": s.get("mean_acceptance_length", 0.0) if drafted else math.nan,
                "eos_first": o.finish_reason == FinishReason.STOP and not n_out})
    df = pd.DataFrame(rows, columns=list(REQUEST_COLUMNS))
    df = df.astype({k: v for k, v in REQUEST_COLUMNS.items() if v != "object"})
    return df.drop(columns=list(ENGINE_ONLY_REQUEST)) if _served(runs) else df


def run_aggregates(runs, requests: pd.DataFrame) -> list[dict]:
    """Per run: its tokens, first submit, last end and aggregate tok/s (the figure its live line
    showed), from the request rows through `gmlx_cli.bench.driver.aggregate_tokens_per_s`."""
    out = []
    for r in runs:
        rr = requests[(requests.arm == r.arm.name) & (requests.concurrency == r.concurrency)
                      & (requests.repeat == r.repeat)]
        out.append({"arm": r.arm.name, "concurrency": r.concurrency, "repeat": r.repeat,
                    "tokens": int(rr.num_generated.sum()),
                    "first_submit_s": float(rr.submit_s.min()) if len(rr) else math.nan,
                    "last_end_s": float(rr.end_s.max()) if len(rr) else math.nan,
                    "aggregate_tokens_per_s": aggregate_tokens_per_s(rr.num_generated, rr.submit_s, rr.end_s),
                    "complete": bool(r.complete),
                    **({"server_spec_counters": r.server_spec} if r.arm.backend == "http" else {})})
    return out


def _server_acceptance(mine) -> dict:
    """A server's cell: acceptance from the differences of its /metrics counters across each run
    (vLLM's definitions: rate = accepted / draft tokens, mean length = 1 + accepted / drafts);
    null where a run has none (the server exposes no such counters)."""
    deltas = [getattr(r, "server_spec", None) for r in mine]
    if not deltas or any(d is None for d in deltas):
        return {"num_drafted": None, "num_accepted": None, "draft_acceptance_rate": math.nan,
                "mean_acceptance_length": math.nan}
    drafts, drafted, accepted = (sum(d[k] for d in deltas) for k in ("drafts", "draft_tokens", "accepted"))
    return {"num_drafted": drafted, "num_accepted": accepted,
            "draft_acceptance_rate": accepted / drafted if drafted else math.nan,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else math.nan}


def cells_frame(runs, requests: pd.DataFrame, repeats: int | None = None) -> pd.DataFrame:
    """One row per (arm, concurrency): percentiles over all its requests and repeats; aggregate
    tok/s is the median over repeats of each run's tokens / (last end - first submit), every
    request counted however it ended (`run_aggregates`). `partial`: a run of the cell was cut off,
    or fewer than `repeats` ran (an interrupt). For a server (bench --url) the engine-only columns
    are left out and acceptance comes from its /metrics (`_server_acceptance`)."""
    out = []
    served = _served(runs)
    keys = dict.fromkeys((r.arm, r.concurrency) for r in runs)
    for arm, c in keys:
        mine = [r for r in runs if r.arm == arm and r.concurrency == c]
        req = requests[(requests.arm == arm.name) & (requests.concurrency == c)]
        agg = [a["aggregate_tokens_per_s"] for a in run_aggregates(mine, requests)]
        if served:
            spec = _server_acceptance(mine)
            rounds = 0
        else:
            drafted, accepted = int(req.num_drafted.sum()), int(req.num_accepted.sum())
            rounds = int(req.num_rounds.sum())
            spec = {"num_drafted": drafted, "num_accepted": accepted,
                    "draft_acceptance_rate": accepted / drafted if drafted else math.nan,
                    "mean_acceptance_length": 1 + accepted / rounds if rounds else math.nan}
        itl = [g for gaps in req.itl_s for g in gaps]
        out.append({
            "arm": arm.name, "concurrency": c, "speculative": bool(arm.speculative), "switch_preempt": arm.preempt,
            "switch_resume": arm.resume, "repeats": len(mine), "requests": len(req), "tokens": int(req.num_generated.sum()),
            "ttft_p50_s": _q(req.ttft_s, 0.5), "ttft_p95_s": _q(req.ttft_s, 0.95), "itl_p50_s": _q(itl, 0.5),
            "itl_p95_s": _q(itl, 0.95), "tokens_per_s_p50": _q(req.tokens_per_s, 0.5),
            "aggregate_tokens_per_s": _q(agg, 0.5), **spec,
            **{t: sum(r.transitions.get(t, 0) for r in mine) for t in TRANSITIONS},
            "partial": not all(r.complete for r in mine) or (repeats is not None and len(mine) < repeats),
            "eos_first": int(req.eos_first.sum()), "num_rounds": rounds,
            # filled by gmlx_cli/ideal.py where a gmlx plain cell ran at the same concurrency
            "speedup_vs_plain": math.nan, "ideal_speedup": math.nan, "achieved_over_ideal": math.nan,
            "rejected": int((req.finish_reason == FinishReason.REJECTED).sum()),
            # the online control: how often it switched a width, the most drafts a round ran, and
            # what ran at the end of the cell's last request, and why (gmlx/engine/speculation.py)
            "control_switches": sum(r.transitions.get("control_switches", 0) for r in mine),
            "max_draft_tokens": max((int(o.stats.get("max_draft_tokens") or 0) for r in mine for o in r.outcomes),
                                    default=0),
            "speculation": _last_decision(mine)})
    df = pd.DataFrame(out, columns=list(CELL_COLUMNS))
    if served:
        dtypes = {k: SERVER_CELL_DTYPES.get(k, v) for k, v in CELL_COLUMNS.items() if k not in ENGINE_ONLY_CELL}
        return df.drop(columns=list(ENGINE_ONLY_CELL)).astype({k: v for k, v in dtypes.items() if v != "object"})
    return df.astype({k: v for k, v in CELL_COLUMNS.items() if v != "object"})


def _last_decision(runs) -> str:
    """The speculation line of the cell's last finished request (its last run's)."""
    for r in reversed(runs):
        ends = sorted((o for o in r.outcomes if o.stats.get("speculation")), key=lambda o: o.ended_s)
        if ends:
            return ends[-1].stats["speculation"]
    return ""


def transitions_by_arm(runs) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for r in runs:
        d = out.setdefault(r.arm.name, dict.fromkeys(TRANSITIONS, 0))
        for t in TRANSITIONS:
            d[t] += r.transitions.get(t, 0)
    return out


def records(df: pd.DataFrame) -> list[dict]:
    """JSON-safe rows: numpy scalars to Python, NaN to null."""
    return json.loads(df.to_json(orient="records"))


def _stamp(out: Path, prefix: str) -> Path:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    base, i = out / f"{prefix}-{stamp}", 1
    while base.with_suffix(".json").exists():  # two runs in one second must not overwrite
        base, i = out / f"{prefix}-{stamp}-{i}", i + 1
    return base


def write_tables(out: Path, prefix: str, payload: dict, tables: dict[str, pd.DataFrame]) -> dict[str, Path]:
    """<prefix>-<utc>.json (the whole payload) and one CSV per table, with the metadata as columns."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create the results directory {str(out)!r}: {e}") from None
    base = _stamp(out, prefix)
    paths = {"json": base.with_suffix(".json")}
    m = payload["meta"]["machine"]
    flat = {f"meta_{k}": m.get(k) for k in ("cpu", "cores", "blas", "mlx", "mlx_lm", "gmlx", "git_commit")}
    try:  # checked before the run (gmlx_cli.outdir), but a disk can fill up meanwhile
        paths["json"].write_text(json.dumps(payload, indent=1, default=str) + "\n")
        for name, df in tables.items():
            csv = df.copy()
            for col in csv.columns:
                if csv[col].map(lambda v: isinstance(v, list)).any():
                    csv[col] = csv[col].map(json.dumps)
            for k, v in flat.items():
                csv[k] = v
            paths[name] = Path(f"{base}-{name}.csv")
            csv.to_csv(paths[name], index=False)
    except OSError as e:
        raise ConfigError(f"cannot write the results to {str(out)!r}: {e}") from None
    return paths
