"""Predicted outputs (OpenAI's `prediction`): a request carries text its answer is expected to
resemble (the previous answer re-asked, the file an edit rewrites), and the drafts are copied from
it where the output currently aligns with it, as speculative edits do. It never changes a token:
the drafts are proposals, and the verify keeps only what the target itself would emit.

One wrapper serves every engine: `PredictionDrafter(inner)` wraps the engine's own drafter (the MTP
head, prompt lookup, the assistant head, a draft model; None for `--drafter prediction` alone).
Rows without a prediction draft exactly as the inner drafter would (the wrapper then only
forwards), but for the lone request's rounds where its own context drafts instead
(gmlx/drafters/context_lookup.py). A row with one drafts, per round (where its output stands
against the prediction: gmlx/drafters/alignment.py):

- **aligned** (its last verified token was the prediction's next token, or a suffix lookup
  re-aligned it): the prediction's next tokens from the alignment pointer, up to `k_max` (longer
  than the model drafter's K: they cost no drafter work, and an exact prediction is accepted
  whole), never more than its budget can use; after a round whose prediction drafts were
  rejected, only what was accepted plus one, doubling again after each fully accepted round;
- **not aligned** (the output departed from the prediction: an edit): the inner drafter's drafts,
  until a suffix of the output (N_MAX down to N_MIN tokens) is found in the prediction again,
  preferring the first occurrence at or after the pointer (an edit moves forward), else the
  nearest before it; a one-token suffix counts only within WINDOW_1 tokens after the pointer.

Combining per row needs an inner drafter whose state does not depend on its own draft values
(`Drafter.drafts_replaceable`: MTP head, ngram, assistant): its drafts are replaced by the
prediction's on the device (no sync) for the rows that have one, and its `commit` reads only the
verified tokens. When every drafting row has a prediction's drafts, the inner drafter is not run
that round (its commit then gets k = 0: a round it did not draft for). A draft model keeps its own
drafted tokens in its KV, so with one the prediction is used only in rounds where every row has a
prediction's drafts; otherwise the draft model drafts for all rows.

Counts, per request (RequestStats; serve reports them as OpenAI's
`usage.completion_tokens_details`): `accepted_prediction_tokens` = verified output tokens that were
the aligned prediction's next token (drafted from it, or the round's own token where it equalled
it); `rejected_prediction_tokens` = tokens drafted from the prediction that the verify rejected
(the work a wrong prediction cost). Rounds that did not speculate (a gated batch) do not count.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from gmlx.drafters.alignment import K_MAX, Alignment, alignment
from gmlx.drafters.base import DraftPick, Drafter, pad_to
from gmlx.drafters.context_lookup import ContextLookup


@dataclass(slots=True)
class PredictionRows:
    inner: object | None  # the inner drafter's state (None without one)
    rows: list[Alignment | None]
    any: bool  # some row has a prediction (False: the wrapper only forwards)
    context: object | None = None  # a lone row's own context (gmlx/drafters/context_lookup.py), or None
    lengths: np.ndarray | None = None  # the last draft's per-row lengths (None: the inner's)
    inner_k: int = 0  # the k the inner drafter drafted in the last draft (0: it was not run)
    foreign: bool = False  # the last draft was the row's context's, not the inner drafter's


class PredictionDrafter(Drafter):
    """The engine's drafter with predicted outputs (see the module docstring). Reads of anything
    it does not define go to the inner drafter (its head, its path, ...), as do writes."""

    _OWN = frozenset({"inner", "k_max", "lookup"})

    def __init__(self, inner: Drafter | None = None, k_max: int = K_MAX):
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "k_max", k_max)
        # the lone request's drafts from its own context, beside an inner drafter they may replace
        replaceable = inner is not None and inner.drafts_replaceable and inner.kind != "ngram"
        object.__setattr__(self, "lookup", ContextLookup() if replaceable else None)

    def __getattr__(self, name):
        inner = self.__dict__.get("inner")
        if inner is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(inner, name)

    def __setattr__(self, name, value):
        if name in self._OWN or self.inner is None:
            object.__setattr__(self, name, value)
        else:
            setattr(self.inner, name, value)

    # capabilities: the inner drafter's (prediction alone: host only, any width)
    @property
    def kind(self) -> str:
        return self.inner.kind if self.inner is not None else "prediction"

    @property
    def needs_hidden(self) -> bool:
        return self.inner is not None and self.inner.needs_hidden

    @property
    def shares_kv(self) -> bool:
        return self.inner is not None and self.inner.shares_kv

    @property
    def max_width(self):
        return self.inner.max_width if self.inner is not None else None

    @property
    def step_cost(self) -> float:
        return self.inner.step_cost if self.inner is not None else 0.0

    @property
    def drafts_replaceable(self) -> bool:
        return self.inner is None or self.inner.drafts_replaceable

    @property
    def replays(self) -> bool:
        return self.inner is not None and self.inner.replays

    @property
    def batch_replays(self) -> bool:
        return self.inner is not None and self.inner.batch_replays

    # ---- the protocol ------------------------------------------------------------------------
    def _state(self, inner, rows: list[Alignment | None], context=None) -> PredictionRows:
        return PredictionRows(inner, rows, any(a is not None for a in rows), context)

    def start(self, rows, pres) -> PredictionRows:
        inner = self.inner.start(rows, pres) if self.inner is not None else None
        # (a one-row state only: the lone request's; a batch never drafts from its rows' contexts)
        context = self.lookup.start(rows[0]) if self.lookup is not None and len(rows) == 1 else None
        return self._state(inner, [alignment(r, list(getattr(r, "tokens", ()))) for r in rows], context)

    def capture(self, rows, hidden, targets) -> PredictionRows:
        inner = self.inner.capture(rows, hidden, targets) if self.inner is not None else None
        aligned = [None] * len(rows)
        if any(getattr(getattr(r, "params", None), "prediction", None) for r in rows):
            verified = np.array(targets)  # sync: none in practice, the capture round's tokens were read already
            aligned = [alignment(r, list(r.tokens) + [int(t[0])]) for r, t in zip(rows, verified)]
        return self._state(inner, aligned)

    def merge(self, a: PredictionRows, b: PredictionRows) -> PredictionRows:
        inner = self.inner.merge(a.inner, b.inner) if self.inner is not None else None
        return self._state(inner, a.rows + b.rows)

    def filter(self, st: PredictionRows, keep: list[int]) -> PredictionRows:
        inner = self.inner.filter(st.inner, keep) if self.inner is not None else None
        return self._state(inner, [st.rows[i] for i in keep], st.context if keep == [0] else None)

    def width(self, st: PredictionRows) -> int:
        return len(st.rows)

    def draft(self, st: PredictionRows, k: int, pick: DraftPick, target_cache: list) -> mx.array:
        if pick is not None and pick.context and st.context is not None and not st.any:
            if own := self.lookup.propose(st.context, pick.context):  # the lone request's context drafts this round
                st.lengths, st.inner_k, st.foreign = np.array([len(own)], dtype=np.int64), 0, True
                return mx.array([own], dtype=mx.int32)
        if not st.any:  # nothing to add: exactly the inner drafter
            st.lengths, st.inner_k = None, k
            return self.inner.draft(st.inner, k, pick, target_cache)
        b = len(st.rows)
        props = [a.propose(self.k_max) if a is not None else [] for a in st.rows]
        lengths = np.array([len(p) for p in props], dtype=np.int64)
        width = max(k, int(lengths.max()))
        host = np.zeros((b, width), dtype=np.int32)
        for i, p in enumerate(props):
            host[i, :len(p)] = p
        st.inner_k = 0
        drafts = mx.array(host)
        if self.inner is not None and not lengths.all():  # some row needs the inner drafter's drafts
            inner = self.inner.draft(st.inner, k, pick, target_cache)
            inner_lengths = self.inner.draft_lengths(st.inner)
            inner_lengths = np.full(b, k, dtype=np.int64) if inner_lengths is None else inner_lengths
            st.inner_k = k
            if not self.inner.drafts_replaceable:  # its state holds its own drafts: they are the round's
                props, lengths, drafts = [[]] * b, inner_lengths, inner
            else:
                mine = mx.array((lengths > 0)[:, None])
                drafts = mx.where(mine, drafts, pad_to(inner, width))
                lengths = np.where(lengths > 0, lengths, inner_lengths)
        for a, p in zip(st.rows, props):
            if a is not None:
                a.drafted = len(p)
        st.lengths = lengths
        return drafts

    def draft_lengths(self, st: PredictionRows) -> np.ndarray | None:
        if st.lengths is None:
            return self.inner.draft_lengths(st.inner) if self.inner is not None else None
        return st.lengths

    def rearms(self, st: PredictionRows) -> bool:
        """Not with a prediction (its commit counts accepted prediction tokens: plain steps are none)."""
        return not st.any and self.inner is not None and self.inner.rearms(st.inner)

    def replay(self, st: PredictionRows, rs, last_position: int):
        """The inner drafter's (a re-armable row: no prediction, `rearms`)."""
        return None if st.any or self.inner is None else self.inner.replay(st.inner, rs, last_position)

    def replay_rows(self, st: PredictionRows):
        """The inner drafter's (a gated batch keeps shadow rounds only where no row has a prediction)."""
        return None if st.any or self.inner is None else self.inner.replay_rows(st.inner)

    def foreign(self, st: PredictionRows) -> bool:
        return st.foreign

    def context_recurs(self, st: PredictionRows, emitted: list[int] | None = None) -> bool:
        return st.context is not None and not st.any and self.lookup.recurs(st.context, emitted)

    def commit(self, st: PredictionRows, k: int, accepted: np.ndarray, hidden, targets) -> None:
        if self.inner is not None:
            # the inner drafter rolls back what it drafted itself (k = 0: it did not draft this round)
            self.inner.commit(st.inner, st.inner_k if st.any or st.foreign else k, accepted, hidden, targets)
        if st.context is not None:
            self.lookup.commit(st.context, accepted, targets)
        if st.any:
            verified = np.array(targets)  # sync: none in practice, the round's tokens were read already
            for a, t, n in zip(st.rows, verified, accepted):
                if a is None:
                    continue
                n = int(n)
                if a.drafted and a.stats is not None:
                    a.stats.rejected_prediction_tokens += a.drafted - min(n, a.drafted)
                a.verified(n, self.k_max)
                a.advance(t[:n + 1], count=True)
        for a in st.rows:
            if a is not None:
                a.drafted = 0
        st.lengths, st.inner_k, st.foreign = None, 0, False
