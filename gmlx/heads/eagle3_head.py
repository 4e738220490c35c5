"""EAGLE-3 draft heads in their public layout (`--drafter eagle3 --draft-model PATH`): the
checkpoints EAGLE-3's authors release and SGLang (llama_eagle3.py) and vLLM load.

Parts: this file holds the head (its layer, and the bound head the MTP drafter calls);
eagle3_checkpoint.py its checkpoint layout and loading; eagle3_streams.py the target's residual
streams it reads (which layers, and the view of the target that captures them).

The computation, per position i (hidden from the target at i, the embedding of token i+1):

    x = fc(concat(a_low, a_mid, a_high))                 a_*: the target's residual stream entering
                                                         the captured layers (3 T -> H)
    h = hidden_norm(x);  r = x (or h with `norm_before_residual`, speculators' option)
    r = self_attn(concat(input_layernorm(embed), h)) + r;   g = mlp(post_attention_layernorm(r)) + r
    logits over the draft vocabulary = lm_head(norm(g)), placed at their target ids

and drafting k tokens chains g (the pre-norm residual, SGLang's `hidden_states_to_aux`) as the
next step's hidden, of width H, where fc is not applied (as SGLang: fc runs when the hidden's
width is not H). The head's KV cache is its own (one layer), positions as the target's.

Exactness never depends on the head: every emitted token is the target's (accept iff equal), so
a token outside the draft vocabulary only costs a rejected draft.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama
from mlx_lm.models.base import create_attention_mask

from gmlx.heads.bound import BoundHead
from gmlx.heads.draft_vocab import NEVER, lm_head_rows
from gmlx.heads.eagle3_streams import AuxTarget

KIND = "eagle3"


class Eagle3Layer(nn.Module):
    def __init__(self, args: llama.ModelArgs, norm_before_residual: bool = False):
        super().__init__()
        d = args.hidden_size
        self.norm_before_residual = norm_before_residual
        self.self_attn = attn = llama.Attention(args)
        head_dim = args.head_dim or d // args.num_attention_heads
        bias = args.attention_bias
        attn.q_proj = nn.Linear(2 * d, args.num_attention_heads * head_dim, bias=bias)
        attn.k_proj = nn.Linear(2 * d, args.num_key_value_heads * head_dim, bias=bias)
        attn.v_proj = nn.Linear(2 * d, args.num_key_value_heads * head_dim, bias=bias)
        self.mlp = llama.MLP(args)
        self.input_layernorm = nn.RMSNorm(d, eps=args.rms_norm_eps)
        self.hidden_norm = nn.RMSNorm(d, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(d, eps=args.rms_norm_eps)

    def __call__(self, embeds: mx.array, hidden: mx.array, mask, cache) -> mx.array:
        h = self.hidden_norm(hidden)
        residual = h if self.norm_before_residual else hidden
        x = mx.concatenate([self.input_layernorm(embeds), h], axis=-1)
        r = self.self_attn(x, mask, cache) + residual
        return self.mlp(self.post_attention_layernorm(r)) + r


class Eagle3Model(nn.Module):
    """The checkpoint's modules under their checkpoint names."""

    def __init__(self, args: llama.ModelArgs, target_hidden: int, draft_vocab: int, n_aux: int,
                 fc_bias: bool = False, norm_before_residual: bool = False, own_lm_head: bool = True,
                 own_embed: bool = False):
        super().__init__()
        d = args.hidden_size
        self.fc = nn.Linear(n_aux * target_hidden, d, bias=fc_bias)
        self.midlayer = Eagle3Layer(args, norm_before_residual)
        self.norm = nn.RMSNorm(d, eps=args.rms_norm_eps)
        if own_lm_head:
            self.lm_head = nn.Linear(d, draft_vocab, bias=False)
        if own_embed:
            self.embed_tokens = nn.Embedding(args.vocab_size, d)


class BoundEagle3Head(BoundHead):
    """An EAGLE-3 head bound to its (aux) target, behind the bound-head interface the MTP drafter
    calls: `head(tokens, hidden, cache) -> g`, `head.logits(g)` over the target's vocabulary."""

    hidden_convention = "eagle3-aux"  # AuxTarget's: the captured residual streams, concatenated
    kind = KIND

    def __init__(self, module: Eagle3Model, target: AuxTarget, target_ids: mx.array | None):
        super().__init__(target)
        self.module = module
        self.ids = target_ids  # [draft_vocab] target id of each draft id (None: the same vocabulary)
        self.vocab_size = target.vocab_size
        self.aux_size = target.aux_size
        # No lm_head of its own but a reduced vocabulary: the target's LM-head rows for the draft ids
        # (gathered and dequantized once, as draft_vocab.py's head does), not its whole LM head.
        self.rows = None
        if "lm_head" not in self.module and target_ids is not None:
            self.rows = lm_head_rows(target, target_ids)
            mx.eval(self.rows)  # sync: once, at bind time

    def embed(self, tokens: mx.array) -> mx.array:
        if "embed_tokens" in self.module:
            return self.module.embed_tokens(tokens)
        return self.target.embed_tokens(tokens)

    def forward(self, embeds: mx.array, hidden: mx.array, cache) -> mx.array:
        if hidden.shape[-1] == self.aux_size:  # the target's streams (a chained draft step passes g)
            hidden = self.module.fc(hidden)
        return self.module.midlayer(embeds, hidden, create_attention_mask(embeds, cache), cache)

    def sub_logits(self, g: mx.array) -> mx.array:
        x = self.module.norm(g)
        if self.rows is not None:
            return x.astype(mx.float32) @ self.rows.T
        head = self.module.lm_head if "lm_head" in self.module else self.target.lm_head
        return head(x).astype(mx.float32)

    def logits(self, g: mx.array) -> mx.array:
        sub = self.sub_logits(g)
        if self.ids is None:
            return sub
        full = mx.full((*sub.shape[:-1], self.vocab_size), NEVER, dtype=sub.dtype)
        return mx.put_along_axis(full, mx.broadcast_to(self.ids, sub.shape), sub, axis=-1)
