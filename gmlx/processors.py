"""Logits processors, exact under speculation, and the logprobs of what was sampled.

Processors (mlx-lm's `make_logits_processors` semantics and order, then vLLM's `min_tokens`):

    logit_bias           logits[v] += bias[v]
    repetition_penalty   for each distinct v in the window: logits[v] *= r if logits[v] < 0 else /= r
    presence_penalty     for each distinct v in the window: logits[v] -= a
    frequency_penalty    for each occurrence of v in the window: logits[v] -= f
    min_tokens           logits[eos] = -inf while fewer than min_tokens tokens were generated

The window of the token at absolute position p is the last `*_context_size` tokens of
x_0..x_{p-1} (prompt included, as mlx-lm's generate_step passes them; 0 = all of them).

Under speculation a verify forward of [x_{n-1}, d_0..d_{k-1}] samples positions n..n+k at once.
Position n+j must see exactly what plain decoding would have seen there if the drafts were
right: the committed tokens x_0..x_{n-1} and the drafts d_0..d_{j-1}. Where a draft is wrong,
acceptance stops before any position that saw it, so every emitted token was sampled from the
processed logits of its true prefix: the stream is the plain stream. Vectorised, per window W:

    counts[b, j] = counts(committed window of row b) + onehot-cumsum(drafts)[:j]
                   - onehot-cumsum(tokens leaving the window as drafts enter)[:j]

one [B, V] scatter from the host's window and two [B, k, V] cumulative sums on the device. The
plain path runs the same function (L = 1, and the double-buffered lookahead's pending token as a
one-token device tail), so plain and speculative decoding apply identical arithmetic. The drafters
ignore processors: they only guess; the verify decides.

Requests without processors or logprobs never reach this code (`RowSampling.proc` is None).

Logprobs: log_softmax of the processed logits at temperature 1, before top-k/top-p/min-p (what
mlx-lm's generate_step yields and mlx_lm.server reports), gathered for the sampled token and
the top N, per position of the round, read with the round's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

ALL = 1 << 30  # a context size of 0 means the whole context


@dataclass(frozen=True, eq=False)
class Processors:
    """Per-row processor settings of a batch (built with its RowSampling; rows without a
    processor get neutral values, which change no logit)."""

    rep: np.ndarray  # [B] float32, 1 = off
    pres: np.ndarray  # [B] float32, 0 = off
    freq: np.ndarray  # [B] float32, 0 = off
    windows: dict  # "rep" | "pres" | "freq" -> [B] int64 window sizes (ALL = whole context)
    bias: tuple  # per row: ((token, bias), ...) or ()
    min_tokens: np.ndarray  # [B] int64
    logprobs: np.ndarray  # [B] int64: top-N wanted, -1 = no logprobs
    any_rep: bool
    any_pres: bool
    any_freq: bool
    any_bias: bool
    any_min: bool
    any_logprobs: bool
    _dense: dict = field(default_factory=dict)  # vocab size -> [B, V] bias (built once)

    @property
    def any_logits(self) -> bool:
        return self.any_rep or self.any_pres or self.any_freq or self.any_bias or self.any_min

    @property
    def top_n(self) -> int:
        return int(self.logprobs.max())

    def dense_bias(self, vocab: int, dtype) -> mx.array:
        key = (vocab, dtype)
        if key not in self._dense:
            b = np.zeros((len(self.bias), vocab), dtype=np.float32)
            for i, pairs in enumerate(self.bias):
                for tok, v in pairs:
                    if 0 <= tok < vocab:
                        b[i, tok] = v
            self._dense[key] = mx.array(b).astype(dtype)
        return self._dense[key]


def build(params: list) -> Processors | None:
    """The batch's processors, or None when no row has a processor and none wants logprobs."""
    if not any(p.has_processors or p.logprobs is not None for p in params):
        return None
    rep = np.array([p.repetition_penalty if p.repetition_penalty not in (0, 1) else 1.0 for p in params], np.float32)
    pres = np.array([p.presence_penalty for p in params], np.float32)
    freq = np.array([p.frequency_penalty for p in params], np.float32)

    def win(name):
        return np.array([getattr(p, name) or ALL for p in params], dtype=np.int64)

    bias = tuple(tuple(p.logit_bias or ()) for p in params)
    mt = np.array([p.min_tokens for p in params], dtype=np.int64)
    lp = np.array([-1 if p.logprobs is None else p.logprobs for p in params], dtype=np.int64)
    return Processors(rep=rep, pres=pres, freq=freq,
                      windows={"rep": win("repetition_context_size"), "pres": win("presence_context_size"),
                               "freq": win("frequency_context_size")},
                      bias=bias, min_tokens=mt, logprobs=lp, any_rep=bool((rep != 1).any()),
                      any_pres=bool((pres != 0).any()), any_freq=bool((freq != 0).any()), any_bias=any(bias),
                      any_min=bool((mt > 0).any()), any_logprobs=bool((lp >= 0).any()))


# ---- the committed context, read from the rows (host data) ------------------------------------
def _slice(parts: tuple, lo: int, hi: int) -> list[int]:
    """Tokens [lo, hi) of the concatenation of `parts`, without building it."""
    out: list[int] = []
    base = 0
    for p in parts:
        n = len(p)
        a, b = max(lo - base, 0), min(hi - base, n)
        if a < b:
            out.extend(p[a:b])
        base += n
    return out


@dataclass(frozen=True)
class Context:
    """What the positions of one sampled block condition on, per row: the committed tokens
    (`row.prompt + row.tokens + pending[b]`, exactly `first[b] - offset` of them), then the
    device tokens `dev` [B, m] (drafts, or a plain lookahead's pending token) of which the
    block's position j sees the first `offset + j`."""

    rows: list
    first: np.ndarray  # [B] absolute position of the block's first sampled token
    dev: mx.array | None = None
    offset: int = 0
    pending: list | None = None  # per row: emitted-to-be tokens not yet on the row

    def parts(self, b: int) -> tuple:
        r = self.rows[b]
        return (r.prompt, r.tokens, self.pending[b] if self.pending is not None else ())

    def committed_len(self, b: int) -> int:
        h = int(self.first[b]) - self.offset
        total = sum(len(p) for p in self.parts(b))
        assert total >= h, f"row {self.rows[b].rid}: {total} committed tokens, {h} needed"
        return h


def _counts(ctx: Context, window: np.ndarray, L: int, vocab: int) -> mx.array:
    """counts[b, j, v]: occurrences of v in the window of the block's position j -> [B, L, V]."""
    B = len(ctx.rows)
    m = 0 if ctx.dev is None else ctx.dev.shape[1]
    base_toks, drop_host = [], np.full((B, max(m, 1)), -1, dtype=np.int32)
    for b in range(B):
        h, c = ctx.committed_len(b), int(window[b])
        parts = ctx.parts(b)
        base_toks.append(_slice(parts, max(0, h - c), h))
        # the host tokens that leave the window as device tokens enter it: x_{h-c+i}, i < min(c, m)
        lo = h - c
        for i in range(min(m, c)):
            if lo + i >= 0:
                drop_host[b, i] = _slice(parts, lo + i, lo + i + 1)[0]
    width = max((len(t) for t in base_toks), default=0)
    base = mx.zeros((B, vocab), dtype=mx.float32)
    if width:
        idx = np.zeros((B, width), dtype=np.int32)
        w = np.zeros((B, width), dtype=np.float32)
        for b, t in enumerate(base_toks):
            idx[b, : len(t)] = t
            w[b, : len(t)] = 1.0
        base = base.at[mx.arange(B)[:, None], mx.array(idx)].add(mx.array(w))
    if m == 0:
        return mx.broadcast_to(base[:, None, :], (B, L, vocab))
    # the drop sequence: host tokens first; once i >= c, the device tokens that entered c earlier
    i = np.arange(m)[None, :]
    dev_idx = np.clip(i - window[:, None], 0, m - 1)
    from_dev = i >= window[:, None]
    dev = ctx.dev.astype(mx.int32)
    drop = mx.where(mx.array(from_dev), mx.take_along_axis(dev, mx.array(dev_idx.astype(np.int32)), axis=1),
                    mx.array(drop_host[:, :m]))
    vocab_ids = mx.arange(vocab, dtype=mx.int32)[None, None, :]
    delta = (dev[..., None] == vocab_ids).astype(mx.float32) - (drop[..., None] == vocab_ids).astype(mx.float32)
    cum = mx.concatenate([mx.zeros((B, 1, vocab), dtype=mx.float32), mx.cumsum(delta, axis=1)], axis=1)  # [B, m+1, V]
    return base[:, None, :] + cum[:, ctx.offset : ctx.offset + L]


def apply(logits: mx.array, proc: Processors, ctx: Context) -> mx.array:
    """The processed logits [B, L, V] (graph only; the host reads the rows' committed tokens)."""
    B, L, V = logits.shape
    dt = logits.dtype
    if proc.any_bias:
        logits = logits + proc.dense_bias(V, dt)[:, None, :]
    cache: dict = {}

    def counts(name):
        key = proc.windows[name].tobytes()
        if key not in cache:
            cache[key] = _counts(ctx, proc.windows[name], L, V)
        return cache[key]

    if proc.any_rep:
        r = mx.array(proc.rep).astype(dt)[:, None, None]
        seen = counts("rep") > 0
        logits = mx.where(seen, mx.where(logits < 0, logits * r, logits / r), logits)
    if proc.any_pres:
        a = mx.array(proc.pres).astype(dt)[:, None, None]
        logits = mx.where(counts("pres") > 0, logits - a, logits)
    if proc.any_freq:
        f = mx.array(proc.freq)[:, None, None]
        logits = logits - (f * counts("freq")).astype(dt)
    if proc.any_min:
        logits = _mask_eos(logits, proc, ctx)
    return logits


def _mask_eos(logits: mx.array, proc: Processors, ctx: Context) -> mx.array:
    """EOS ids at -inf where the row has generated fewer than its min_tokens before that position."""
    B, L, V = logits.shape
    rows_eos = [sorted(t for t in ctx.rows[b].eos_ids if 0 <= t < V) for b in range(B)]
    if not any(rows_eos):
        return logits
    generated = (ctx.first[:, None] + np.arange(L)[None, :]) - np.array([len(r.prompt) for r in ctx.rows])[:, None]
    early = (generated >= 0) & (generated < proc.min_tokens[:, None])  # [B, L]
    if not early.any():
        return logits
    eos = np.zeros((B, V), dtype=bool)
    for b, ids in enumerate(rows_eos):
        eos[b, ids] = True
    mask = mx.array(early)[..., None] & mx.array(eos)[:, None, :]
    return mx.where(mask, mx.array(-float("inf"), dtype=logits.dtype), logits)


def processed(logits: mx.array, rs, rows: list, first, dev: mx.array | None = None, offset: int = 0,
              pending: list | None = None) -> mx.array:
    """The logits the sampler takes, for a block whose first sampled position per row is
    `first` (see Context). Unchanged (the same array) when no row of `rs` has a processor."""
    proc = getattr(rs, "proc", None)
    if proc is None or not proc.any_logits:
        return logits
    ctx = Context(rows, np.asarray(first, dtype=np.int64).reshape(-1), dev, offset, pending)
    return apply(logits, proc, ctx)


# ---- logprobs ---------------------------------------------------------------------------------
def scored(logits: mx.array, targets: mx.array, rs) -> mx.array | None:
    """[B, L, 1 + 2N]: the sampled token's logprob, then the top N ids and their logprobs (as
    float32), from the processed `logits`; None when no row wants logprobs."""
    proc = getattr(rs, "proc", None)
    if proc is None or not proc.any_logprobs:
        return None
    return token_logprobs(logits, targets, proc.top_n)


def token_logprobs(logits: mx.array, targets: mx.array, n: int) -> mx.array:
    lf = logits.astype(mx.float32)
    lp = lf - mx.logsumexp(lf, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(lp, mx.maximum(targets, 0).astype(mx.int32)[..., None], axis=-1)  # [B, L, 1]
    if n == 0:
        return chosen
    top = mx.argpartition(-lp, kth=n - 1, axis=-1)[..., :n]
    top_lp = mx.take_along_axis(lp, top, axis=-1)
    order = mx.argsort(-top_lp, axis=-1)
    top = mx.take_along_axis(top, order, axis=-1)
    top_lp = mx.take_along_axis(top_lp, order, axis=-1)
    return mx.concatenate([chosen, top.astype(mx.float32), top_lp], axis=-1)


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One emitted (or prompt) token's logprob and the top alternatives at its position."""

    token: int
    logprob: float
    top: tuple  # ((token id, logprob), ...) best first; () when no alternatives were asked for


def unpack(row_block: np.ndarray, tokens: list[int], n: int) -> list[TokenLogprob]:
    """Host rows [L, 1 + 2N'] (N' >= n) -> one TokenLogprob per token (the row's own top n)."""
    out = []
    width = (row_block.shape[-1] - 1) // 2
    for j, tok in enumerate(tokens):
        r = row_block[j]
        top = tuple((int(r[1 + i]), float(r[1 + width + i])) for i in range(min(n, width)))
        out.append(TokenLogprob(int(tok), float(r[0]), top))
    return out


def attach(results: list, block: mx.array | np.ndarray | None, rs) -> None:
    """Give each round result the logprobs of its candidate tokens (host data; called after the
    round's read). `block`: [B, L, 1 + 2N] from `scored`."""
    if block is None:
        return
    host = np.array(block)  # sync: none, evaluated with the round's tokens
    for b, res in enumerate(results):
        n = int(rs.proc.logprobs[b])
        if n >= 0:
            res.logprobs = unpack(host[b], res.tokens, n)
