"""KV-sharing assistant drafter: a one-layer head that keeps no KV of its own and attends to the
target's cached K/V of one layer (docs/design.md §1, capture round).

State per row at a round boundary: only (h_{n-2}, x_{n-1}), the target's hidden at the last
cached position and the bonus after it. The target's cache holds x_0..x_{n-2}, so the assistant's
query for the bonus sits at position n-1 and attends keys 0..n-2: exactly the target cache's
per-row length. Chained drafts move the query on by one position each and attend the same keys
(nothing is written). Nothing needs rolling back: the verify forward writes the target's K/V and
the loop trims it per row; `commit` only keeps the hidden at the last kept position and the new
bonus. The capture round provides both (its verify writes the bonus's K/V and returns its
hidden); an admission's rows bring theirs from the prefill, and their K/V joins the shared cache
when the ragged target cache is merged.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from gmlx.compiled import compiled
from gmlx.models.adapter import Target
from gmlx.drafters.base import DraftPick, Drafter, take_rows_at


@dataclass(slots=True)
class AssistantRows:
    hidden: mx.array  # [B, 1, D] target hidden at each row's last cached position
    tokens: mx.array  # [B, 1] the bonus


def shared_kv(layer_cache) -> tuple[mx.array | None, mx.array | None, np.ndarray]:
    """(keys, values, per-row lengths) of one target layer, for a ragged batch cache or one
    sequence's mlx-lm KVCache. Keys are already rotated by the target's RoPE."""
    if hasattr(layer_cache, "lengths"):
        lengths = layer_cache.lengths
        t = int(lengths.max()) if len(lengths) else 0
    else:
        t = int(layer_cache.offset)
        lengths = np.array([t], dtype=np.int64)
    if layer_cache.keys is None or t == 0:
        return None, None, lengths
    return layer_cache.keys[:, :, :t, :], layer_cache.values[:, :, :t, :], lengths


class AssistantDrafter(Drafter):
    kind = "assistant"
    needs_hidden = True
    shares_kv = True
    step_cost = 0.05
    drafts_replaceable = True  # commit: the verify's hidden state and token at the accepted position

    def __init__(self, head, target: Target):
        self.head = head
        self.target = target
        self.layer = head.config.kv_layer
        # A draft step is ~40 small operations on a one-token row, so on a host-bound device (the
        # CPU backend: ~10 us an operation) its parts with fixed shapes run compiled: the query
        # and the finish (MLP, norms, the LM head) fuse, the attention over the growing keys does
        # not (a new key length would trace again every round). Drafts never reach the stream
        # unverified, so how they are computed cannot move a token. 3 drafts: ~8.5 -> ~4.5 ms here.
        # The modules themselves (dicts of their arrays, read at every call): weights a caller
        # replaces later (load_weights, update) are what the next draft uses.
        weights = [head, target.embed_tokens, target.final_norm,
                   target.lm_head if isinstance(target.lm_head, nn.Module) else []]
        self._query = compiled(lambda tok, g, at: head.query(target.embed_tokens(tok), g, at), inputs=weights)
        self._finish = compiled(self._finish_step, inputs=weights)

    def _finish_step(self, x: mx.array, o: mx.array) -> tuple[mx.array, mx.array]:
        g = self.head.finish(x, o, self.target.final_norm)
        return g, self.target.lm_head(g)

    def start(self, rows, pres) -> AssistantRows:
        hs, ts = [], []
        for row, pre in zip(rows, pres):
            if pre.hidden is None:  # no cached position yet: zero context, garbage drafts, still safe
                hs.append(mx.zeros((1, 1, self.target.hidden_size)))
            else:
                hs.append(pre.hidden[:, -1:])
            ts.append(mx.array([[row.prompt[-1]]], dtype=mx.int32))
        return AssistantRows(mx.concatenate(hs, axis=0), mx.concatenate(ts, axis=0))

    def merge(self, a: AssistantRows, b: AssistantRows) -> AssistantRows:
        return AssistantRows(mx.concatenate([a.hidden, b.hidden]), mx.concatenate([a.tokens, b.tokens]))

    def filter(self, st: AssistantRows, keep: list[int]) -> AssistantRows:
        idx = mx.array(keep, dtype=mx.int32)
        return AssistantRows(st.hidden[idx], st.tokens[idx])

    def width(self, st: AssistantRows) -> int:
        return st.hidden.shape[0]

    def draft(self, st: AssistantRows, k: int, pick: DraftPick, target_cache: list) -> mx.array:
        keys, values, lengths = shared_kv(target_cache[self.layer])
        b = st.hidden.shape[0]
        if keys is None:
            return mx.zeros((b, k), dtype=mx.int32)
        mask = mx.array(np.arange(keys.shape[2])[None, None, None, :] < lengths[:, None, None, None])
        g, tok = st.hidden, st.tokens
        drafts = []
        for j in range(k):
            x, q = self._query(tok, g, mx.array((lengths + j).astype(np.int32)))
            g, logits = self._finish(x, self.head.attend(q, keys, values, mask))
            tok = pick(logits, j)
            drafts.append(tok)
        return mx.concatenate(drafts, axis=1)

    def commit(self, st: AssistantRows, k: int, accepted: np.ndarray, hidden: mx.array, targets: mx.array) -> None:
        st.hidden = take_rows_at(hidden, accepted)
        st.tokens = take_rows_at(targets, accepted)

    def capture(self, rows, hidden: mx.array, targets: mx.array) -> AssistantRows:
        return AssistantRows(hidden, targets)
