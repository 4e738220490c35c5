"""An MTP head with a reduced draft vocabulary (as FR-Spec's and EAGLE-3's draft vocabularies).

A small model's LM head is a large share of its weights (SmolLM2-135M: 49152 x 576, ~20%), so a
one-layer head that scores the full vocabulary costs several times its own layer. This head
scores only `draft_vocab` (the N tokens its target chose most often on the training data): its
logits are the target's own LM-head rows for those ids, gathered once at bind time, and every
other token gets a very low logit, so it is never drafted. Exactness does not depend on the
draft: every emitted token is the target's (accept iff equal), so a token outside the draft
vocabulary only costs a rejected draft.

Files: `mtp_config.json` (MTPConfig plus `draft_vocab_size`) and `mtp_head.safetensors` (the
head's weights, float16 is fine: they are cast to float32 at load, and `draft_vocab`, int32).
"""

from __future__ import annotations

import mlx.core as mx

from gmlx.models.adapter import POST_NORM
from gmlx.heads.mtp_head import BoundMTPHead, MTPConfig, MTPHead

VOCAB_KEY = "draft_vocab_size"
NEVER = -1e9  # finite: sampling filters subtract and scale logits, and -inf - -inf is nan


class VocabMTPHead(MTPHead):
    def __init__(self, config: MTPConfig, draft_vocab_size: int):
        super().__init__(config)
        self.draft_vocab = mx.zeros((draft_vocab_size,), dtype=mx.int32)

    def load_weights(self, file_or_weights, strict: bool = True):
        super().load_weights(file_or_weights, strict=strict)
        # fp16 on disk halves the file; CPU matmuls in float32 are several times faster than float16.
        self.set_dtype(mx.float32, lambda d: mx.issubdtype(d, mx.floating))
        return self

    def bind(self, target) -> "BoundVocabMTPHead":
        return BoundVocabMTPHead(self, target)


def lm_head_rows(target, ids: mx.array) -> mx.array:
    """The target's LM-head rows for `ids` as a float32 [N, D] matrix (dequantized where the head
    or the tied embedding is quantized: the same values the target's own matmul uses)."""
    tied = target.lm_head == target.embed_tokens.as_linear  # bound methods compare by owner
    mod = target.embed_tokens if tied else target.lm_head
    w = mod.weight[ids]
    if hasattr(mod, "scales"):
        w = mx.dequantize(w, mod.scales[ids], mod.biases[ids], group_size=mod.group_size, bits=mod.bits)
    return w.astype(mx.float32)


class BoundVocabMTPHead(BoundMTPHead):
    hidden_convention = POST_NORM
    kind = "mtp"

    def __init__(self, head: VocabMTPHead, target):
        super().__init__(head, target)
        self.ids = head.draft_vocab
        self.rows = lm_head_rows(target, self.ids)
        mx.eval(self.rows)  # sync: once, at bind time
        self.vocab_size = target.vocab_size

    def sub_logits(self, g: mx.array) -> mx.array:
        """g [B, L, D] -> logits over the draft vocabulary [B, L, N] (training and evaluation)."""
        return g.astype(mx.float32) @ self.rows.T

    def logits(self, g: mx.array) -> mx.array:
        sub = self.sub_logits(g)
        full = mx.full((*sub.shape[:-1], self.vocab_size), NEVER, dtype=sub.dtype)
        idx = mx.broadcast_to(self.ids, sub.shape)
        return mx.put_along_axis(full, idx, sub, axis=-1)


def build_head(config: dict) -> MTPHead:
    """The head a `mtp_config.json` describes: with a draft vocabulary when it names one."""
    cfg = MTPConfig.from_dict(config)
    if config.get(VOCAB_KEY):
        return VocabMTPHead(cfg, int(config[VOCAB_KEY]))
    return MTPHead(cfg)
