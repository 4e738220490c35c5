"""What `gmlx sweep-cap` measured, as tables: the measurements, the per-width summary (medians,
and medians of paired spec/plain ratios: docs/design.md §8) and the printed table. pandas: imported
only when the command runs."""

from __future__ import annotations

import math

import pandas as pd


def sweep_frame(measurements: list[dict]) -> pd.DataFrame:
    cols = {"width": "int64", "arm": "object", "k": "Int64", "repeat": "int64", "tokens_per_s": "float64",
            "tokens": "int64", "seconds": "float64", "draft_acceptance_rate": "float64", "rounds": "float64",
            "tokens_per_round": "float64", "drafts_per_round": "float64", "steady_rounds": "Int64"}
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
