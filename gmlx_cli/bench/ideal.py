"""Achieved against ideal: the speedup the measured acceptance implies at the measured costs.

A speculative round that drafts k tokens on average and emits m tokens on average (the accepted
run plus the bonus) costs t(k+1)/t(1) + k * draft plain steps (gmlx/policy/costs.py, measured
by gmlx/decode/probe.py at the same batch width), so its ideal speedup over plain decoding is
m / (t(k+1)/t(1) + k * draft). Achieved / ideal is what the engine's own overhead leaves of it
(host work per round, the rows that finish at different rounds, admissions).
"""

from __future__ import annotations

import math

from gmlx.decode import probe
from gmlx.engine import Engine


def ideal_speedup(costs, tokens_per_round: float, drafts_per_round: float) -> float:
    lo = math.floor(drafts_per_round)
    frac = drafts_per_round - lo
    verify = (1 - frac) * costs.verify_cost(lo) + frac * costs.verify_cost(lo + 1)  # k need not be whole
    return tokens_per_round / (verify + drafts_per_round * costs.draft)


def annotate(summary: list[dict], lm, config_for) -> None:
    """Add `ideal` and `achieved_over_ideal` at each width's best K (costs measured per width)."""
    for row in summary:
        k = row["best_k"]
        spec = row["spec"][k]
        if not spec.get("rounds"):
            continue
        engine = Engine(lm, config_for(k))
        costs = probe.measure(lm.target, engine.drafter, k, width=row["width"])
        engine.close()
        ideal = ideal_speedup(costs, spec["tokens_per_round"], spec["drafts_per_round"])
        row.update(ideal=ideal, achieved_over_ideal=row["speedup"] / ideal,
                   costs={"verify": list(costs.verify), "draft": costs.draft, "source": costs.source})


def annotate_cells(cells, lm, config) -> None:
    """bench: each speculative gmlx cell against the gmlx plain cell at its concurrency (end to
    end, prefill included), and the ideal its own acceptance implies at the costs measured at
    that width (the ideal counts decode rounds only)."""
    plain = {c.concurrency: c.aggregate_tokens_per_s for c in cells.itertuples() if c.arm == "gmlx-plain"}
    costs: dict[int, object] = {}
    for i, c in enumerate(cells.itertuples()):
        if not c.speculative or not c.num_rounds or c.concurrency not in plain or not c.arm.startswith("gmlx"):
            continue
        if c.concurrency not in costs:
            engine = Engine(lm, config)
            costs[c.concurrency] = probe.measure(lm.target, engine.drafter, engine.k, width=c.concurrency)
            engine.close()
        ideal = ideal_speedup(costs[c.concurrency], 1 + c.num_accepted / c.num_rounds, c.num_drafted / c.num_rounds)
        achieved = c.aggregate_tokens_per_s / plain[c.concurrency]
        cells.loc[cells.index[i], ["speedup_vs_plain", "ideal_speedup", "achieved_over_ideal"]] = (
            achieved, ideal, achieved / ideal)
