"""MTP-head drafter: a head with its own one-layer KV cache, fed the target's hidden states.

State per row at a round boundary: the head's cache holds entries for positions 0..j-1, each
computed from the target's own hidden h_i and the next token x_{i+1}; the pending (h_i, x_{i+1})
entries for j..n-2 are queued (the last pending token is the bonus). Drafting runs the pending
entries through the head in one call (teacher forcing, which is also the head's prefill) and its
last output drafts x_n; further drafts chain the head on its own hidden state. After a verify,
every speculative head entry is trimmed (k-1 of them) and the target's hidden states for the
kept positions become pending, so the head's cache only ever holds entries computed from the
target's hidden states.

The head is used through the bound-head interface: `head(tokens, hidden, cache) -> g` (g in the
head's hidden convention, chained back in), `head.logits(g)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from gmlx.kv import RaggedKVCache
from gmlx.model_cache import extend_rows, filter_rows, trim_rows
from gmlx.drafters.base import DraftPick, Drafter, concat_rows, ragged_append, take_rows_at
from gmlx.sampling import draft_coupled, draft_greedy


@dataclass(slots=True)
class MTPRows:
    cache: RaggedKVCache  # the head's one layer
    hidden: mx.array | None  # [B, P, D] pending target hidden states, right-padded
    tokens: mx.array | None  # [B, P] the tokens that follow them
    lengths: np.ndarray  # [B] real pending entries per row


class MTPDrafter(Drafter):
    kind = "mtp"
    needs_hidden = True
    step_cost = 0.08  # MODEL_CARD.md: head step / target step 0.10 at batch 1
    drafts_replaceable = True  # commit: the verified tokens (and hidden states) only
    replays = True  # the lane's shadow rounds: `replay`
    batch_replays = True  # a gated batch's shadow rounds: `replay_rows`

    def __init__(self, head, d_model: int):
        self.head = head
        self.d_model = d_model

    def start(self, rows, pres) -> MTPRows:
        hs, ts, lens = [], [], []
        for pre in pres:
            if pre.hidden is None:  # nothing to teacher-force (one-token prompt): garbage drafts, still safe
                hs.append(mx.zeros((1, 1, self.d_model)))
                ts.append(mx.zeros((1, 1), dtype=mx.int32))
                lens.append(0)
            else:
                hs.append(pre.hidden)
                ts.append(pre.next_tokens)
                lens.append(pre.hidden.shape[1])
        return MTPRows(RaggedKVCache(len(pres)), concat_rows(hs), concat_rows(ts), np.array(lens, dtype=np.int64))

    def merge(self, a: MTPRows, b: MTPRows) -> MTPRows:
        # a's rows before the extend: with nothing pending (a replay consumed it) a's padding is a's
        n = a.cache.batch_size
        ha = a.hidden if a.hidden is not None else mx.zeros((n, 1, self.d_model))
        ta = a.tokens if a.tokens is not None else mx.zeros((n, 1), dtype=mx.int32)
        extend_rows([a.cache], [b.cache])
        return MTPRows(a.cache, concat_rows([ha, b.hidden]), concat_rows([ta, b.tokens]),
                       np.concatenate([a.lengths, b.lengths]))

    def filter(self, st: MTPRows, keep: list[int]) -> MTPRows:
        filter_rows([st.cache], keep)
        idx = mx.array(keep, dtype=mx.int32)
        hidden = st.hidden[idx] if st.hidden is not None else None
        tokens = st.tokens[idx] if st.tokens is not None else None
        return MTPRows(st.cache, hidden, tokens, st.lengths[keep])

    def width(self, st: MTPRows) -> int:
        return st.cache.batch_size


    def _absorb(self, st: MTPRows) -> mx.array:
        """Run the pending entries through the head (teacher forcing: each output is what the
        head's first draft would be after that entry); the head's cache then holds them."""
        assert st.hidden is not None
        p = st.hidden.shape[1]
        out = self.head(st.tokens, st.hidden, st.cache)  # [B, P, D]
        trim_rows([st.cache], p - st.lengths)  # drop the right padding's entries
        st.hidden = st.tokens = None
        return out

    def draft(self, st: MTPRows, k: int, pick: DraftPick, target_cache: list) -> mx.array:
        assert k >= 1
        lengths = st.lengths
        g = take_rows_at(self._absorb(st), np.maximum(lengths - 1, 0))  # [B, 1, D]
        st.lengths = np.zeros_like(lengths)
        drafts = [pick(self.head.logits(g), 0)]  # [B, 1]
        for j in range(1, k):
            g = self.head(drafts[-1], g, st.cache)
            drafts.append(pick(self.head.logits(g), j))
        return mx.concatenate(drafts, axis=1)

    def commit(self, st: MTPRows, k: int, accepted: np.ndarray, hidden: mx.array, targets: mx.array) -> None:
        if k > 1:
            trim_rows([st.cache], np.full(len(accepted), k - 1))
        p = int(accepted.max()) + 1
        old = st.lengths
        st.hidden, st.lengths = ragged_append(st.hidden, old, hidden[:, :p], accepted + 1)
        st.tokens, _ = ragged_append(st.tokens, old, targets[:, :p], accepted + 1)

    def _replayed(self, st: MTPRows) -> tuple[mx.array, np.ndarray] | None:
        """The head's output after each pending entry [B, P, D] (right-padded) and each row's count
        of entries, consumed (teacher forcing, as `draft` runs them); None when nothing is pending."""
        if st.hidden is None or not st.lengths.any():
            return None
        n = st.lengths.copy()
        out = self._absorb(st)
        st.lengths = np.zeros_like(n)
        return out, n

    def replay(self, st: MTPRows, rs, last_position: int) -> mx.array | None:
        """(one row) The first draft each pending entry would have proposed, [1, P]: the last one's
        at `last_position`, drafted as a round's first draft is (coupled with `rs`'s noise)."""
        replayed = self._replayed(st)
        if replayed is None:
            return None
        out, n = replayed[0], int(replayed[1][0])
        return draft_coupled(self.head.logits(out[:, :n]), rs, np.array([last_position - n + 1]))

    def replay_rows(self, st: MTPRows) -> tuple[mx.array, np.ndarray] | None:
        """(every row) The first draft each pending entry would have proposed, greedy as a batch's
        drafts are: [B, P] right-padded, and each row's count of entries (consumed)."""
        replayed = self._replayed(st)
        return None if replayed is None else (draft_greedy(self.head.logits(replayed[0])), replayed[1])

    def capture(self, rows, hidden: mx.array, targets: mx.array) -> MTPRows:
        b = hidden.shape[0]
        return MTPRows(RaggedKVCache(b), hidden, targets, np.ones(b, dtype=np.int64))
