"""Predicted outputs (OpenAI's `prediction`): a request carries text its answer is expected to
resemble (the previous answer re-asked, the file an edit rewrites), and the drafts are copied from
it where the output currently aligns with it, as speculative edits do. It never changes a token:
the drafts are proposals, and the verify keeps only what the target itself would emit.

One wrapper serves every engine: `PredictionDrafter(inner)` wraps the engine's own drafter (the MTP
head, prompt lookup, the assistant head, a draft model; None for `--drafter prediction` alone).
Rows without a prediction draft exactly as the inner drafter would (the wrapper then only
forwards). A row with one drafts, per round:

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

from bisect import bisect_left
from dataclasses import dataclass, field
from functools import lru_cache

import mlx.core as mx
import numpy as np

from gmlx.drafters.base import DraftPick, Drafter, pad_to

# The most tokens a row drafts from its prediction per round. Prediction drafts cost no drafter
# work, so the limit is the verify: a wrong draft costs its column. Measured with
# benchmarks/bench_prediction.py (see its results).
K_MAX = 16
N_MAX, N_MIN = 4, 1  # suffix lengths tried when re-aligning, longest first
WINDOW_1 = 8  # a one-token suffix re-aligns only this close after the pointer


@lru_cache(maxsize=64)
def ngram_index(tokens: tuple[int, ...]) -> dict[tuple[int, ...], list[int]]:
    """Each n-gram of the prediction (N_MIN..N_MAX tokens) -> the sorted positions right after
    its occurrences (shared by requests with the same prediction: `n` choices, re-asks)."""
    out: dict[tuple[int, ...], list[int]] = {}
    for n in range(N_MIN, N_MAX + 1):
        for end in range(n, len(tokens) + 1):
            out.setdefault(tokens[end - n:end], []).append(end)
    return out


@dataclass(slots=True)
class Alignment:
    """One row's prediction and where its output stands against it."""

    tokens: tuple[int, ...]
    budget: int  # the request's max_tokens
    stats: object | None  # the row's RequestStats (counts), None for rows without them
    generated: int = 0  # output tokens verified so far (the pending bonus included)
    recent: list[int] = field(default_factory=list)  # the last N_MAX tokens of prompt + output
    pointer: int = 0  # the prediction position the next output token is expected at
    aligned: bool = True  # an empty output is aligned with the prediction's start
    drafted: int = 0  # drafts the last `draft` took from the prediction
    allowance: int = K_MAX  # the most drafts its next round takes from the prediction

    def propose(self, k_max: int) -> list[int]:
        if not self.aligned:
            return []
        n = min(k_max, self.allowance, len(self.tokens) - self.pointer, self.budget - self.generated - 1)
        return list(self.tokens[self.pointer:self.pointer + n]) if n > 0 else []

    def verified(self, accepted: int, k_max: int) -> None:
        """After a round that drafted from the prediction: a whole run accepted doubles the next
        round's allowance (up to k_max); a rejection shrinks it to what was accepted, plus one.
        A prediction that keeps failing (an output that wanders off it) then costs a column or two
        per round, and one that holds again is back at full length within a few rounds."""
        if not self.drafted:
            return
        self.allowance = min(k_max, 2 * self.allowance) if accepted >= self.drafted else accepted + 1

    def advance(self, verified, count: bool) -> None:
        """Walk a round's verified tokens: in step with the prediction while they equal its next
        token; once one departs, re-align from the output's suffix after the walk."""
        accepted = 0
        for tok in verified:
            tok = int(tok)
            self.recent.append(tok)
            self.generated += 1
            if self.aligned and self.pointer < len(self.tokens) and self.tokens[self.pointer] == tok:
                self.pointer += 1
                accepted += 1
            else:
                self.aligned = False
        del self.recent[:-N_MAX]
        if not self.aligned:
            self.realign()
        if count and self.stats is not None:
            self.stats.accepted_prediction_tokens += accepted

    def realign(self) -> None:
        index = ngram_index(self.tokens)
        for n in range(min(N_MAX, len(self.recent)), N_MIN - 1, -1):
            ends = index.get(tuple(self.recent[-n:]))
            if not ends:
                continue
            i = bisect_left(ends, self.pointer)
            if i < len(ends) and (n > 1 or ends[i] - self.pointer <= WINDOW_1):
                end = ends[i]
            elif n > 1 and i > 0:
                end = ends[i - 1]
            else:
                continue
            self.pointer, self.aligned = end, True
            return


def alignment(row, generated: list[int]) -> Alignment | None:
    """A row's alignment after `generated` output tokens (None: the row has no prediction)."""
    params = getattr(row, "params", None)
    tokens = getattr(params, "prediction", None)
    if not tokens or isinstance(tokens, str):  # text is tokenized at intake; a bare Row without it has none
        return None
    a = Alignment(tuple(tokens), params.max_tokens, getattr(row, "stats", None),
                  recent=list(row.prompt[-N_MAX:]))
    if generated:
        a.advance(generated, count=False)
    return a


@dataclass(slots=True)
class PredictionRows:
    inner: object | None  # the inner drafter's state (None without one)
    rows: list[Alignment | None]
    any: bool  # some row has a prediction (False: the wrapper only forwards)
    lengths: np.ndarray | None = None  # the last draft's per-row lengths (None: the inner's)
    inner_k: int = 0  # the k the inner drafter drafted in the last draft (0: it was not run)


class PredictionDrafter(Drafter):
    """The engine's drafter with predicted outputs (see the module docstring). Reads of anything
    it does not define go to the inner drafter (its head, its path, ...), as do writes."""

    _OWN = frozenset({"inner", "k_max"})

    def __init__(self, inner: Drafter | None = None, k_max: int = K_MAX):
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "k_max", k_max)

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
    def _state(self, inner, rows: list[Alignment | None]) -> PredictionRows:
        return PredictionRows(inner, rows, any(a is not None for a in rows))

    def start(self, rows, pres) -> PredictionRows:
        inner = self.inner.start(rows, pres) if self.inner is not None else None
        return self._state(inner, [alignment(r, list(getattr(r, "tokens", ()))) for r in rows])

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
        return self._state(inner, [st.rows[i] for i in keep])

    def width(self, st: PredictionRows) -> int:
        return len(st.rows)

    def draft(self, st: PredictionRows, k: int, pick: DraftPick, target_cache: list) -> mx.array:
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

    def commit(self, st: PredictionRows, k: int, accepted: np.ndarray, hidden, targets) -> None:
        if self.inner is not None:
            # the inner drafter rolls back what it drafted itself (k = 0: it did not draft this round)
            self.inner.commit(st.inner, st.inner_k if st.any else k, accepted, hidden, targets)
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
        st.lengths, st.inner_k = None, 0
