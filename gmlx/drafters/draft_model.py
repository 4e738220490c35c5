"""Draft-model drafter: a separate small mlx-lm model with the target's tokenizer, on its own
ragged KV (one RaggedKVCache per draft layer), batch-capable, rolled back per row.

State per row at a round boundary: the draft cache holds x_0..x_{c-1}; `tokens` holds the
tokens not yet fed (x_c..x_{n-1}; the last is the bonus). Drafting feeds them right-padded in
one forward (the padding's entries are trimmed per row), samples d_n from the last real
position, then feeds each draft to get the next: after k drafts the cache also holds
d_n..d_{n+k-2} (the last draft is never fed). After a verify that accepted a_b drafts, row b
keeps min(a_b, k-1) fed drafts (they equal the target's tokens) and trims the rest; the kept
tokens not yet fed (the last accepted draft when a_b = k, then the bonus) become pending.

Prefill: the draft model sees every prompt in full (it shares nothing with the target's prompt
cache); re-arming after a gate (capture) prefills it again on each row's whole sequence, which
costs one draft forward over the sequence (the draft model is small; the alternative, keeping
its cache in step through gated rounds, would tax every plain round).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from gmlx.kv import RaggedKVCache
from gmlx.model_cache import extend_rows, filter_rows, make_ragged_cache, reach, trim_rows
from gmlx.models.adapter import Target
from gmlx.drafters.base import DraftPick, Drafter, concat_rows, ragged_append, take_rows_at
from gmlx.models.forward import prefill


@dataclass(slots=True)
class DraftModelRows:
    cache: list[RaggedKVCache]  # one per draft-model layer
    tokens: mx.array | None  # [B, P] pending tokens, right-padded
    lengths: np.ndarray  # [B] real pending tokens per row


class DraftModelDrafter(Drafter):
    kind = "draft"
    needs_hidden = False

    def __init__(self, model: Target, step_cost: float = 0.3, prefill_step: int = 512, path=None):
        self.model = model
        self.path = path  # the draft model's directory (calibrated caps are keyed by it)
        self.step_cost = step_cost
        self.prefill_step = prefill_step

    def _prefilled(self, seqs: list[list[int]]) -> DraftModelRows:
        """Feed each sequence but its last token; the last one is pending."""
        bodies = [s[:-1] for s in seqs]
        cache = make_ragged_cache(self.model.model, len(seqs))
        prefill(self.model, cache, bodies, self.prefill_step, want_hidden=False)
        longest = max(len(b) for b in bodies)
        trim_rows(cache, [longest - len(b) for b in bodies])
        tokens = mx.array([[s[-1]] for s in seqs], dtype=mx.int32)
        return DraftModelRows(cache, tokens, np.ones(len(seqs), dtype=np.int64))

    def start(self, rows, pres) -> DraftModelRows:
        return self._prefilled([list(r.prompt) for r in rows])

    def merge(self, a: DraftModelRows, b: DraftModelRows) -> DraftModelRows:
        extend_rows(a.cache, b.cache)
        ta = a.tokens if a.tokens is not None else mx.zeros((a.cache[0].batch_size, 1), dtype=mx.int32)
        return DraftModelRows(a.cache, concat_rows([ta, b.tokens]), np.concatenate([a.lengths, b.lengths]))

    def filter(self, st: DraftModelRows, keep: list[int]) -> DraftModelRows:
        filter_rows(st.cache, keep)
        tokens = st.tokens[mx.array(keep, dtype=mx.int32)] if st.tokens is not None else None
        return DraftModelRows(st.cache, tokens, st.lengths[keep])

    def width(self, st: DraftModelRows) -> int:
        return st.cache[0].batch_size


    def draft(self, st: DraftModelRows, k: int, pick: DraftPick, target_cache: list) -> mx.array:
        assert k >= 1 and st.tokens is not None
        reach(st.cache, k)  # a hybrid draft model: its k-1 draft steps stay reachable by commit's trim
        p = st.tokens.shape[1]
        logits = self.model.logits(st.tokens, st.cache)  # [B, P, V]
        if (st.lengths == p).all():  # no padding (always so in the scalar loop): the last column
            last = logits[:, -1:]
        else:
            trim_rows(st.cache, p - st.lengths)  # drop the right padding's entries
            last = take_rows_at(logits, np.maximum(st.lengths - 1, 0))  # [B, 1, V]
        st.tokens = None
        st.lengths = np.zeros_like(st.lengths)
        drafts = [pick(last, 0)]
        for j in range(1, k):
            drafts.append(pick(self.model.logits(drafts[-1], st.cache), j))
        return mx.concatenate(drafts, axis=1)

    def commit(self, st: DraftModelRows, k: int, accepted: np.ndarray, hidden, targets: mx.array) -> None:
        fed = max(k - 1, 0)
        kept = np.minimum(accepted, fed)
        if fed:
            trim_rows(st.cache, fed - kept)
        # pending: targets[b, kept_b : accepted_b + 1] (1 or 2 tokens), left-aligned per row
        new, n = ragged_append(None, np.zeros_like(kept), _shift_rows(targets, kept), accepted + 1 - kept)
        st.tokens, st.lengths = ragged_append(st.tokens, st.lengths, new, n)

    def capture(self, rows, hidden, targets: mx.array) -> DraftModelRows:
        st = self._prefilled([list(r.prompt) + list(r.tokens) for r in rows])
        st.tokens, st.lengths = ragged_append(st.tokens, st.lengths, targets, np.ones(len(rows), dtype=np.int64))
        return st


def _shift_rows(x: mx.array, start: np.ndarray) -> mx.array:
    """Row b of x [B, L] shifted left by start[b] (the tail is padding)."""
    if not start.any():
        return x
    cols = np.clip(start[:, None] + np.arange(x.shape[1])[None, :], 0, x.shape[1] - 1).astype(np.int32)
    return mx.take_along_axis(x, mx.array(cols), axis=1)
