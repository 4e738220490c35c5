"""Target adapter: logits and the final hidden state from one forward of an mlx-lm model.

mlx-lm's decoder-only models (llama, mistral, qwen2, qwen3, ...) are `Model(model=Backbone,
lm_head | tied embeddings)`, and `Backbone.__call__` returns the hidden state *after* the final
norm. So `hidden = model.model(x, cache)` and `logits = lm_head(hidden)` reproduce `model(x)`
exactly, without forking mlx-lm's model files. The hidden convention for drafters is therefore
"after the final norm". `Target.check()` proves the identity on a real forward at load time, so
a family whose `__call__` adds something (logit soft-capping, scaling) is refused, not
silently wrong.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from gmlx.errors import ModelLoadError


class Target:
    """A thin view over an mlx-lm model. Graph builder: never syncs."""

    def __init__(self, model: nn.Module):
        backbone = getattr(model, "model", None)
        if backbone is None or not hasattr(backbone, "embed_tokens") or not hasattr(backbone, "layers"):
            raise ModelLoadError(
                f"{type(model).__module__} has no `model.embed_tokens`/`model.layers` backbone; gmlx supports"
                " mlx-lm decoder-only families such as llama, mistral, qwen2 and qwen3"
            )
        self.model = model
        self.backbone = backbone
        self.embed_tokens = backbone.embed_tokens
        self.final_norm = backbone.norm
        args = getattr(model, "args", None)
        tied = getattr(args, "tie_word_embeddings", not hasattr(model, "lm_head"))
        self.lm_head = self.embed_tokens.as_linear if tied or not hasattr(model, "lm_head") else model.lm_head
        self.hidden_size = int(self.embed_tokens.weight.shape[1])
        self.vocab_size = int(self.embed_tokens.weight.shape[0])
        self.num_layers = len(backbone.layers)

    def __call__(self, tokens: mx.array, cache: list) -> tuple[mx.array, mx.array]:
        """tokens [B, L] -> (logits [B, L, V], hidden [B, L, D] after the final norm)."""
        hidden = self.backbone(tokens, cache=cache)
        return self.lm_head(hidden), hidden

    def logits(self, tokens: mx.array, cache: list) -> mx.array:
        """The plain path: exactly mlx-lm's forward."""
        return self.model(tokens, cache=cache)

    def make_cache(self) -> list:
        return make_prompt_cache(self.model)

    def check(self) -> None:
        """Refuse a family whose logits are not lm_head(backbone(x))."""
        x = mx.array([[1, 2, 3]], dtype=mx.int32) % self.vocab_size
        ref = self.model(x)
        ours, _ = self(x, cache=None)
        diff = mx.abs(ref.astype(mx.float32) - ours.astype(mx.float32)).max()
        if diff.item() > 1e-3:  # sync: once, at load time
            raise ModelLoadError(
                f"{type(self.model).__module__}: logits are not lm_head(model.model(x)); this family post-processes"
                " logits and is not supported yet (use --no-speculative with mlx-lm instead)"
            )
