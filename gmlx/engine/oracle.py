"""The reference decode and the stream oracle: one request decoded alone in this thread (the
scalar lane, no engine thread), and the tie-aware comparison of two streams (docs/design.md §3).
`gmlx bench --verify`, `gmlx.serve.loadgen` and the tests check the engine's streams with it."""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from gmlx.engine import intake
from gmlx.config import SamplingParams
from gmlx.models.loading import LoadedModel
from gmlx.row import Row
from gmlx.sampling import RowSampling, filter_logprobs, gumbel_noise
from gmlx.drafters.base import Drafter
from gmlx.drafters.select import select_drafter
from gmlx.decode.scalar import ScalarLane


def make_row(lm: LoadedModel, prompt: list[int], params: SamplingParams, eos_ids=None) -> Row:
    """A validated row as the engine would make it, with the stop-token set optionally replaced."""
    row = intake.make_row(lm, list(prompt), params)
    row.rid = 0
    if eos_ids is not None:
        row.eos_ids = frozenset(eos_ids)
    return row


def run_scalar(lm: LoadedModel, prompt: list[int], params: SamplingParams, *, k: int = 3,
               speculative: bool = True, eos_ids=None, drafter: Drafter | None = None) -> Row:
    """Decode one request to the end in this thread, through the scalar loop or plain decode
    (the drafter: the given one, else the model's default)."""
    row = make_row(lm, prompt, params, eos_ids)
    if speculative:
        drafter = drafter or select_drafter(lm)
    # Speculative runs really speculate (the oracle tests exercise that path, at any cost).
    return decode_alone(ScalarLane(lm.target, drafter if speculative else None, k, may_go_plain=False), row)


def decode_alone(lane: ScalarLane, row: Row) -> Row:
    """Run one row through a scalar lane to its end, in this thread."""
    lane.start(row)
    while not row.is_done:
        row.take(lane.round(), time.perf_counter())
    lane.clear()
    return row


@dataclass(frozen=True)
class Comparison:
    equal: bool  # identical streams
    tie: bool  # they differ, at a position where the target's top-2 margin is below tolerance
    position: int | None = None
    margin: float | None = None

    @property
    def ok(self) -> bool:
        return self.equal or self.tie


def decision_scores(lm: LoadedModel, context: list[int], params: SamplingParams,
                    prompt_len: int | None = None) -> np.ndarray:
    """The values the sampler takes the argmax of at the position after `context` (full forward;
    logits processors applied as the engine does, `prompt_len` of the context being the prompt)."""
    logits, _ = lm.target(mx.array([context], dtype=mx.int32), cache=None)
    rs = RowSampling.from_params([params], [params.seed])
    last = processed_last(lm, logits[:, -1:], context, params, rs, prompt_len).astype(mx.float32)  # [1, 1, V]
    if params.temperature == 0:
        return np.array(last[0, 0])
    lp = filter_logprobs(last - mx.logsumexp(last, axis=-1, keepdims=True), rs)
    noise = gumbel_noise(rs.seeds, mx.array([[len(context)]]), last.shape[-1])
    return np.array((lp / params.temperature + noise)[0, 0])


def processed_last(lm: LoadedModel, last: mx.array, context: list[int], params: SamplingParams, rs: RowSampling,
                   prompt_len: int | None = None) -> mx.array:
    """The logits [1, 1, V] after `context` through the request's logits processors (if any)."""
    from types import SimpleNamespace

    from gmlx.processors import processed

    n = len(context) if prompt_len is None else prompt_len
    eos = frozenset() if params.ignore_eos else frozenset(lm.eos_ids)
    row = SimpleNamespace(rid=0, prompt=list(context[:n]), tokens=list(context[n:]), eos_ids=eos)
    return processed(last, rs, [row], [len(context)])


def compare_streams(lm: LoadedModel, prompt: list[int], ref: list[int], got: list[int],
                    params: SamplingParams, tol: float = 1e-3) -> Comparison:
    """Exact comparison, except a divergence where the target's top-2 margin is below `tol`."""
    if ref == got:
        return Comparison(equal=True, tie=False)
    i = next((j for j, (x, y) in enumerate(zip(ref, got)) if x != y), min(len(ref), len(got)))
    scores = decision_scores(lm, list(prompt) + list(ref[:i]), params.validated(), len(prompt))
    top2 = np.sort(scores[np.isfinite(scores)])[-2:]
    margin = float(top2[-1] - top2[0]) if top2.size == 2 else float("inf")
    return Comparison(equal=False, tie=margin < tol, position=i, margin=margin)
