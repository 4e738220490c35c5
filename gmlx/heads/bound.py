"""The bound head: what a drafting loop calls, whatever head a model brings.

A *bound* head is a drafter head already tied to its target (the target's embedding and,
where the family shares it, the LM head), so a loop needs nothing else:

    g = head(tokens [B, L] int32, hidden [B, L, D], cache)   -> [B, L, D]
    logits = head.logits(g)                                    -> [B, L, V]
    cache = head.make_cache()                                  (the head's one layer, one sequence)

`hidden[:, i]` is the target's hidden state at position i and `tokens[:, i]` the token that
follows it, so `g[:, i]` drafts the token after that. Drafting k tokens chains the head on its
own output: `head(draft, g[:, -1:], cache)`. `hidden_convention` says which hidden the head
wants from the *target* (`Target(model, hidden_convention=...)` returns it):

- "post_norm": the target's hidden after its final norm (mlx-lm's `model.model(x)`). The
  embedded gmlx head, and DeepSeek-V3 / Qwen3-Next MTP as vLLM, SGLang and Megatron feed them.
- "pre_norm": before the final norm (heads trained on the raw residual stream).

`g` is the head's own hidden; the caller only chains it back in or asks `logits(g)`.
`cache` is one mlx-lm-style KV cache: `mlx_lm.models.cache.KVCache` for one sequence, or
`gmlx.kv.RaggedKVCache` for a batch; the head's layer reads `cache.offset` for RoPE and builds its
mask with `mlx_lm.models.base.create_attention_mask(x, cache)`, so both kinds work unchanged.
Graph builders: a bound head never syncs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import mlx.core as mx
from mlx_lm.models.cache import KVCache


from gmlx.models.adapter import POST_NORM


class BoundHead(ABC):
    """Base of every bound head. Subclasses give `forward` (on embeddings) and `logits`."""

    hidden_convention: str = POST_NORM
    kind: str = "mtp"  # LoadedModel.drafter_kind

    def __init__(self, target):
        self.target = target

    def embed(self, tokens: mx.array) -> mx.array:
        return self.target.embed_tokens(tokens)

    @abstractmethod
    def forward(self, embeds: mx.array, hidden: mx.array, cache) -> mx.array:
        """embeds [B, L, D] of the next tokens, hidden [B, L, D] -> g [B, L, D]."""

    @abstractmethod
    def logits(self, g: mx.array) -> mx.array:
        """g [B, L, D] -> logits [B, L, V]."""

    def make_cache(self):
        return KVCache()

    def __call__(self, tokens: mx.array, hidden: mx.array, cache=None) -> mx.array:
        return self.forward(self.embed(tokens), hidden, cache)
