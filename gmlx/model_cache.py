"""A model's cache: a list with one cache per layer, a `RaggedKVCache` (gmlx/kv.py) for an
attention layer and a `RecurrentCache` (gmlx/recurrent.py) for a layer whose mlx-lm cache is a
recurrent state. The loops build, batch, trim, filter and extend it through these helpers, so every
layer moves with the same call whatever its kind.

Which layers are recurrent: found from the model (`recurrent_layers`): every layer whose mlx-lm
cache is an ArraysCache; its mixer is the submodule with the Gated DeltaNet structure (conv1d,
A_log, dt_bias, norm, out_proj and either Qwen3-Next's in_proj_qkvz/in_proj_ba or Qwen3.5's
in_proj_qkv/z/b/a) in a module that imports mlx-lm's `gated_delta_update`. Other recurrent
mixers (Mamba/Mamba2 SSM blocks, OLMo-hybrid's or Kimi's delta nets, ...) are named in
`blockers` and their models decode plain (gmlx/models/gated_delta.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import KVCache

from gmlx.kv import RaggedKVCache
from gmlx.recurrent import RecurrentCache


# -- which layers ------------------------------------------------------------------------------
def recurrent_layers(model: nn.Module) -> list[tuple[int, nn.Module, int]]:
    """(layer index, decoder layer, state arrays) of every layer whose mlx-lm cache is an
    ArraysCache (mlx-lm's MambaCache is one), found from the model's own `make_cache`."""
    from mlx_lm.models.cache import ArraysCache, make_prompt_cache

    try:
        layers = getattr(model, "layers", None)
        if layers is None:
            layers = model.model.layers
        caches = make_prompt_cache(model)
    except (AttributeError, TypeError):  # not an mlx-lm decoder with per-layer caches: nothing recurrent here
        return []
    return [(i, layers[i], len(c.cache)) for i, c in enumerate(caches) if isinstance(c, ArraysCache)]


def wrap_caches(caches: list, span: int = 0) -> list:
    """mlx-lm's per-layer caches with every ArraysCache replaced by a RecurrentCache."""
    from mlx_lm.models.cache import ArraysCache

    return [RecurrentCache(len(c.cache), span=span) if isinstance(c, ArraysCache) else c for c in caches]


# -- building, batching and moving rows (one call for every layer) ---------------------------
def make_ragged_cache(model: Any, batch_size: int = 0, span: int = 0) -> list[RaggedKVCache]:
    """One cache per layer: a RaggedKVCache, or a RecurrentCache (gmlx/recurrent.py) where the
    model's own cache is a recurrent state (`span`: one-token steps kept reachable by a trim)."""
    layers = model.layers if hasattr(model, "layers") else model.model.layers
    rec = {i: n for i, _, n in recurrent_layers(model)} if hasattr(model, "make_cache") else {}
    return [RecurrentCache(rec[i], batch_size, span=span) if i in rec else RaggedKVCache(batch_size)
            for i in range(len(layers))]


def lift_caches(requests: Sequence[Sequence[KVCache]]) -> list[RaggedKVCache]:
    """requests[r][l] is request r's layer-l KVCache (or RecurrentCache) -> per-layer batch."""
    return [RecurrentCache.lift(layer) if isinstance(layer[0], RecurrentCache) else RaggedKVCache.lift(layer)
            for layer in zip(*requests)]


def row_lengths(caches: Sequence[Any]) -> np.ndarray:
    """Each row's cached length (host), from the first attention layer (a recurrent layer counts
    the same tokens)."""
    for c in caches:
        if isinstance(c, RaggedKVCache):
            return c.lengths
    return caches[0].positions if caches else np.zeros(0, dtype=np.int64)


def trim_rows(caches: Sequence[RaggedKVCache], ns: Sequence[int] | np.ndarray) -> None:
    for c in caches:
        c.trim_rows(ns)


def filter_rows(caches: Sequence[RaggedKVCache], keep: Sequence[int]) -> None:
    for c in caches:
        c.filter(keep)


def extend_rows(caches: Sequence[RaggedKVCache], others: Sequence[RaggedKVCache]) -> None:
    if len(caches) != len(others):
        raise ValueError("extend_rows: layer counts differ")
    for c, o in zip(caches, others):
        c.extend(o)


def extract_row(caches: Sequence[RaggedKVCache], i: int) -> list[KVCache]:
    return [c.extract(i) for c in caches]


def cache_nbytes(caches: Sequence[Any]) -> int:
    return sum(c.nbytes for c in caches)


# -- prefill and drafting over the recurrent layers ---------------------------------------------
def begin_prefill(caches: Sequence, lengths: Sequence[int]) -> bool:
    """A prefill of rows with these many tokens follows (right-padded to the longest). Nothing in
    a prefill is rolled back but its padding, so the recurrent layers run mlx-lm's own code, never
    the capture: its masked path when the rows are ragged (each row's state stops where its tokens
    end, the padding is trimmed later like the KV's), else its plain path. True when some layer is
    recurrent (call `end_prefill` after)."""
    rec = [c for c in caches if isinstance(c, RecurrentCache)]
    ragged = len({int(n) for n in lengths}) > 1
    for c in rec:
        c.capture = False
        if ragged:
            c.prepare(lengths=list(lengths))
    return bool(rec)


def end_prefill(caches: Sequence) -> None:
    for c in caches:
        if isinstance(c, RecurrentCache):
            c.finalize()
            c.capture = True


def reach(caches: Sequence, n: int) -> None:
    """Keep n one-token steps reachable by a trim (a draft model drafting n tokens)."""
    for c in caches:
        if isinstance(c, RecurrentCache) and c.span < n:
            c.span = n
