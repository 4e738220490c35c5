"""Self-distillation data for SmolLM2's drafter: the target's own answers, with its hidden states.

Run: ``nice -n 19 python -m gmlx_training.smollm2_data --out DIR --minutes 35``

The frozen fp32 target (`smollm2.converted("float32")`) answers the prompts of
`gmlx_training.smollm2_prompts` in left-padded batches (mlx-lm's BatchKVCache); every 4th batch
samples at T=0.8, the others are greedy. Each batch becomes one shard `DIR/{split}-{n:04d}.npz`:

- tokens [N] int32: the rows' real tokens (prompt, then answer up to and including EOS), concatenated;
- hidden [N, D] float16: the target's post-norm hidden after each token (its logits are hidden @ E^T);
- argmax [N] int32: the target's greedy choice for the token after each one (exact, from fp32 logits);
- starts [R+1] int64: row boundaries; prompt_len [R]; temp [R];
- aux [N, 3 D] float16 (with `--aux`): the residual streams entering the layers an EAGLE-3 head
  reads (`gmlx.heads.eagle3_streams.layers_entering`: 2, 15 and 27 of SmolLM2's 30), concatenated.

`--self-ask N`: the training split's chat prompts are N questions the target writes itself
(`gmlx_training.self_ask`; listed in DIR/self_asked.json); the held-out split keeps the templates.

`--model embedded`: the same for gmlx's embedded default model (a code model without a chat
template): code prompts only, cut from `--files` standard-library files per split.

Prefill and decode both give hidden states, so every token the target reads is a training
position. The run stops when the wall budget is spent (val shards first, then train), so a
stopped run still leaves whole shards.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from gmlx import blas

blas.ensure_loaded()

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.models.cache import BatchKVCache  # noqa: E402

from gmlx.gguf import smollm2  # noqa: E402
from gmlx.heads.eagle3_streams import tapped, layers_entering  # noqa: E402
from gmlx.models.loading import load  # noqa: E402
from gmlx_training import self_ask  # noqa: E402
from gmlx_training.smollm2_prompts import build  # noqa: E402


def target_model(name: str):
    """The frozen target a drafter is distilled from: "smollm2" (its fp32 conversion) or "embedded"."""
    return load(smollm2.converted("float32") if name == "smollm2" else None, drafter=False)


def encode(lm, kind: str, text: str, max_len: int) -> list[int]:
    tok = lm.tokenizer
    if kind == "chat":
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    else:
        ids = tok.encode(text)
    return list(ids)[-max_len:]


class Taps:
    """The target's backbone, optionally recording the streams an EAGLE-3 head reads (`aux`)."""

    def __init__(self, target, aux: bool):
        self.sink: dict = {}
        self.entering = layers_entering({}, target.num_layers) if aux else ()
        self.backbone = tapped(target.backbone, self.entering, self.sink) if aux else target.backbone

    def __call__(self, x, cache=None):
        self.sink.clear()
        hid = self.backbone(x, cache=cache)
        return hid, (mx.concatenate([self.sink[i] for i in self.entering], axis=-1).astype(mx.float16)
                     if self.entering else None)


def generate(target, prompts: list[list[int]], max_new: int, temp: float, eos: set[int],
             taps: Taps | None = None) -> list[dict]:
    """Batched generation from left-padded prompts; per row its tokens, hidden states and argmaxes."""
    taps = taps or Taps(target, False)
    B, P = len(prompts), max(len(p) for p in prompts)
    pad = [P - len(p) for p in prompts]
    x = mx.array(np.array([[0] * d + p for d, p in zip(pad, prompts)], dtype=np.int32))
    cache = [BatchKVCache(pad) for _ in target.backbone.layers]
    hid, a = taps(x, cache=cache)
    hs, auxs, ams, toks = [hid], [a], [], [x]
    done = np.zeros(B, dtype=bool)
    ends = np.full(B, P + max_new, dtype=np.int64)
    for s in range(max_new):
        logits = target.lm_head(hs[-1])
        ams.append(mx.argmax(logits, axis=-1).astype(mx.int32))
        last = logits[:, -1, :]
        nxt = ams[-1][:, -1] if temp == 0 else mx.random.categorical(last / temp).astype(mx.int32)
        toks.append(nxt[:, None])
        nx = np.array(nxt)  # sync: EOS bookkeeping, once a step
        for b in np.nonzero(~done & np.isin(nx, list(eos)))[0]:
            done[b], ends[b] = True, P + s + 1
        if done.all() or s == max_new - 1:
            break
        hid, a = taps(nxt[:, None], cache=cache)
        hs.append(hid)
        auxs.append(a)
    hidden = mx.concatenate(hs, axis=1).astype(mx.float16)
    argmax = mx.concatenate(ams, axis=1)
    tokens = mx.concatenate(toks, axis=1)
    aux = mx.concatenate(auxs, axis=1) if taps.entering else mx.zeros((B, hidden.shape[1], 0), mx.float16)
    mx.eval(hidden, argmax, tokens, aux)  # sync: the batch's results go to disk
    hidden, argmax, tokens, aux = np.array(hidden), np.array(argmax), np.array(tokens), np.array(aux)
    rows = []
    for b in range(B):
        end = min(int(ends[b]), tokens.shape[1], hidden.shape[1])
        rows.append({"tokens": tokens[b, pad[b] : end], "hidden": hidden[b, pad[b] : end],
                     "argmax": argmax[b, pad[b] : end], "aux": aux[b, pad[b] : end], "prompt_len": len(prompts[b]), "temp": temp})
    return rows


def self_asked(lm, target, eos: set[int], n: int, seed: int, batch: int) -> list[str]:
    """Up to n distinct questions the target writes itself (gmlx_training/self_ask.py), sampled."""
    metas = self_ask.meta_prompts(random.Random(seed), n)
    out, seen = [], set()
    for j in range(0, n, batch):
        ids = [encode(lm, "chat", m, 10_000) for m in metas[j : j + batch]]
        for row in generate(target, ids, 48, 0.7, eos):
            reply = [int(t) for t in row["tokens"][row["prompt_len"]:] if int(t) not in eos]
            q = self_ask.question(lm.tokenizer.decode(reply))
            if q is not None and q not in seen:
                seen.add(q)
                out.append(q)
    return out


def teacher_forced(target, windows: list[list[int]], taps: Taps | None = None) -> list[dict]:
    """Rows of the same length read in one forward: no answer, every position is prompt."""
    taps = taps or Taps(target, False)
    x = mx.array(np.array(windows, dtype=np.int32))
    hid, aux = taps(x)
    aux = aux if aux is not None else mx.zeros((*x.shape, 0), mx.float16)
    argmax = mx.argmax(target.lm_head(hid), axis=-1).astype(mx.int32)
    hid = hid.astype(mx.float16)
    mx.eval(hid, argmax, aux)  # sync: the batch's results go to disk
    hid, argmax, aux = np.array(hid), np.array(argmax), np.array(aux)
    return [{"tokens": np.array(w, dtype=np.int32), "hidden": hid[b], "argmax": argmax[b], "aux": aux[b],
             "prompt_len": len(w), "temp": -1.0} for b, w in enumerate(windows)]


def corpus_windows(lm, seq: int, seed: int):
    """Endless random `seq`-token windows: standard-library code (training files) 3 of 4, CMake's
    reStructuredText help pages (prose) 1 of 4."""
    from gmlx_training.stdlib_corpus import corpus_files, read, split_files

    code = split_files(corpus_files())[0]
    prose = sorted(Path("/usr/share").glob("cmake*/Help/**/*.rst"))
    rng = np.random.default_rng(seed)
    while True:
        pool = prose if prose and rng.random() < 0.25 else code
        ids = lm.tokenizer.encode(read(pool[rng.integers(len(pool))]))
        if len(ids) > seq:
            s = int(rng.integers(0, len(ids) - seq))
            yield ids[s : s + seq]


def save_shard(path: Path, rows: list[dict]) -> int:
    starts = np.cumsum([0] + [len(r["tokens"]) for r in rows])
    np.savez(path, tokens=np.concatenate([r["tokens"] for r in rows]).astype(np.int32),
             hidden=np.concatenate([r["hidden"] for r in rows]),
             **({"aux": np.concatenate([r["aux"] for r in rows])} if rows[0]["aux"].shape[-1] else {}), argmax=np.concatenate([r["argmax"] for r in rows]),
             starts=starts, prompt_len=np.array([r["prompt_len"] for r in rows]),
             temp=np.array([r["temp"] for r in rows], dtype=np.float32))
    return int(starts[-1])


def load_shards(dirs: list[Path], split: str) -> list[dict]:
    return [dict(np.load(f)) for d in dirs for f in sorted(Path(d).glob(f"{split}-*.npz"))]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--minutes", type=float, default=35.0)
    ap.add_argument("--val-batches", type=int, default=4, help="held-out shards (half code, half chat)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=160)
    ap.add_argument("--max-prompt", type=int, default=320)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--corpus", action="store_true", help="teacher-forced text windows instead of answers")
    ap.add_argument("--corpus-seq", type=int, default=256)
    ap.add_argument("--aux", action="store_true", help="also store the streams an EAGLE-3 head reads")
    ap.add_argument("--model", choices=("smollm2", "embedded"), default="smollm2",
                    help="the target: SmolLM2's fp32 conversion, or the embedded default model (code only)")
    ap.add_argument("--general", action="store_true", help="add general chat prompts (gmlx_training/chat_topics.py)")
    ap.add_argument("--self-ask", type=int, default=0, metavar="N",
                    help="the training split's chat prompts: N questions the model writes itself (self_ask.py)")
    ap.add_argument("--files", type=int, default=400, help="standard-library files per split prompts are cut from")
    a = ap.parse_args(argv)
    mx.random.seed(a.seed)
    a.out.mkdir(parents=True, exist_ok=True)
    lm = target_model(a.model)
    target, eos = lm.target, lm.eos_ids
    target.model.freeze()
    taps = Taps(target, a.aux)
    prompts = build(a.seed, a.files, a.general)
    if a.self_ask:  # the held-out split keeps the templated questions: figures stay comparable across runs
        ts = time.time()
        prompts["train"]["chat"] = self_asked(lm, target, eos, a.self_ask, a.seed, a.batch)
        (a.out / "self_asked.json").write_text(json.dumps(prompts["train"]["chat"], indent=1) + "\n")
        print(f"{len(prompts['train']['chat'])} self-asked questions in {time.time() - ts:.0f}s", flush=True)
    kinds = ("code", "chat") if a.model == "smollm2" else ("code",)
    plan = []  # (split, kind, [ids]) batches, prompts sorted by length within a kind to limit padding
    for split in ("val", "train"):
        per_kind = {}
        for kind in kinds:
            ids = [encode(lm, kind, t, a.max_prompt) for t in prompts[split][kind]]
            order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
            chunks = [[ids[i] for i in order[j : j + a.batch]] for j in range(0, len(order), a.batch)]
            np.random.default_rng(a.seed).shuffle(chunks)
            per_kind[kind] = chunks
        n = a.val_batches // len(kinds) if split == "val" else max(len(c) for c in per_kind.values())
        for j in range(n):
            for kind in per_kind:
                if j < len(per_kind[kind]):
                    plan.append((split, kind, per_kind[kind][j]))
    if a.corpus:  # teacher forcing on text instead of answers (several times cheaper per token here)
        it = corpus_windows(lm, a.corpus_seq, a.seed + 1)
        plan = [("train", "corpus", None)] * 100_000  # windows drawn when their batch runs
    t0, log, counts = time.time(), [], {"val": 0, "train": 0}
    for i, (split, kind, batch) in enumerate(plan):
        if time.time() - t0 > a.minutes * 60:
            break
        temp = 0.8 if i % 4 == 3 and kind != "corpus" else 0.0
        tb = time.time()
        batch = batch if batch is not None else [next(it) for _ in range(a.batch)]
        rows = (teacher_forced(target, batch, taps) if kind == "corpus"
                else generate(target, batch, a.max_new, temp, eos, taps))
        n = save_shard(a.out / f"{split}-{counts[split]:04d}.npz", rows)
        counts[split] += 1
        log.append({"split": split, "kind": kind, "temp": temp, "rows": len(rows), "tokens": n, "s": time.time() - tb})
        total = sum(e["tokens"] for e in log)
        print(f"{split} {kind} T={temp} rows {len(rows)} tokens {n} in {log[-1]['s']:.0f}s;"
              f" total {total} tokens, {(time.time() - t0) / 60:.1f} min, {total / (time.time() - t0):.0f} tok/s",
              flush=True)
    (a.out / "data_log.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()},
                                                      "batches": log}, indent=1) + "\n")


if __name__ == "__main__":
    main()
