"""Results of `gmlx bench` and `gmlx sweep-cap`: tables, files and plots.

The only module that imports pandas (and matplotlib): the engine and the other commands stay
light. Every file records where it was measured (machine, BLAS, versions, git commit, config,
env switches): docs/design.md §8 asks that no figure travels without them. CSV cells that hold lists
(token ids, ITL gaps) are JSON arrays, so `json.loads` reads them back.
"""

from __future__ import annotations

import json
import math
import os
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd

from gmlx.errors import ConfigError
from gmlx.machine import describe

TRANSITIONS = ("preempt", "gate", "resume", "capture")
ENV_SWITCHES = ("GMLX_MTP_PREEMPT", "GMLX_MTP_RESUME", "GMLX_MTP_WIDTH_CAP", "GMLX_OPENBLAS", "GMLX_CONFIG")
REQUEST_COLUMNS = {  # name -> dtype: the per-request table's contract (tests check it)
    "arm": "object", "concurrency": "int64", "repeat": "int64", "request_id": "int64", "prompt_tokens": "object",
    "tokens": "object", "num_prompt_tokens": "int64", "num_generated": "int64", "max_tokens": "int64",
    "finish_reason": "object", "seed": "int64", "temperature": "float64", "submit_s": "float64",
    "ttft_s": "float64", "e2e_s": "float64", "tokens_per_s": "float64", "itl_s": "object", "itl_p50_s": "float64",
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
}


def metadata(**extra) -> dict:
    """Machine, BLAS, versions and git commit, the env switches, and what the caller adds."""
    return {"machine": describe(), "env": {k: os.environ.get(k) for k in ENV_SWITCHES},
            "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"), **extra}


def _q(values, q: float) -> float:
    s = pd.Series(values, dtype="float64").dropna()
    return float(s.quantile(q)) if len(s) else math.nan


# -- bench -------------------------------------------------------------------------------------
def requests_frame(runs) -> pd.DataFrame:
    rows = []
    for run in runs:
        for o in run.outcomes:
            s, last = o.stats, (o.chunks[-1][0] if o.chunks else math.nan)
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
                "submit_s": o.submit_s, "ttft_s": o.ttft_s, "e2e_s": last - o.submit_s,
                # A rate needs two tokens: an undefined one is NaN, so medians skip it instead of counting 0.
                "tokens_per_s": o.tokens_per_s if n_out > 1 else math.nan,
                "itl_s": o.itl_s, "itl_p50_s": _q(o.itl_s, 0.5),
                "num_drafted": drafted, "num_accepted": s.get("num_accepted", 0), "num_rounds": s.get("num_rounds", 0),
                # Nothing drafted (plain arm, over the cap, EOS first): no acceptance to report, not 0.
                "draft_acceptance_rate": s.get("draft_acceptance_rate", 0.0) if drafted else math.nan,
                "mean_acceptance_length": s.get("mean_acceptance_length", 0.0) if drafted else math.nan,
                "eos_first": o.finish_reason == "stop" and not n_out})
    df = pd.DataFrame(rows, columns=list(REQUEST_COLUMNS))
    return df.astype({k: v for k, v in REQUEST_COLUMNS.items() if v != "object"})


def cells_frame(runs, requests: pd.DataFrame, repeats: int | None = None) -> pd.DataFrame:
    """One row per (arm, concurrency): percentiles over all its requests and repeats; aggregate
    tok/s is the median over repeats of (tokens / first submit to last token). `partial`: a run
    of the cell was cut off, or fewer than `repeats` ran (an interrupt)."""
    out = []
    keys = dict.fromkeys((r.arm, r.concurrency) for r in runs)
    for arm, c in keys:
        mine = [r for r in runs if r.arm == arm and r.concurrency == c]
        req = requests[(requests.arm == arm.name) & (requests.concurrency == c)]
        agg = []
        for r in mine:
            rr = req[req.repeat == r.repeat]
            span = (rr.submit_s + rr.e2e_s).max() - rr.submit_s.min() if len(rr) else math.nan
            agg.append(rr.num_generated.sum() / span if span and span > 0 else math.nan)
        drafted, accepted, rounds = int(req.num_drafted.sum()), int(req.num_accepted.sum()), int(req.num_rounds.sum())
        itl = [g for gaps in req.itl_s for g in gaps]
        out.append({
            "arm": arm.name, "concurrency": c, "speculative": bool(arm.speculative), "switch_preempt": arm.preempt,
            "switch_resume": arm.resume, "repeats": len(mine), "requests": len(req), "tokens": int(req.num_generated.sum()),
            "ttft_p50_s": _q(req.ttft_s, 0.5), "ttft_p95_s": _q(req.ttft_s, 0.95), "itl_p50_s": _q(itl, 0.5),
            "itl_p95_s": _q(itl, 0.95), "tokens_per_s_p50": _q(req.tokens_per_s, 0.5),
            "aggregate_tokens_per_s": _q(agg, 0.5), "num_drafted": drafted, "num_accepted": accepted,
            "draft_acceptance_rate": accepted / drafted if drafted else math.nan,
            "mean_acceptance_length": 1 + accepted / rounds if rounds else math.nan,
            **{t: sum(r.transitions.get(t, 0) for r in mine) for t in TRANSITIONS},
            "partial": not all(r.complete for r in mine) or (repeats is not None and len(mine) < repeats),
            "eos_first": int(req.eos_first.sum()), "num_rounds": rounds,
            # filled by gmlx_cli/ideal.py where a gmlx plain cell ran at the same concurrency
            "speedup_vs_plain": math.nan, "ideal_speedup": math.nan, "achieved_over_ideal": math.nan})
    df = pd.DataFrame(out, columns=list(CELL_COLUMNS))
    return df.astype({k: v for k, v in CELL_COLUMNS.items() if v != "object"})


PARTIAL_MARK = "*"
SUMMARY_TITLES = ("summary per cell: latency (ms) and throughput (tok/s)", "summary per cell: speculation",
                  "summary per cell: achieved against ideal")


def summary_tables(cells: pd.DataFrame) -> list[tuple[str, list[str], list[list]]]:
    """The printed per-cell summary as two narrow tables (each fits 80 columns with the longest arm
    name): times in ms; acceptance (vLLM's draft_acceptance_rate and mean_acceptance_length, named
    so in the files) is `-` wherever nothing was drafted. A partial cell's arm carries a `*`."""
    def arm(c) -> str:
        return c.arm + (PARTIAL_MARK if c.partial else "")

    timing = (["arm", "conc", "TTFT\np50", "TTFT\np95", "ITL\np50", "ITL\np95", "req\ntok/s", "agg\ntok/s"],
              [[arm(c), c.concurrency, c.ttft_p50_s * 1e3, c.ttft_p95_s * 1e3, c.itl_p50_s * 1e3, c.itl_p95_s * 1e3,
                c.tokens_per_s_p50, c.aggregate_tokens_per_s] for c in cells.itertuples()])
    spec = (["arm", "conc", "accept\nrate", "mean\nacc len", *TRANSITIONS],
            [[arm(c), c.concurrency, c.draft_acceptance_rate, c.mean_acceptance_length,
              *(getattr(c, t) for t in TRANSITIONS)] for c in cells.itertuples()])
    tables = [(SUMMARY_TITLES[0], *timing), (SUMMARY_TITLES[1], *spec)]
    vs = [[arm(c), c.concurrency, c.speedup_vs_plain, c.ideal_speedup, c.achieved_over_ideal]
          for c in cells.itertuples() if c.ideal_speedup == c.ideal_speedup]  # NaN: nothing to compare
    if vs:
        tables.append((SUMMARY_TITLES[2], ["arm", "conc", "speedup\nvs plain", "ideal\nspeedup", "achieved\n/ideal"], vs))
    return tables


def summary_notes(cells: pd.DataFrame, requests: pd.DataFrame) -> list[str]:
    """Lines under the summary: the legend, partial cells, requests that ended at EOS first."""
    notes = ["req tok/s: median per request after its first token; agg tok/s: tokens / span",
             "accept rate, mean acc len: `-` where nothing was drafted"]
    if cells.partial.any():
        notes.append(f"{PARTIAL_MARK} partial: interrupted before every request and repeat of the cell finished")
    eos = {}  # request ids -> the cells where exactly those ended at EOS first
    for c in cells.itertuples():
        mine = requests[(requests.arm == c.arm) & (requests.concurrency == c.concurrency) & requests.eos_first]
        if len(mine):
            eos.setdefault(tuple(sorted(set(mine.request_id))), []).append(f"{c.arm} c={c.concurrency}")
    for ids, where in eos.items():
        n, scope = len(ids), "every cell" if len(where) == len(cells) else ", ".join(where)
        notes.append(f"request{'s' if n > 1 else ''} {', '.join(map(str, ids))} ended at EOS before"
                     f" {'their' if n > 1 else 'its'} first token ({scope}): no TTFT or tok/s, left out of those")
    return notes


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


# -- sweep-cap ---------------------------------------------------------------------------------
def sweep_frame(measurements: list[dict]) -> pd.DataFrame:
    cols = {"width": "int64", "arm": "object", "k": "Int64", "repeat": "int64", "tokens_per_s": "float64",
            "tokens": "int64", "seconds": "float64", "draft_acceptance_rate": "float64", "rounds": "float64",
            "tokens_per_round": "float64", "drafts_per_round": "float64"}
    return pd.DataFrame(measurements, columns=list(cols)).astype(cols)


def sweep_summary(df: pd.DataFrame, widths: list[int], ks: list[int]) -> list[dict]:
    """Per width: plain's median tok/s and, per K, spec's median and the median of the paired
    spec/plain ratios (same width and repeat: side by side, docs/design.md §8)."""
    out = []
    for w in widths:
        plain = df[(df.width == w) & (df.arm == "plain")].set_index("repeat").tokens_per_s
        if plain.empty:
            continue
        row = {"width": w, "plain_tokens_per_s": float(plain.median()), "spec": {}}
        for k in ks:
            spec = df[(df.width == w) & (df.arm == "spec") & (df.k == k)].set_index("repeat")
            if spec.empty:
                continue
            ratio = (spec.tokens_per_s / plain).dropna()
            row["spec"][k] = {"tokens_per_s": float(spec.tokens_per_s.median()),
                              "speedup": float(ratio.median()) if len(ratio) else math.nan,
                              "draft_acceptance_rate": float(spec.draft_acceptance_rate.median())}
            if spec.rounds.sum() > 0:  # rows' speculative rounds, for the ideal speedup (gmlx_cli/ideal.py)
                row["spec"][k].update(rounds=int(spec.rounds.sum()),
                                      tokens_per_round=float(spec.tokens_per_round.median()),
                                      drafts_per_round=float(spec.drafts_per_round.median()))
        if row["spec"]:
            row["best_k"] = max(row["spec"], key=lambda k: row["spec"][k]["speedup"])
            row["speedup"] = row["spec"][row["best_k"]]["speedup"]
            out.append(row)
    return out


def sweep_table(summary: list[dict], ks: list[int], margin: float,
                at_cap: list[str] | None = None) -> tuple[list[str], list[list]]:
    """Per width: tok/s and speedup per K, whether the best K beat plain by the margin ("wins"),
    and what the recommended cap runs there ("at cap": spec, plain, or scalar at width 1)."""
    cols = (["width", "plain\ntok/s"] + [c for k in ks for c in (f"K={k}\ntok/s", f"K={k}\nspeedup")]
            + ["best\nK", "wins", "ideal\nspeedup", "achieved\n/ideal"])
    rows = [[r["width"], r["plain_tokens_per_s"]]
            + [v for k in ks for v in (r["spec"].get(k, {}).get("tokens_per_s"), r["spec"].get(k, {}).get("speedup"))]
            + [r["best_k"], "yes" if r["speedup"] >= margin else "no", r.get("ideal"), r.get("achieved_over_ideal")]
            for r in summary]
    if at_cap is not None:
        cols.append("at cap")
        rows = [row + [a] for row, a in zip(rows, at_cap)]
    return cols, rows
