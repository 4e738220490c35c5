"""The acceptance rule, once, for both lanes (what a round hands back to emission: gmlx.row.RoundResult).

A verify forward of [bonus, d_n..d_{n+k-1}] samples the target's own tokens t_n..t_{n+k} at
their absolute positions (position-keyed noise, gmlx.sampling). Row b accepts

    a_b = max{i : d_{n+j} == t_{n+j} for all j < i}          (accept iff equal)

and emits t_n..t_{n+a_b}: the a_b accepted drafts, which equal the target's tokens, then the
bonus t_{n+a_b}. Every emitted token is the target's own sample, so the stream is exactly the
plain stream whatever the drafter proposed; the k - a_b rejected positions are trimmed from the
row's KV. A FAULT target (-1) never equals a draft, so acceptance stops there.
"""

from __future__ import annotations

import numpy as np

from gmlx.row import RoundResult


def accepted_counts(drafts: np.ndarray, targets: np.ndarray, lengths: np.ndarray | None = None) -> np.ndarray:
    """Leading matches per row: drafts [B, k], targets [B, k+1] -> [B] int64; a row that
    drafted only lengths[b] tokens (the rest padding) accepts at most that many."""
    k = drafts.shape[1]
    matches = np.cumprod(drafts == targets[:, :k], axis=1).sum(axis=1)
    return matches if lengths is None else np.minimum(matches, lengths)


def verified(drafts: np.ndarray, targets: np.ndarray,
             lengths: np.ndarray | None = None) -> tuple[np.ndarray, list[RoundResult]]:
    """The accepted counts and each row's emitted tokens: the accepted drafts, then the bonus."""
    k = drafts.shape[1]
    accepted = accepted_counts(drafts, targets, lengths)
    rows = targets.tolist()  # sync: none, numpy data already on the host
    counts = accepted.tolist()  # sync: none, numpy data
    drafted = [k] * len(rows) if lengths is None else lengths.tolist()  # sync: none, numpy data
    return accepted, [RoundResult(tokens=t[: a + 1], drafted=d, accepted=a) for t, a, d in zip(rows, counts, drafted)]
