"""Sampling with position-keyed noise: one stream per seed, whatever the loop (docs/design.md §3).

Graph builders only: nothing here syncs with the host.

For request seed s, the token at absolute sequence position p is

    x_p = argmax_v( filtered_logprobs[v] / T + G(s, p, v) )        (T > 0)
    x_p = argmax_v( logits[v] )                                       (T = 0)

where G(s, p, v) is standard Gumbel noise computed by a counter-based hash of (s, p, v).
By the Gumbel-max trick x_p ~ softmax(filtered_logprobs / T), and because G depends on
(s, p, v) only, the stream is the same in the scalar loop, the batch loop and plain decode.

Coupled drafting (scalar loop): the drafter samples d_p = argmax(q_logprobs / T + G(s, p)) with
the *same* G. The target's token is computed exactly as above and a draft is accepted iff
d_p == x_p, so the emitted token at p is always the target's own sample: the output
distribution is exactly the target's. Acceptance is P[argmax(log p + G) == argmax(log q + G)],
which is 1 when q == p (vs sum p*q for independent draws). Never combine the shared noise with
a min(1, p/q) acceptance rule: that biases the output toward the drafter.

Filters (mlx-lm order and semantics: top-p, min-p, top-k on the temperature-1 logprobs, then /T)
take per-row parameters, so one call samples a batch whose rows have different settings.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from gmlx import processors
from gmlx.compiled import compiled

_M1 = 0x85EBCA6B
_M2 = 0xC2B2AE35
_GOLDEN = 0x9E3779B9


def _fmix32(h: mx.array) -> mx.array:
    """MurmurHash3's 32-bit finaliser: a bijection with full avalanche."""
    h = h ^ (h >> 16)
    h = h * mx.array(_M1, dtype=mx.uint32)
    h = h ^ (h >> 13)
    h = h * mx.array(_M2, dtype=mx.uint32)
    return h ^ (h >> 16)


def gumbel_noise(seeds: mx.array, positions: mx.array, vocab_size: int) -> mx.array:
    """G(seed, position, v) for every v: seeds [B] uint32, positions [B, L] int -> [B, L, V] float32."""
    s = _fmix32(seeds.astype(mx.uint32) ^ mx.array(_GOLDEN, dtype=mx.uint32))[:, None, None]
    p = _fmix32(positions.astype(mx.uint32) * mx.array(_GOLDEN, dtype=mx.uint32) + s[..., 0])[..., None]
    v = mx.arange(vocab_size, dtype=mx.uint32)[None, None, :]
    h = _fmix32(_fmix32(p ^ s) + v * mx.array(_M2, dtype=mx.uint32))
    # 24 high-quality bits -> u in (0, 1), never 0 or 1
    u = ((h >> 8).astype(mx.float32) + 0.5) * (1.0 / (1 << 24))
    return -mx.log(-mx.log(u))


@dataclass(frozen=True)
class RowSampling:
    """Per-row sampling parameters as device arrays (built once per batch change)."""

    temperature: mx.array  # [B] float32
    top_p: mx.array  # [B] float32
    min_p: mx.array  # [B] float32
    top_k: mx.array  # [B] int32
    seeds: mx.array  # [B] uint32
    any_top_p: bool
    any_min_p: bool
    any_top_k: bool
    all_greedy: bool
    # Logits processors and logprobs (gmlx.processors), None when no row has either: the
    # sampler's path is then exactly the one without them.
    proc: object | None = None

    @property
    def flags(self) -> tuple[bool, bool, bool]:
        return (self.any_top_p, self.any_min_p, self.any_top_k)

    @property
    def arrays(self) -> tuple[mx.array, ...]:
        return (self.temperature, self.top_p, self.min_p, self.top_k, self.seeds)

    @classmethod
    def from_params(cls, params: list, seeds: list[int]) -> "RowSampling":
        t = np.array([p.temperature for p in params], dtype=np.float32)
        tp = np.array([p.top_p for p in params], dtype=np.float32)
        mp = np.array([p.min_p for p in params], dtype=np.float32)
        tk = np.array([p.top_k for p in params], dtype=np.int32)
        return cls(
            temperature=mx.array(t), top_p=mx.array(tp), min_p=mx.array(mp), top_k=mx.array(tk),
            seeds=mx.array(np.array([s & 0xFFFFFFFF for s in seeds], dtype=np.uint32)),
            any_top_p=bool(((tp > 0) & (tp < 1) & (t > 0)).any()),
            any_min_p=bool(((mp > 0) & (t > 0)).any()),
            any_top_k=bool(((tk > 0) & (t > 0)).any()),
            all_greedy=bool((t == 0).all()),
            proc=processors.build(params),
        )


def filter_logprobs(logprobs: mx.array, rs: RowSampling) -> mx.array:
    """Apply top-p, min-p and top-k per row: logprobs [B, L, V] -> same, removed tokens -inf."""
    return _filter(logprobs, rs.temperature, rs.top_p, rs.min_p, rs.top_k, *rs.flags)


def _filter(logprobs, temperature, top_p, min_p, top_k, any_top_p, any_min_p, any_top_k):
    neg_inf = mx.array(-float("inf"), dtype=logprobs.dtype)
    if any_top_p:
        # keep the smallest set whose mass reaches top_p (mlx-lm apply_top_p, per row)
        top_p = top_p[:, None, None]
        sorted_lp = mx.sort(logprobs, axis=-1)
        sorted_p = mx.exp(sorted_lp)
        mass_above = mx.cumsum(sorted_p, axis=-1, reverse=True, inclusive=False)
        total = mass_above[..., :1] + sorted_p[..., :1]
        num_dropped = (mass_above >= top_p * total).sum(axis=-1, keepdims=True)
        threshold = mx.take_along_axis(sorted_lp, num_dropped, axis=-1)
        active = (top_p > 0) & (top_p < 1)
        logprobs = mx.where(active & (logprobs < threshold), neg_inf, logprobs)
    if any_min_p:
        min_p = min_p[:, None, None]
        top = mx.max(logprobs, axis=-1, keepdims=True)
        floor = top + mx.log(mx.maximum(min_p, 1e-30))
        logprobs = mx.where((min_p > 0) & (logprobs < floor), neg_inf, logprobs)
    if any_top_k:
        k = top_k[:, None, None]
        sorted_desc = -mx.sort(-logprobs, axis=-1)
        kth = mx.take_along_axis(sorted_desc, mx.maximum(k - 1, 0), axis=-1)
        logprobs = mx.where((k > 0) & (logprobs < kth), neg_inf, logprobs)
    return logprobs


FAULT = -1  # the token `sample` returns where the logits are unusable (see `sample`)


def sample(logits: mx.array, rs: RowSampling, positions: mx.array | np.ndarray) -> mx.array:
    """The target's tokens: logits [B, L, V] -> tokens [B, L] int32. `positions`: the absolute
    positions [B, L] (an mx.array), or each row's first position [B] (host data; the grid is
    built only when some row samples, since greedy rows need no noise).

    A position whose logits hold a NaN or +inf, or are all -inf, gets FAULT instead of a token:
    the fault travels with the round's one host read (no extra sync), emission ends that request
    with an error, and the other rows are untouched. -inf entries alone are legitimate (masked
    tokens), so they are not a fault. FAULT never equals a draft, so acceptance stops there.
    The whole sampler is one compiled graph per sampling configuration (gmlx.compiled)."""
    if rs.all_greedy:
        return _greedy_checked()(logits)
    return _sampler(rs.flags, True)(logits, *rs.arrays, _grid(positions, logits.shape[1]))


def _grid(positions: mx.array | np.ndarray, n: int) -> mx.array:
    if isinstance(positions, mx.array):
        return positions
    first = np.asarray(positions, dtype=np.int32)
    return mx.array(first[:, None] + np.arange(n, dtype=np.int32)[None])


def _usable(logits: mx.array) -> mx.array:
    top = mx.max(logits, axis=-1)  # NaN if any entry is NaN; +inf / -inf for the other faults
    return mx.isfinite(top) & ~mx.any(mx.isnan(logits), axis=-1)  # [B, L]


@functools.cache
def _greedy_checked():
    def greedy(logits):
        return mx.where(_usable(logits), mx.argmax(logits, axis=-1).astype(mx.int32), FAULT)
    return compiled(greedy)


@functools.cache
def _sampler(flags: tuple[bool, bool, bool], fault: bool):
    """The sampler for rows of which some sample (T > 0), with these filters switched on."""
    any_top_p, any_min_p, any_top_k = flags

    def tokens(logits, temperature, top_p, min_p, top_k, seeds, positions):
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        logprobs = _filter(logprobs, temperature, top_p, min_p, top_k, any_top_p, any_min_p, any_top_k)
        temp = temperature[:, None, None]
        safe_t = mx.where(temp > 0, temp, 1.0)
        noisy = logprobs / safe_t + gumbel_noise(seeds, positions, logits.shape[-1])
        sampled = mx.argmax(noisy, axis=-1)
        greedy = mx.argmax(logits, axis=-1)
        out = mx.where(temperature[:, None] > 0, sampled, greedy).astype(mx.int32)
        return mx.where(_usable(logits), out, FAULT) if fault else out
    return compiled(tokens)


def draft_coupled(logits: mx.array, rs: RowSampling, positions: mx.array | np.ndarray) -> mx.array:
    """Scalar-loop drafts: the drafter's logits sampled with the target's noise for the same positions.
    No FAULT here: a draft is only a guess the target verifies, and it is fed back into the models."""
    if rs.all_greedy:
        return draft_greedy(logits)
    return _sampler(rs.flags, False)(logits, *rs.arrays, _grid(positions, logits.shape[1]))


def draft_greedy(logits: mx.array) -> mx.array:
    """Batch-loop drafts are greedy, as the spec requires (seed text: "coupled RNG does not extend
    across rows"). Acceptance is lower at T > 0; the output is unchanged, since every emitted
    token is still the target's own position-keyed sample."""
    return mx.argmax(logits, axis=-1).astype(mx.int32)
