"""Test doubles: script drafts to force acceptance counts, poison a target's logits to test fault
isolation, and find a stop string in a model's output. The benchmarks that script drafts import
this module from tests/ (they put tests/ on sys.path)."""

from __future__ import annotations

import copy

import gmlx  # noqa: F401  (OpenBLAS before mlx: benchmarks import this module too)
import mlx.core as mx

from gmlx.drafters.base import DraftPick
from gmlx.drafters.mtp import MTPDrafter
from gmlx.models.loading import LoadedModel


class ScriptedDrafter(MTPDrafter):
    """An MTP drafter whose draft *values* follow a script, to force chosen acceptance counts.

    The head still runs (so its cache evolves exactly as in real drafting); only the returned
    tokens are replaced: `script(first_position, k) -> list[int]` gives the k drafts."""

    def __init__(self, head, target, script):
        super().__init__(head, target.hidden_size)  # a bound head (LoadedModel.head)
        self.script = script

    def draft(self, st, k: int, pick: DraftPick, target_cache: list) -> mx.array:
        real = super().draft(st, k, pick, target_cache)
        forced = mx.array([self.script(int(pick.first_positions[0]), k)], dtype=mx.int32)
        return forced + 0 * real  # keep the head's graph attached to the round's one eval


def visible_window(text: str, start: int, width: int = 3) -> str:
    """The first `width`-character slice of `text` from `start` on that is not all whitespace
    (a stop string that tests can find in a model's output)."""
    i = start
    while i < len(text) - width and not text[i : i + width].strip():
        i += 1
    return text[i : i + width]


class PoisonedTarget:
    """A target whose logits are NaN at every position whose *input* token is `poison` (a test
    hook for fault isolation): a request whose prompt ends with that token faults at its first
    decode step, and a draft equal to it poisons only the position after it, which the round
    never accepts. The hidden states are untouched, so the drafter sees nothing wrong."""

    def __init__(self, target, poison: int):
        self._target = target
        self.poison = poison

    def _poisoned(self, tokens: mx.array, logits: mx.array) -> mx.array:
        hit = (tokens == self.poison)[..., None]  # [B, L, 1]
        return mx.where(hit, mx.array(float("nan"), dtype=logits.dtype), logits)

    def __call__(self, tokens: mx.array, cache: list) -> tuple[mx.array, mx.array]:
        logits, hidden = self._target(tokens, cache)
        return self._poisoned(tokens, logits), hidden

    def logits(self, tokens: mx.array, cache: list) -> mx.array:
        return self._poisoned(tokens, self._target.logits(tokens, cache))

    def __getattr__(self, name):  # embeddings, lm_head, backbone, make_cache, ...: the real target's
        return getattr(self._target, name)


def poisoned(lm: LoadedModel, poison: int) -> LoadedModel:
    """A copy of the loaded model whose target is a PoisonedTarget (the weights are shared)."""
    out = copy.copy(lm)
    out.target = PoisonedTarget(lm.target, poison)
    return out
