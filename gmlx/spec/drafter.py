"""The MTP drafter's per-sequence state and graph builders (scalar loop).

State at a round boundary, for a sequence x_0..x_{n-1} whose bonus x_{n-1} is pending:
- the head's cache holds entries for positions 0..j-1, each computed from the target's own
  hidden h_i and the next token x_{i+1};
- `pending_hidden` / `pending_tokens` hold (h_i, x_{i+1}) for positions j..n-2: entries known
  but not yet run through the head. The last pending token is the bonus.

Drafting runs the pending entries through the head in one call (teacher forcing, which is
also the head's prefill after the target's prefill); its last output drafts x_n. Further drafts
chain the head on its own hidden state. After verification every speculative head entry is
trimmed (K-1 of them) and the target's hidden states for the accepted tokens become pending,
so the head's cache only ever holds entries computed from the target's hidden states.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from gmlx.models.adapter import Target
from gmlx.models.mtp import MTPHead
from gmlx.sampling import RowSampling, draft_coupled, draft_greedy


@dataclass(slots=True)
class DraftState:
    cache: KVCache
    pending_hidden: mx.array | None = None  # [1, P, D]
    pending_tokens: mx.array | None = None  # [1, P]

    @property
    def can_draft(self) -> bool:
        return self.pending_hidden is not None

    def add_pending(self, hidden: mx.array, tokens: mx.array) -> None:
        """Queue (h_i, x_{i+1}) entries: hidden [1, P, D], tokens [1, P]."""
        if self.pending_hidden is None:
            self.pending_hidden, self.pending_tokens = hidden, tokens
        else:
            self.pending_hidden = mx.concatenate([self.pending_hidden, hidden], axis=1)
            self.pending_tokens = mx.concatenate([self.pending_tokens, tokens], axis=1)


class MTPDrafter:
    """Drafts k tokens for one sequence with an MTP head. Graph builder: never syncs."""

    def __init__(self, head: MTPHead, target: Target):
        self.head = head
        self.target = target

    def new_state(self) -> DraftState:
        return DraftState(cache=KVCache())

    def draft(self, st: DraftState, k: int, rs: RowSampling, first_position: int, coupled: bool) -> mx.array:
        """Build k drafts [1, k] for positions first_position .. first_position+k-1."""
        assert st.can_draft and k >= 1
        embed, norm = self.target.embed_tokens, self.target.final_norm
        g = self.head(embed(st.pending_tokens), st.pending_hidden, norm, cache=st.cache)[:, -1:]  # [1, 1, D]
        st.pending_hidden = st.pending_tokens = None
        drafts = []
        for j in range(k):
            if j:
                g = self.head(embed(drafts[-1]), g, norm, cache=st.cache)
            logits = self.target.lm_head(g)  # [1, 1, V]
            if coupled:
                d = draft_coupled(logits, rs, mx.array([[first_position + j]]))
            else:
                d = draft_greedy(logits)
            drafts.append(d)  # [1, 1]
        return mx.concatenate(drafts, axis=1)

    def rollback(self, st: DraftState, k: int, hidden: mx.array, tokens: mx.array) -> None:
        """After verify: drop the k-1 speculative head entries, queue the accepted ones.

        hidden: the target's hidden at the verified positions that are kept [1, a+1, D];
        tokens: the tokens that follow them (accepted drafts, then the bonus) [1, a+1].
        """
        if k > 1:
            st.cache.trim(k - 1)
        st.add_pending(hidden, tokens)
