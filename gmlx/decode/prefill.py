"""Prefill with prefix reuse, and retirement into the prompt cache.

A request is prefilled up to its last prompt token (the pending bonus). When the prompt cache
holds a prefix of the prompt, only the remainder runs through the target. The drafter then
cold-starts on the remainder's hidden states: its attention is relative (RoPE), so its own
positions may start at 0 without changing what the target emits. A finished request's KV is
offered back, except a preempted one's (it dropped its retirement context) or a failed one's.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from gmlx.finish import FinishReason
from gmlx.row import Row
from gmlx.kv import RaggedKVCache
from gmlx.model_cache import extend_rows, extract_row, lift_caches, make_ragged_cache, trim_rows
from gmlx.models.adapter import Target
from gmlx.models.forward import prefill
from gmlx.processors import Context, apply, token_logprobs, unpack
from gmlx.prompt_cache import PromptCache
from gmlx.sampling import RowSampling


@dataclass(slots=True)
class Prefilled:
    """A request ready to decode: its single-sequence target cache holds x_0..x_{m-2} (the last
    prompt token is the pending bonus); `hidden` / `next_tokens` are the (h_i, x_{i+1}) entries a
    drafter is teacher-forced on (positions `start`..m-2), None when no drafter needs them."""

    cache: list | None
    hidden: mx.array | None  # [1, P, D]
    next_tokens: mx.array | None  # [1, P]

    @classmethod
    def nothing(cls) -> "Prefilled":
        """A row with nothing for a drafter to learn from (it joins unarmed, or cold-starts)."""
        return cls(None, None, None)


def prefill_row(target: Target, row: Row, step: int, want_hidden: bool, cache: list | None = None,
                start: int = 0) -> Prefilled:
    """Run prompt[start:-1] into `cache` (fresh when None; `start` tokens already cached)."""
    cache = cache if cache is not None else target.make_cache()
    body = row.prompt[start:-1]
    row.stats.prefill_tokens = len(body)
    hidden = prefill(target, cache, [body], step, want_hidden)
    nxt = mx.array([row.prompt[start + 1 :]], dtype=mx.int32) if hidden is not None else None
    return Prefilled(cache, hidden, nxt)


class Prefiller:
    def __init__(self, target: Target, prompt_cache: PromptCache | None, step: int):
        self.target = target
        self.prompt_cache = prompt_cache
        self.step = step

    def prefill(self, row: Row, want_hidden: bool) -> Prefilled:
        row.stats.prompt_tokens = len(row.prompt)
        score_prompt(self.target, row, self.step)
        hit = self.prompt_cache.lookup(row.prompt) if self.prompt_cache is not None else None
        if hit is None:
            return prefill_row(self.target, row, self.step, want_hidden)
        return prefill_row(self.target, row, self.step, want_hidden, hit.caches, hit.length)

    def prefill_many(self, rows: list[Row], want_hidden: bool) -> tuple[list[Row], list[RaggedKVCache], list[Prefilled]]:
        """Prefill several requests for the batch loop: those without a cached prefix together,
        in one right-padded forward per chunk (as mlx-lm's BatchGenerator), the others alone.
        Returns the rows in cache order, their per-layer ragged cache and their drafter inputs."""
        for r in rows:
            score_prompt(self.target, r, self.step)
        hits = {r.rid: self.prompt_cache.lookup(r.prompt) for r in rows} if self.prompt_cache is not None else {}
        fresh = [r for r in rows if hits.get(r.rid) is None]
        reused = [r for r in rows if hits.get(r.rid) is not None]
        cache, pres = self._prefill_together(fresh, want_hidden)
        for r in reused:
            r.stats.prompt_tokens = len(r.prompt)
            hit = hits[r.rid]
            pre = prefill_row(self.target, r, self.step, want_hidden, hit.caches, hit.length)
            extend_rows(cache, lift_caches([pre.cache]))
            pres.append(pre)
        return fresh + reused, cache, pres

    def _prefill_together(self, rows: list[Row], want_hidden: bool) -> tuple[list[RaggedKVCache], list[Prefilled]]:
        bodies = [r.prompt[:-1] for r in rows]
        longest = max((len(b) for b in bodies), default=0)
        cache = make_ragged_cache(self.target.model, len(rows))
        hidden = prefill(self.target, cache, bodies, self.step, want_hidden)
        trim_rows(cache, [longest - len(b) for b in bodies])
        pres = []
        for b, (r, body) in enumerate(zip(rows, bodies)):
            r.stats.prompt_tokens = len(r.prompt)
            r.stats.prefill_tokens = len(body)
            if hidden is None or not body:
                pres.append(Prefilled.nothing())
            else:
                pres.append(Prefilled(None, hidden[b : b + 1, : len(body)], mx.array([r.prompt[1:]], dtype=mx.int32)))
        return cache, pres

    def wants(self, row: Row) -> bool:
        return (self.prompt_cache is not None and not row.preempted
                and row.finish_reason not in (FinishReason.ERROR, FinishReason.CANCELLED))

    def retire(self, row: Row, caches: list) -> None:
        """Store the KV of the row's sequence (single-sequence caches; stale entries beyond are cut)."""
        if self.wants(row):
            n = caches[0].offset
            self.prompt_cache.insert((row.prompt + row.tokens)[:n], caches)

    def retire_batch_row(self, row: Row, batch_cache: list, i: int) -> None:
        if self.wants(row):
            self.retire(row, extract_row(batch_cache, i))


def score_prompt(target: Target, row: Row, step: int) -> None:
    """`row.prompt_logprobs` for a request that asked (echo with logprobs): each prompt token
    after the first, scored by the distribution the sampler would use at its position (logits
    processors included, as for generated tokens), top N alternatives included. One forward of
    the whole prompt on a fresh cache, in chunks, apart from the prefill (whose prefix may come
    from the prompt cache and which stops before the last token): echo costs a second prompt pass."""
    n_top = row.params.prompt_logprobs
    if n_top is None or row.prompt_logprobs is not None:
        return
    prompt = row.prompt
    rs = RowSampling.from_params([row.params], [row.seed])
    cache = target.make_cache()
    out = []
    for i in range(0, len(prompt) - 1, step):
        chunk = prompt[i : i + step + 1]  # predicts prompt[i+1 : i+step+1]
        logits, _ = target(mx.array([chunk[:-1]], dtype=mx.int32), cache)  # [1, L, V]
        if rs.proc is not None and rs.proc.any_logits:  # position i+j sees prompt[:i+j+1]
            dev = mx.array([chunk[1:-1]], dtype=mx.int32) if len(chunk) > 2 else None
            logits = apply(logits, rs.proc, Context([row], [i + 1], dev))
        nxt = mx.array([chunk[1:]], dtype=mx.int32)
        block = token_logprobs(logits, nxt, n_top)
        out.extend(unpack(np.array(block[0]), chunk[1:], n_top))  # sync: scoring is its own pass
    row.prompt_logprobs = out
