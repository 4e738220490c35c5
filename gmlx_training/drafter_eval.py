"""Held-out measurements of the embedded model's drafters: agreement with the target and step cost.

Agreement is teacher-forced on held-out windows: a drafter's argmax at a position is compared with
the target's argmax for the same token, given the true prefix. That is the chance a greedy draft
is accepted when everything before it was. The windows are `train_default.evaluate`'s (same seed,
count and length), so the MTP head's number here reproduces the one in the card.
"""

from __future__ import annotations

import os
import time

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import KVCache, make_prompt_cache

from gmlx.heads.assistant_head import causal_key_mask, key_mask


def _windows(val: np.ndarray, seq: int, n: int) -> list[mx.array]:
    span = seq + 3
    starts = np.random.default_rng(1234).integers(0, len(val) - span, size=n)
    return [mx.array(val[s : s + span][None]) for s in starts]


def agreement(target, draft, assistant, mtp, val: np.ndarray, seq: int, n: int = 24) -> dict:
    """Rates over all positions of n windows; a drafter passed as None is skipped."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}

    def add(name: str, pred: mx.array, ref: mx.array) -> None:
        sums[name] = sums.get(name, 0.0) + (pred == ref).sum().item()  # sync: eval metric
        counts[name] = counts.get(name, 0) + ref.size

    emb, norm, lm = target.embed_tokens, target.final_norm, target.lm_head
    for x in _windows(val, seq, n):
        N = x.shape[1] - 1
        cache = make_prompt_cache(target.model)
        hid = target.backbone(x[:, :N], cache=cache)
        logits = lm(hid)
        ref = mx.argmax(logits, axis=-1)  # ref[i]: the target's choice for token i+1
        ce = nn.losses.cross_entropy(logits, x[:, 1:], reduction="sum")
        sums["target_ce"] = sums.get("target_ce", 0.0) + ce.item()  # sync: eval metric
        counts["target_ce"] = counts.get("target_ce", 0) + N
        add("target_top1", ref, x[:, 1:])
        if draft is not None:
            d_logits = draft(x[:, :N])
            ce = nn.losses.cross_entropy(d_logits, x[:, 1:], reduction="sum")
            sums["draft_ce"] = sums.get("draft_ce", 0.0) + ce.item()  # sync: eval metric
            counts["draft_ce"] = counts.get("draft_ce", 0) + N
            add("draft_next", mx.argmax(d_logits, axis=-1), ref)
        if mtp is not None:
            g1 = mtp(emb(x[:, 1:N]), hid[:, :-1], norm)
            g2 = mtp(emb(x[:, 2:N]), g1[:, :-1], norm)
            add("mtp_t2", mx.argmax(lm(g1), axis=-1), ref[:, 1:])
            add("mtp_t3", mx.argmax(lm(g2), axis=-1), ref[:, 2:])
        if assistant is not None:
            kv = cache[assistant.config.kv_layer]
            k, v = kv.keys[:, :, :N], kv.values[:, :, :N]
            one = mx.array([1], dtype=mx.int32)
            g1 = assistant(emb(x[:, 1:N]), hid[:, :-1], k, v, one, causal_key_mask(N - 1, N), norm)
            g2 = assistant(emb(x[:, 2:N]), g1[:, :-1], k, v, one + 1, causal_key_mask(N - 2, N), norm)
            add("assistant_t2", mx.argmax(lm(g1), axis=-1), ref[:, 1:])
            add("assistant_t3", mx.argmax(lm(g2), axis=-1), ref[:, 2:])
    out = {name: sums[name] / counts[name] for name in sums}
    out["windows"] = n
    out["positions"] = counts["target_ce"]
    return out


def step_costs(target, draft, assistant, mtp, context: int = 200, reps: int = 200) -> dict:
    """Median wall time of one batch-1 step of each, interleaved so load changes hit all alike:
    target decode, draft-model decode, MTP head step (each with a `context`-token KV cache, trimmed
    back after each step) and assistant step (reading the target's cache), each up to logits."""
    emb, norm, lm = target.embed_tokens, target.final_norm, target.lm_head
    prompt = mx.array(np.arange(context, dtype=np.int32)[None] % target.vocab_size)
    t_cache = make_prompt_cache(target.model)
    d_cache = make_prompt_cache(draft)
    m_cache = KVCache()
    hid = target.backbone(prompt, cache=t_cache)
    draft(prompt, cache=d_cache)
    mtp(emb(prompt), hid, norm, cache=m_cache)
    mx.eval(hid, [c.state for c in t_cache + d_cache], m_cache.state)  # sync: warm-up prefill
    tok = mx.array([[1]])
    h1 = hid[:, -1:]
    kv = t_cache[assistant.config.kv_layer]
    pos = mx.array([context], dtype=mx.int32)

    def assistant_step():
        mask = key_mask(pos, kv.keys.shape[2])
        return lm(assistant(emb(tok), h1, kv.keys, kv.values, pos, mask, norm))

    steps = {
        "target": (lambda: target.model(tok, cache=t_cache), t_cache),
        "draft": (lambda: draft(tok, cache=d_cache), d_cache),
        "mtp": (lambda: lm(mtp(emb(tok), h1, norm, cache=m_cache)), [m_cache]),
        "assistant": (assistant_step, []),
    }
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(reps):
        for name, (fn, caches) in steps.items():
            t0 = time.perf_counter()
            out = fn()
            mx.eval(out)  # sync: timing one step
            times[name].append(time.perf_counter() - t0)
            for c in caches:
                c.trim(1)
    med = {name: float(np.median(ts)) for name, ts in times.items()}
    out = {f"{name}_step_ms": med[name] * 1e3 for name in med}
    for name in ("draft", "mtp", "assistant"):
        out[f"{name}_cost_ratio"] = med[name] / med["target"]
    # Small steps suffer most from a busy machine, so the load at measurement time goes on record.
    out.update(context=context, reps=reps, load_average=os.getloadavg()[0])
    return out


def greedy_acceptance(target, draft, assistant, mtp, prompts: list[list[int]], k: int = 3, gen: int = 128) -> dict:
    """Greedy speculation at batch 1 with k drafts a round, replayed against the target's greedy
    stream (speculation never changes it, so the accepted count of every round is fixed by it).
    Each round drafts from the state the engine would have: the target's cache over 0..t, its
    hidden h_t and the bonus token t+1. Returns accepted / proposed drafts per drafter."""
    emb, norm, lm = target.embed_tokens, target.final_norm, target.lm_head

    def top(logits: mx.array) -> int:
        return int(mx.argmax(logits[0, -1]).item())  # sync: a drafted token decides the next step

    accepted = {"draft": 0, "mtp": 0, "assistant": 0}
    proposed = dict.fromkeys(accepted, 0)
    for ids in prompts:
        seq = list(ids)
        cache = make_prompt_cache(target.model)
        logits = target.model(mx.array([ids]), cache=cache)
        for _ in range(gen):
            seq.append(top(logits))
            logits = target.model(mx.array([seq[-1:]]), cache=cache)
        x = mx.array([seq])
        cache = make_prompt_cache(target.model)
        hid = target.backbone(x, cache=cache)
        kv = cache[assistant.config.kv_layer]

        def propose(name: str, t: int) -> list[int]:
            out, tok = [], seq[t + 1]
            if name == "assistant":
                g, mask = hid[:, t : t + 1], key_mask([t + 1], kv.keys.shape[2])
                for j in range(k):
                    g = assistant(emb(mx.array([[tok]])), g, kv.keys, kv.values, mx.array([t + 1 + j]), mask, norm)
                    tok = top(lm(g))
                    out.append(tok)
            elif name == "mtp":
                # Its cache is rebuilt over the accepted prefix each round, as the engine's catch-up leaves it.
                c = KVCache()
                g = mtp(emb(x[:, 1 : t + 2]), hid[:, : t + 1], norm, cache=c)[:, -1:]
                for _ in range(k):
                    tok = top(lm(g))
                    out.append(tok)
                    g = mtp(emb(mx.array([[tok]])), g, norm, cache=c)
            else:
                c = make_prompt_cache(draft)
                logits = draft(x[:, : t + 2], cache=c)
                for _ in range(k):
                    tok = top(logits)
                    out.append(tok)
                    logits = draft(mx.array([[tok]]), cache=c)
            return out

        for name in accepted:
            t = len(ids) - 1  # the prompt is computed; the first generated token is the bonus
            while t + 1 + k < len(seq):
                d = propose(name, t)
                a = 0
                while a < k and d[a] == seq[t + 2 + a]:
                    a += 1
                accepted[name] += a
                proposed[name] += k
                t += a + 1
    out = {f"{name}_acceptance": accepted[name] / proposed[name] for name in accepted}
    out.update(k=k, gen=gen, prompts=len(prompts))
    return out
