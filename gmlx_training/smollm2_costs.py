"""Step costs behind SmolLM2's drafter choice: target decode, verify of K+1 tokens, and one draft
step of the shipped head with its draft vocabulary and with the full one.

Run: ``python -m gmlx_training.smollm2_costs [--dtype float32] [--reps 40] [--max-verify 5]``

All at batch 1 after a `--context`-token prompt, each up to logits (the argmax a draft needs),
interleaved so a busy machine's load hits all alike; medians. The verify is the target over K+1
new tokens (the bonus and K drafts), trimmed back after each run.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from gmlx import blas

blas.ensure_loaded()

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402

from gmlx.gguf import smollm2  # noqa: E402
from gmlx.models.loading import load  # noqa: E402


def step_costs(lm, context: int = 200, reps: int = 40, max_verify: int = 5) -> dict:
    target, head = lm.target, lm.head
    prompt = mx.array((np.arange(context, dtype=np.int32) * 7 % 30000)[None])
    cache = target.make_cache()
    hid = target.backbone(prompt, cache=cache)
    hc = KVCache()
    g0 = head(prompt[:, 1:], hid[:, :-1], hc)
    mx.eval(hid, g0, [c.state for c in cache], hc.state)  # sync: warm-up prefill
    h1 = hid[:, -1:]
    tok = mx.array([[1]], dtype=mx.int32)

    def verify(n):
        toks = mx.array([[5] * n], dtype=mx.int32)
        return lambda: target.logits(toks, cache)

    def head_step(full: bool):
        def f():
            g = head(tok, h1, hc)
            logits = target.lm_head(g) if full else head.logits(g)
            return mx.argmax(logits, axis=-1)
        return f

    steps = {f"target_{n}": (verify(n), n) for n in range(1, max_verify + 1)}
    steps["head_draft_vocab"] = (head_step(False), 0)
    steps["head_full_vocab"] = (head_step(True), 0)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(reps):
        for name, (fn, n) in steps.items():
            t0 = time.perf_counter()
            out = fn()
            mx.eval(out)  # sync: timing one step
            times[name].append(time.perf_counter() - t0)
            if n:
                for c in cache:
                    c.trim(n)
            else:
                hc.trim(1)
    med = {name: float(np.median(ts)) * 1e3 for name, ts in times.items()}
    t1 = med["target_1"]
    out = {"target_step_ms": t1,
           "verify_ratio": {f"t({n})/t(1)": med[f"target_{n}"] / t1 for n in range(2, max_verify + 1)},
           "head_step_ms": med["head_draft_vocab"], "head_step_ratio": med["head_draft_vocab"] / t1,
           "head_full_vocab_step_ms": med["head_full_vocab"], "head_full_vocab_ratio": med["head_full_vocab"] / t1,
           "draft_vocab_size": int(head.ids.shape[0]) if hasattr(head, "ids") else None,
           "context": context, "reps": reps, "load_average_1m": os.getloadavg()[0]}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--max-verify", type=int, default=5, help="verify forwards of 2..N tokens")
    a = ap.parse_args(argv)
    lm = load(smollm2.converted(a.dtype))
    print(json.dumps(step_costs(lm, a.context, a.reps, a.max_verify), indent=1))


if __name__ == "__main__":
    main()
