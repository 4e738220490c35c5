"""Token trees from the drafters the scalar lane already has (issue 20, tree verification).

A tree here is a set of P root-to-leaf paths of up to k drafts each, all starting right after the
request's pending bonus (position n): `drafts [P, k]` and, per path, how many of its columns are
real (`lengths [P]`, host data; the rest is padding that is never accepted). Paths that share a
prefix share those tree nodes; the acceptance (gmlx/decode/tree_verify.py) walks them as a tree.

- MTP head (`MTPDrafter` and its subclasses): the head is teacher-forced on the pending entries
  exactly as `MTPDrafter.draft` does; its depth-1 logits give the top-P first tokens (the first
  is the chain's own draft: coupled with the target's noise G(seed, n) at T > 0, greedy at
  T = 0; the others are the next best under the same scores); below depth 1 each branch is a
  chain (coupled / greedy, as the chain drafts) run on a P-row copy of the head's cache, which
  is dropped after drafting. The request's head state therefore ends the draft exactly where
  the chain's would after its trim of the k-1 speculative entries: its commit is called with
  k = 1 (nothing to trim) and the accepted path's hidden states.
- Prompt lookup (`NGramDrafter`): the continuations of the latest occurrence of each suffix
  length n_max..n_min (the chain's draft is the first), distinct ones only.

Graph builders, except the n-gram lookups (host data, as in the chain).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from gmlx.drafters.base import DraftPick, Drafter, take_rows_at
from gmlx.drafters.mtp import MTPDrafter, MTPRows
from gmlx.drafters.ngram import NGramDrafter, NGramRows
from gmlx.drafters.prediction import PredictionDrafter
from gmlx.kv import RaggedKVCache
from gmlx.model_cache import trim_rows
from gmlx.sampling import RowSampling, filter_logprobs, gumbel_noise


def supports(drafter: Drafter | None) -> bool:
    """Whether trees can be drafted from this drafter (else the lane runs its chain)."""
    if isinstance(drafter, PredictionDrafter):
        drafter = drafter.inner
    return isinstance(drafter, (MTPDrafter, NGramDrafter))


def unwrapped(drafter: Drafter, st: object) -> tuple[Drafter, object] | None:
    """The drafter and state trees are drafted from: the engine's PredictionDrafter forwards to
    its inner drafter for a request without a predicted output (with one: None, the chain runs:
    the prediction's own drafts are one path already). Its `commit` forwards the same way."""
    if isinstance(drafter, PredictionDrafter):
        if st.any or drafter.inner is None:
            return None
        drafter, st = drafter.inner, st.inner
    return (drafter, st) if isinstance(drafter, (MTPDrafter, NGramDrafter)) else None


def first_tokens(logits: mx.array, rs: RowSampling, position: int, branches: int) -> tuple[mx.array, mx.array]:
    """The top-`branches` depth-1 tokens [branches] of a one-row drafter's logits [1, 1, V], best
    first under the chain's own draft rule: greedy at T = 0, else the filtered log-probabilities
    / T plus the target's noise G(seed, position) (the chain's coupled draft is the first); and
    the drafter's probability of each (softmax at T; T = 0: at 1), the confidence pruning reads."""
    logits = logits.astype(mx.float32)
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if rs.all_greedy:
        scores = probs = lp
    else:
        lp = filter_logprobs(lp, rs)
        t = rs.temperature[:, None, None]
        probs = lp / mx.where(t > 0, t, 1.0)
        noise = gumbel_noise(rs.seeds, mx.array([[position]], dtype=mx.int32), logits.shape[-1])
        scores = probs + noise
    top = mx.argsort(-scores[0, 0])[:branches].astype(mx.int32)
    p = mx.softmax(probs[0, 0], axis=-1)[top]
    return top, p


class TreeProposer:
    """Drafts a tree of `branches` paths of depth k (fewer paths where the drafter finds fewer).
    `min_q` > 0: confidence pruning, a depth-1 branch other than the first is kept only where the
    drafter gives its token at least that probability (a host read of the depth-1 probabilities
    before the verify is built); a tree pruned to one path is the chain."""

    def __init__(self, min_q: float = 0.0):
        self.min_q = min_q

    def propose(self, drafter: Drafter, st: object, k: int, branches: int, rs: RowSampling,
                rs_rows: RowSampling, position: int) -> tuple[mx.array, np.ndarray]:
        """-> drafts [P, k] int32 and lengths [P] (host data); P <= branches, P >= 1."""
        drafter, st = unwrapped(drafter, st)
        if isinstance(drafter, MTPDrafter):
            return mtp_tree(drafter, st, k, branches, rs, rs_rows, position, self.min_q)
        if isinstance(drafter, NGramDrafter):
            return ngram_tree(drafter, st, k, branches)
        raise TypeError(f"no tree drafting for {type(drafter).__name__}")


def mtp_tree(drafter: MTPDrafter, st: MTPRows, k: int, branches: int, rs: RowSampling,
             rs_rows: RowSampling, position: int, min_q: float = 0.0) -> tuple[mx.array, np.ndarray]:
    assert k >= 1 and st.hidden is not None
    head = drafter.head
    # Teacher forcing on the pending entries: exactly MTPDrafter.draft's first step.
    p = st.hidden.shape[1]
    out = head(st.tokens, st.hidden, st.cache)  # [1, P, D]
    trim_rows([st.cache], p - st.lengths)
    g = take_rows_at(out, np.maximum(st.lengths - 1, 0))  # [1, 1, D]
    st.hidden = st.tokens = None
    st.lengths = np.zeros_like(st.lengths)
    first, q = first_tokens(head.logits(g), rs, position, branches)
    if min_q > 0 and branches > 1:
        keep = np.array(q) >= min_q  # sync: the depth-1 probabilities (the head's first step only)
        keep[0] = True
        first = first[mx.array(np.flatnonzero(keep).astype(np.int32))]
    first = first[:, None]  # [P, 1]
    P = first.shape[0]
    cols = [first]
    if k > 1 and P == 1:  # pruned to one path: the chain's own drafts on the head's cache, trimmed after
        pick = DraftPick(None if rs.all_greedy else rs, np.array([position]))
        for j in range(1, k):
            g = head(cols[-1], g, st.cache)
            cols.append(pick(head.logits(g), j))
        trim_rows([st.cache], np.array([k - 1]))
    elif k > 1:
        # The branches' chains run on a P-row copy of the head's one-layer cache (the request's
        # own cache keeps only the teacher-forced entries, as the chain's does after its trim).
        copy = RaggedKVCache(P)
        n = int(st.cache.lengths[0])
        if st.cache.keys is not None and n:
            copy.keys = mx.repeat(st.cache.keys[:, :, :n], P, axis=0)
            copy.values = mx.repeat(st.cache.values[:, :, :n], P, axis=0)
        copy._set_lengths(np.full(P, n, dtype=np.int64))
        pick = DraftPick(None if rs.all_greedy else rs_rows, np.full(P, position))
        g = mx.broadcast_to(g, (P,) + g.shape[1:])
        for j in range(1, k):
            g = head(cols[-1], g, copy)
            cols.append(pick(head.logits(g), j))
    return mx.concatenate(cols, axis=1), np.full(P, k, dtype=np.int64)


def ngram_tree(drafter: NGramDrafter, st: NGramRows, k: int, branches: int) -> tuple[mx.array, np.ndarray]:
    """Distinct continuations of the latest occurrence of each suffix length, longest first."""
    (ix,) = st.rows
    seq = ix.sync(drafter.n_min, drafter.n_max)
    end = len(seq)
    paths: list[list[int]] = []
    for n in range(min(drafter.n_max, end - 1), drafter.n_min - 1, -1):
        i = ix.after.get(tuple(seq[end - n:]))
        if i is None:
            continue
        d = seq[i:min(i + k, end)]
        if d and d not in paths:
            paths.append(d)
        if len(paths) == branches:
            break
    if not paths:
        st.lengths = np.zeros(1, dtype=np.int64)
        return mx.zeros((1, max(k, 1)), dtype=mx.int32), np.zeros(1, dtype=np.int64)
    width = max(len(d) for d in paths)
    out = np.zeros((len(paths), width), dtype=np.int32)
    for r, d in enumerate(paths):
        out[r, :len(d)] = d
    lengths = np.array([len(d) for d in paths], dtype=np.int64)
    st.lengths = lengths[:1]
    return mx.array(out), lengths
