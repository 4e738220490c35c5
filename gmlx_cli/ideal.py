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
