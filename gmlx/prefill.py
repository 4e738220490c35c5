"""Prefill with prefix reuse, and retirement into the prompt cache.

A request is prefilled up to its last prompt token (the pending bonus). When the prompt cache
holds a prefix of the prompt, only the remainder runs through the target. The drafter then
cold-starts on the remainder's hidden states: its attention is relative (RoPE), so its own
positions may start at 0 without changing what the target emits. A finished request's KV is
offered back, except a preempted one's (it dropped its retirement context) or a failed one's.
"""

from __future__ import annotations

from gmlx.kv import extract_row
from gmlx.models.adapter import Target
from gmlx.prompt_cache import PromptCache
from gmlx.request import Row
from gmlx.spec.speculative import Prefilled, prefill_row


class Prefiller:
    def __init__(self, target: Target, prompt_cache: PromptCache | None, step: int):
        self.target = target
        self.prompt_cache = prompt_cache
        self.step = step

    def prefill(self, row: Row, want_hidden: bool) -> Prefilled:
        row.stats.prompt_tokens = len(row.prompt)
        hit = self.prompt_cache.lookup(row.prompt) if self.prompt_cache is not None else None
        if hit is None:
            return prefill_row(self.target, row, self.step, want_hidden)
        return prefill_row(self.target, row, self.step, want_hidden, hit.caches, hit.length)

    def wants(self, row: Row) -> bool:
        return self.prompt_cache is not None and not row.preempted and row.finish_reason not in ("error", "cancelled")

    def retire(self, row: Row, caches: list) -> None:
        """Store the KV of the row's sequence (single-sequence caches; stale entries beyond are cut)."""
        if self.wants(row):
            n = caches[0].offset
            self.prompt_cache.insert((row.prompt + row.tokens)[:n], caches)

    def retire_batch_row(self, row: Row, batch_cache: list, i: int) -> None:
        if self.wants(row):
            self.retire(row, extract_row(batch_cache, i))
