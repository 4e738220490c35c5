"""What a new lone request starts with (the scalar lane's `decide`): up to how many drafts a round, or
plain. The online control (or, without it, the cost model at the acceptance expected before any round)
decides; a load probe that says plain is taken again before a request is sent plain on its word."""

from __future__ import annotations

from gmlx.decode.probe import reconfirmed
from gmlx.policy.adaptive import AcceptanceEstimate


def start_k(lane, max_k: int | None = None) -> int:
    """The most drafts a new request on `lane` (a ScalarLane) may use: `max_k` (calibrated, else the
    lane's K), or 0 (decode it plain) when no draft length pays at the acceptance expected before
    any round (the estimate's prior) under this machine's measured costs."""
    max_k = lane.k if max_k is None else max_k
    if lane.drafter is None or max_k == 0:
        return 0
    if not lane.may_go_plain:
        return max_k
    control = lane.control
    if control is not None:  # from what earlier lone requests measured (or the cost model)
        if control.choose(1, max_k, control.pooled(1)).speculates:
            return max_k
        if not control.at(1).times(1, lane.round_costs())[2] and lane.costs.source.startswith("measured"):
            control.costs = lane.costs = reconfirmed(lane.target, lane.drafter, max(lane.k, 1))
        return max_k if control.choose(1, max_k, control.pooled(1)).speculates else 0
    if AcceptanceEstimate().best_k(max_k, lane.round_costs()) > 0:
        return max_k
    if lane.costs.source.startswith("measured"):  # not figures someone set: measure once more
        lane.costs = reconfirmed(lane.target, lane.drafter, max(lane.k, 1))
    return max_k if AcceptanceEstimate().best_k(max_k, lane.costs) > 0 else 0
