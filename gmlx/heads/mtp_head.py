"""MTP (multi-token prediction) head: DeepSeek-V3 / Qwen-native style.

    g = layer(fc(concat(embed_norm(E[t+1]), hidden_norm(h_t))))      (own KV cache)
    h' = final_norm(g);   logits = lm_head(h')                         (shared with target)

`h_t` is the target's hidden state *after* its final norm at position t (the
convention of our adapter, see `gmlx.models.adapter`), and `t+1` is the token that
follows t. The head therefore predicts token t+2. Its own output `h'` uses the same
convention, so drafting k tokens chains the head on its own hidden state.

The head owns no embedding, final norm or LM head: the target's are passed in at
call time, so the weights are shared and saved once. `head.bind(target)` ties them together
behind the bound-head interface (`gmlx.heads.bound`) that drafting loops call.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama
from mlx_lm.models.base import create_attention_mask

from gmlx.heads.bound import BoundHead
from gmlx.models.adapter import POST_NORM


@dataclass(frozen=True)
class MTPConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 1024

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "MTPConfig":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})

    def layer_args(self) -> llama.ModelArgs:
        return llama.ModelArgs(
            model_type="llama",
            hidden_size=self.hidden_size,
            num_hidden_layers=1,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            rms_norm_eps=self.rms_norm_eps,
            vocab_size=1,
            rope_theta=self.rope_theta,
            max_position_embeddings=self.max_position_embeddings,
        )


class MTPHead(nn.Module):
    def __init__(self, config: MTPConfig):
        super().__init__()
        self.config = config
        d = config.hidden_size
        self.embed_norm = nn.RMSNorm(d, eps=config.rms_norm_eps)
        self.hidden_norm = nn.RMSNorm(d, eps=config.rms_norm_eps)
        self.fc = nn.Linear(2 * d, d, bias=False)
        self.layer = llama.TransformerBlock(config.layer_args())

    def __call__(self, embeds: mx.array, hidden: mx.array, final_norm: nn.Module, cache=None) -> mx.array:
        """embeds: [B, L, D] target embeddings of the *next* tokens; hidden: [B, L, D].

        Returns the head's hidden state [B, L, D] after the shared final norm.
        """
        x = self.fc(mx.concatenate([self.embed_norm(embeds), self.hidden_norm(hidden)], axis=-1))
        mask = create_attention_mask(x, cache)
        return final_norm(self.layer(x, mask, cache=cache))

    def bind(self, target) -> "BoundMTPHead":
        return BoundMTPHead(self, target)


class BoundMTPHead(BoundHead):
    """The embedded gmlx head behind the bound interface: post-norm in and out, the target's
    final norm and LM head. `__call__(tokens, hidden, cache)`; the module stays at `.module`."""

    hidden_convention = POST_NORM
    kind = "mtp"

    def __init__(self, head: MTPHead, target):
        super().__init__(target)
        self.module = head

    def forward(self, embeds: mx.array, hidden: mx.array, cache) -> mx.array:
        return self.module(embeds, hidden, self.target.final_norm, cache=cache)

    def logits(self, g: mx.array) -> mx.array:
        return self.target.lm_head(g)
