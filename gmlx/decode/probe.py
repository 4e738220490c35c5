"""Measure what a speculative round costs on this machine: verify forwards of 1..K+1 tokens and
one drafter step, relative to a one-token forward (gmlx/policy/costs.py explains the units).

Run once per (model, drafter kind, K) in a process, when a speculative engine is constructed
(with an explicit K only when a lone request first adapts its K within that ceiling); a lone request gives speculation
up on these figures only after a second measurement agrees (`reconfirmed`). Costs are timed as the
engine meets them: wall time of the forward built and evaluated (graph building included,
which is what dominates a small model on a GPU), after a short context. The lengths are timed
in turn, a few times over, and each keeps its fastest time: on a shared machine the minimum is
the estimate that load spikes do not move. A quantized target on a CPU shows here that a verify
of k+1 tokens costs about k+1 steps. GMLX_ROUND_COSTS=prior skips the measurement (the built-in
estimates: reproducible decisions, e.g. in tests).
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from gmlx import measured, switches
from gmlx.models.gated_delta import prior_verify
from gmlx.config import SamplingParams
from gmlx.decode.prefill import Prefilled
from gmlx.models.forward import prefill
from gmlx.drafters.base import DraftPick, Drafter
from gmlx.row import Row
from gmlx.models.adapter import Target
from gmlx.policy.costs import PRIOR, Costs
from gmlx.policy.figures import owner  # filed under the model, not an engine's view of it
from gmlx.timing import REPS, fastest

_CONTEXT = 48
LONG_REPS = 2
_measured: "weakref.WeakKeyDictionary[Target, dict]" = weakref.WeakKeyDictionary()


def round_costs(target: Target, drafter: Drafter, max_k: int) -> Costs:
    """The measured costs for this target and drafter kind (measured once per process)."""
    if switches.ROUND_COSTS.value() == "prior":
        return Costs(prior_verify(PRIOR.verify, target.model), drafter.step_cost,
                     "prior (GMLX_ROUND_COSTS=prior)")
    per_target = _measured.setdefault(owner(target), {})
    key = (drafter.kind, max_k)
    if key not in per_target:
        try:
            per_target[key] = _kept_or_measured(target, drafter, max_k)
        except Exception as e:  # a drafter the probe cannot drive: its constant, said once
            warnings.warn(f"gmlx: could not measure the {drafter.kind} drafter's round costs ({type(e).__name__}:"
                          f" {e}); using the built-in estimates", RuntimeWarning, stacklevel=2)
            per_target[key] = Costs(prior_verify(PRIOR.verify, target.model), drafter.step_cost,
                                    "prior (probe failed)")
    return per_target[key]


def _kept_or_measured(target: Target, drafter: Drafter, max_k: int) -> Costs:
    """The costs an earlier process measured on this model, drafter, machine and software (gmlx/measured.py),
    else measured now (and kept)."""
    source = getattr(owner(target), "source", None)
    if source is None:
        return measure(target, drafter, max_k)
    key = [source, drafter.kind, max_k, _weights(drafter)]
    if (kept := measured.recall("round_costs", key)) is not None:
        c, at = kept
        return Costs(tuple(c["verify"]), c["draft"], f"{c['source']}; kept from {measured.when(at)}",
                     tuple(tuple(r) for r in c["rows"]))
    costs = measure(target, drafter, max_k)
    measured.keep("round_costs", key, dataclasses.asdict(costs))
    return costs


def _weights(drafter: Drafter) -> list:
    """The shapes and types of the drafter's weights (what its step costs depends on): the modules
    it holds, directly or one object down (a bound head's module)."""
    held = list(vars(drafter).values())
    held += [x for v in held if not isinstance(v, nn.Module) and hasattr(v, "__dict__") for x in vars(v).values()]
    found = [sorted((k, list(a.shape), str(a.dtype)) for k, a in tree_flatten(m.parameters()))
             for m in held if isinstance(m, nn.Module)]
    return [type(drafter).__name__, sorted(found)]


def reconfirmed(target: Target, drafter: Drafter, max_k: int) -> Costs:
    """The costs after a second measurement (once per process): on a shared machine another
    process's load can inflate one measurement's multi-token forwards, and a lone request must not
    give speculation up on that alone. The cheaper round of the two measurements is kept (for
    this target and drafter kind from now on)."""
    per_target = _measured.setdefault(owner(target), {})
    key = (drafter.kind, max_k)
    first = round_costs(target, drafter, max_k)
    if (key, "confirmed") in per_target or not first.source.startswith("measured"):
        return per_target.get((key, "confirmed"), first)
    try:
        second = measure(target, drafter, max_k)
    except Exception:  # noqa: BLE001 - the first figures stand (round_costs warned if it could not measure)
        second = first
    best = min((first, second), key=lambda c: c.verify_cost(max_k) + max_k * c.draft)
    per_target[key] = per_target[(key, "confirmed")] = best
    return best


def measure(target: Target, drafter: Drafter | None, max_k: int, width: int = 1) -> Costs:
    """Costs at this batch width: rows of the same context decoding together (t(1) is then a
    plain step of the whole batch, the unit a batch round is compared with). At width 1 also
    forwards of the rows wider batches verify (`Costs.rows`)."""
    ids = [(7 * i + 3) % target.vocab_size for i in range(_CONTEXT + 4 * (max_k + 1))]
    cache = target.make_cache()
    hidden = prefill(target, cache, [ids[: _CONTEXT - 1]] * width, _CONTEXT, want_hidden=True)

    def forward(n: int):
        x = mx.array([ids[_CONTEXT - 1: _CONTEXT - 1 + n]] * width, dtype=mx.int32)

        def run():
            logits, h = target(x, cache)
            mx.eval(logits, h)  # sync: the probe times whole forwards
            for c in cache:
                c.trim(n)
        return run

    t = fastest([forward(n) for n in range(1, max_k + 2)])
    # The rows a batch's rounds verify (policy/costs.py: a width's costs are read off them): widths 2
    # and 4 at every K, past the verify's lengths; fastest of two turns, no warm-up (the verify's
    # lengths warmed the kernels; a step of a few rows is what these show, not a few per cent):
    # ~0.45 s more at engine start on SmolLM2 float32 with the CPU's kernel (1.3 -> 1.75 s).
    longer = sorted({w * (k + 1) for w in (2, 4) for k in range(1, max_k + 1)} - set(range(1, max_k + 2))) \
        if width == 1 else []
    t_long = fastest([forward(n) for n in longer], reps=LONG_REPS, warm=False) if longer else []
    lengths = list(range(1, max_k + 2)) + longer
    rel = np.maximum.accumulate([x / t[0] for x in t + t_long]).tolist()  # sync: none, numpy; a longer forward never costs less
    verify = tuple(rel[: max_k + 1])
    draft = _draft_cost(drafter, cache, hidden, ids, max_k, width) / t[0] if drafter is not None else 0.0
    return Costs(verify, draft, f"measured (width {width}, context {_CONTEXT}, fastest of {REPS})",
                 tuple(zip(lengths, rel)) if longer else ())


def _draft_cost(drafter: Drafter, cache: list, hidden: mx.array, ids: list[int], max_k: int, width: int) -> float:
    """Seconds per drafter step: drafts of 1 and of max_k from a fresh state, each row starting
    with one pending entry (so the difference is max_k - 1 chained steps)."""
    row = Row(rid=-1, prompt=ids[:_CONTEXT], params=SamplingParams(max_tokens=1).validated(),
              eos_ids=frozenset(), detokenizer=None)
    pres = [Prefilled(None, hidden[b:b + 1, -1:], mx.array([[ids[_CONTEXT - 1]]], dtype=mx.int32))
            for b in range(width)]
    pick = DraftPick(None, np.full(width, _CONTEXT))

    def drafts(k: int):
        def run():
            st = drafter.start([row] * width, pres)
            mx.eval(drafter.draft(st, k, pick, cache))  # sync: the probe times whole draft chains
        return run

    if max_k < 2:
        return fastest([drafts(1)])[0] / 2  # the pending entry's teacher forcing and the draft: two steps
    one, many = fastest([drafts(1), drafts(max_k)])
    return max(many - one, 0.0) / (max_k - 1)
