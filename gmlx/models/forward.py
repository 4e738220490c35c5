"""The chunked forward of rows through a target: prefill's device work, shared by the decode
lanes' prefill (gmlx/decode/prefill.py) and the draft-model drafter's own cache."""

from __future__ import annotations

import mlx.core as mx

from gmlx import model_cache
from gmlx.models.adapter import Target


def prefill(target: Target, cache: list, bodies: list[list[int]], step: int, want_hidden: bool) -> mx.array | None:
    """Run each row's tokens through the target in chunks, right-padded to the longest row (the
    padded positions lie after a row's real ones; the caller trims them per row). Returns the
    hidden states [B, L, D] when asked."""
    longest = max((len(b) for b in bodies), default=0)
    # Recurrent layers run mlx-lm's own code here, its masked path for right-padded rows: each
    # row's state stops where its tokens end, the padding is trimmed like the KV's (gmlx/recurrent.py).
    hybrid = model_cache.begin_prefill(cache, [len(b) for b in bodies])
    hiddens = []
    for i in range(0, longest, step):
        n = min(step, longest - i)
        chunk = mx.array([(b[i : i + n] + [0] * n)[:n] for b in bodies], dtype=mx.int32)  # [B, n]
        if want_hidden:
            _, h = target(chunk, cache)
            hiddens.append(h)
            mx.eval(h, [c.state for c in cache])  # sync: bound the graph per prefill chunk
        else:
            target.run_backbone(chunk, cache=cache)
            mx.eval([c.state for c in cache])  # sync: bound the graph per prefill chunk
    if hybrid:
        model_cache.end_prefill(cache)
    if not want_hidden or not hiddens:
        return None
    return hiddens[0] if len(hiddens) == 1 else mx.concatenate(hiddens, axis=1)
