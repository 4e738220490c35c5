"""KV-sharing assistant head: a one-layer drafter that reads the target's KV cache instead of its own.

For one row, with the target cache holding K/V of positions 0..t, the pending bonus token x_{t+1}
(its K/V not yet in the cache) and h_t (the target's hidden after its final norm, as
`gmlx.models.adapter.Target` returns):

    x   = fc(concat(embed_norm(E[x_{t+1}]), hidden_norm(h_t)))
    x   = x + o_proj(attn(q = rope(q_proj(attn_norm(x)), position t+1), K/V of layer kv_layer, keys 0..t))
    x   = x + mlp(mlp_norm(x))                                  (SwiGLU, as llama)
    g   = final_norm(x);   logits = lm_head(g)                  (the target's, shared)  -> predicts x_{t+2}

Chained drafting feeds (g, draft) in place of (h_t, x_{t+1}) with the query one position further
(t+2), attending to the *same* keys 0..t: the head never writes KV, so a rejected draft leaves
nothing to roll back. Keys arrive already rotated (mlx-lm's attention ropes them before caching),
so only the query is rotated here, with the target's RoPE settings.

The head owns no embedding, final norm or LM head; the target's are passed in or applied by the
caller, as for `gmlx.heads.mtp_head.MTPHead`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from mlx_lm.models.rope_utils import initialize_rope

from gmlx.models.checkpoint import load_beside

CONFIG_FILE = "assistant_config.json"
WEIGHTS_FILE = "assistant_head.safetensors"


@dataclass(frozen=True)
class AssistantConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    kv_layer: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_traditional: bool = False
    rope_scaling: dict | None = None
    max_position_embeddings: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "AssistantConfig":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})

    @classmethod
    def for_target(cls, target_config: dict, intermediate_size: int, kv_layer: int | None = None) -> "AssistantConfig":
        """Copy the attention geometry and RoPE of an mlx-lm llama-style config; kv_layer defaults to the last."""
        args = llama.ModelArgs.from_dict(target_config)
        n_layers = args.num_hidden_layers
        layer = n_layers - 1 if kv_layer is None else kv_layer
        if not 0 <= layer < n_layers:
            raise ValueError(f"kv_layer {layer} outside the target's {n_layers} layers")
        return cls(
            hidden_size=args.hidden_size,
            intermediate_size=intermediate_size,
            num_attention_heads=args.num_attention_heads,
            num_key_value_heads=args.num_key_value_heads,
            head_dim=args.head_dim or args.hidden_size // args.num_attention_heads,
            kv_layer=layer,
            rms_norm_eps=args.rms_norm_eps,
            rope_theta=args.rope_theta,
            rope_traditional=args.rope_traditional,
            rope_scaling=args.rope_scaling,
            max_position_embeddings=args.max_position_embeddings,
        )


class AssistantHead(nn.Module):
    def __init__(self, config: AssistantConfig):
        super().__init__()
        self.config = config
        d, heads, dh = config.hidden_size, config.num_attention_heads, config.head_dim
        self.embed_norm = nn.RMSNorm(d, eps=config.rms_norm_eps)
        self.hidden_norm = nn.RMSNorm(d, eps=config.rms_norm_eps)
        self.fc = nn.Linear(2 * d, d, bias=False)
        self.attn_norm = nn.RMSNorm(d, eps=config.rms_norm_eps)
        self.q_proj = nn.Linear(d, heads * dh, bias=False)
        self.o_proj = nn.Linear(heads * dh, d, bias=False)
        self.mlp_norm = nn.RMSNorm(d, eps=config.rms_norm_eps)
        self.mlp = llama.MLP(_mlp_args(config))
        # The target's own RoPE construction, so positions rotate exactly as its cached keys did.
        self.rope = initialize_rope(dh, config.rope_theta, config.rope_traditional, config.rope_scaling,
                                    config.max_position_embeddings)
        self.scale = dh**-0.5

    def __call__(self, embeds: mx.array, hidden: mx.array, keys: mx.array, values: mx.array,
                 q_offset: mx.array, mask: mx.array, final_norm: nn.Module) -> mx.array:
        """embeds, hidden: [B, L, D]; keys, values: [B, Hkv, T, Dh] of layer kv_layer (keys rotated);
        q_offset: [B] int32, absolute position of each row's first query (query l sits at
        q_offset + l); mask: bool, broadcastable to [B, 1, L, T], True = may attend.
        Returns g [B, L, D] after the shared final norm."""
        x, q = self.query(embeds, hidden, q_offset)
        return self.finish(x, self.attend(q, keys, values, mask), final_norm)

    # The three parts of a step. Only `attend` sees the keys, whose length grows every round: the
    # drafter compiles the other two (gmlx/drafters/assistant.py), whose shapes stay fixed.
    def query(self, embeds: mx.array, hidden: mx.array, q_offset: mx.array) -> tuple[mx.array, mx.array]:
        """(the residual x [B, L, D], the rotated queries [B, H, L, Dh])."""
        B, L, _ = embeds.shape
        x = self.fc(mx.concatenate([self.embed_norm(embeds), self.hidden_norm(hidden)], axis=-1))
        q = self.q_proj(self.attn_norm(x)).reshape(B, L, self.config.num_attention_heads, -1)
        return x, self.rope(q.transpose(0, 2, 1, 3), offset=q_offset)

    def attend(self, q: mx.array, keys: mx.array, values: mx.array, mask: mx.array) -> mx.array:
        # GQA: fast SDPA pairs each KV head with its group of query heads, as the target does.
        return mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask)

    def finish(self, x: mx.array, o: mx.array, final_norm: nn.Module) -> mx.array:
        B, _, L, _ = o.shape
        x = x + self.o_proj(o.transpose(0, 2, 1, 3).reshape(B, L, -1))
        x = x + self.mlp(self.mlp_norm(x))
        return final_norm(x)


def _mlp_args(config: AssistantConfig) -> llama.ModelArgs:
    return llama.ModelArgs(model_type="llama", hidden_size=config.hidden_size, num_hidden_layers=1,
                           intermediate_size=config.intermediate_size, num_attention_heads=config.num_attention_heads,
                           rms_norm_eps=config.rms_norm_eps, vocab_size=1)


def key_mask(lengths, T: int, L: int = 1) -> mx.array:
    """Draft-time mask [B, 1, L, T]: every query of row b sees keys j < lengths[b] (the row's cached
    prefix); keys past it (padding, stale rollback entries) are hidden. A row of length 0 has
    nothing to attend to and gets an undefined output: draft only for rows with a cached prefix."""
    n = lengths if isinstance(lengths, mx.array) else mx.array(np.asarray(lengths, dtype=np.int32))
    visible = mx.arange(T, dtype=mx.int32)[None, None, None, :] < n.astype(mx.int32)[:, None, None, None]
    return mx.broadcast_to(visible, (n.shape[0], 1, L, T))


def causal_key_mask(L: int, T: int) -> mx.array:
    """Teacher-forced mask [1, 1, L, T]: query i (drafting from position i) sees keys j <= i, i.e.
    exactly the prefix the target had cached when h_i was computed."""
    return (mx.arange(T)[None, :] <= mx.arange(L)[:, None])[None, None]


def save_assistant(head: AssistantHead, path: str | Path) -> None:
    p = Path(path)
    weights = dict(tree_flatten(head.parameters()))
    mx.save_safetensors(str(p / WEIGHTS_FILE), weights, metadata={"format": "mlx"})
    (p / CONFIG_FILE).write_text(json.dumps(head.config.to_dict(), indent=2) + "\n")


def load_assistant(path: str | Path) -> AssistantHead | None:
    """The assistant head shipped beside a model, or None when the directory has none."""
    return load_beside(path, CONFIG_FILE, WEIGHTS_FILE, lambda d: AssistantHead(AssistantConfig.from_dict(d)))
