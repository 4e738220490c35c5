"""Train SmolLM2-135M-Instruct's MTP head (reduced draft vocabulary) on self-distillation data.

Run: ``nice -n 19 python -m gmlx_training.train_smollm2_head --data DIR --minutes 35``
(DIR from `gmlx_training.smollm2_data`: the frozen fp32 target's answers with its hidden states).

Head (`gmlx.heads.draft_vocab.VocabMTPHead`): fc(concat(norm(embed(t+1)), norm(h_t))) -> one
llama block (the target's attention geometry, MLP `--ffn`, random init) -> the target's final norm
-> the target's LM-head rows for the `--vocab` ids the target chose most often in the training
shards (see `draft_vocab`). Teacher forcing on the stored hidden states; the target is never run here, because its
logits are free: they are `h @ E^T` (tied embeddings), so the loss per depth is

    KL(softmax(h_{t+1} E_v^T) || softmax(g_t E_v^T)) + w_hard CE(g_t E_v^T, argmax) + w_feat SmoothL1(g_t, h_{t+1})

(E_v: the draft vocabulary's rows; argmax: the target's exact fp32 greedy choice, ignored when
outside the draft vocabulary; the feature term is EAGLE's), at depth 1 (token t+2) and, weighted
`--w2`, depth 2 (t+3, chained on the head's own output). Held-out agreement (head argmax ==
target argmax, teacher-forced) is logged every `--eval-min` minutes, and the head is exported
(float16) whenever it is the best so far, so a stopped run still leaves a usable head.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from gmlx import blas

blas.ensure_loaded()

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from gmlx.gguf import smollm2  # noqa: E402
from gmlx.heads.draft_vocab import VOCAB_KEY, VocabMTPHead, lm_head_rows  # noqa: E402
from gmlx.models.loading import load  # noqa: E402
from gmlx.weights import SMOLLM2_HEAD  # noqa: E402
from gmlx.heads.mtp_head import MTPConfig  # noqa: E402
from gmlx_training.smollm2_data import load_shards  # noqa: E402
from gmlx_training.training import BudgetSchedule, batches, compiled_step  # noqa: E402

SHIP_DIR = SMOLLM2_HEAD
LOG_FILE = "training_log.json"


def draft_vocab(shards: list[dict], n: int, vocab_size: int) -> np.ndarray:
    """The target's choices seen at least twice in the training shards, most frequent first, then
    the lowest ids not yet taken (a byte-level BPE numbers its tokens in merge order, which
    roughly follows frequency in the tokenizer's own corpus), `n` in all."""
    counts = np.bincount(np.concatenate([s["argmax"] for s in shards]), minlength=vocab_size)
    seen = [int(t) for t in np.argsort(-counts, kind="stable") if counts[t] >= 2][:n]
    taken = set(seen)
    fill = [t for t in range(vocab_size) if t not in taken][: n - len(seen)]
    return np.sort(np.array(seen + fill, dtype=np.int32))


def windows(shards: list[dict], seq: int, to_sub: np.ndarray) -> dict[str, np.ndarray]:
    """Each row cut into windows of `seq` positions t (right-padded, masked), with the inputs and
    targets of both depths: h_t, x_{t+1} -> target at t+1; then x_{t+2} -> target at t+2."""
    cols: dict[str, list] = {k: [] for k in ("h0", "x1", "h1", "a1", "x2", "h2", "a2", "m1", "m2", "ans")}
    for s in shards:
        st = s["starts"]
        for r in range(len(st) - 1):
            x, h, a = (s[k][st[r] : st[r + 1]] for k in ("tokens", "hidden", "argmax"))
            n, p = len(x), int(s["prompt_len"][r])
            for w0 in range(0, n - 2, seq):
                idx = np.arange(w0, w0 + seq)

                def at(arr, off):
                    j = np.minimum(idx + off, n - 1)
                    return arr[j]

                cols["h0"].append(at(h, 0))
                cols["x1"].append(at(x, 1))
                cols["h1"].append(at(h, 1))
                cols["a1"].append(to_sub[at(a, 1)])
                cols["x2"].append(at(x, 2))
                cols["h2"].append(at(h, 2))
                cols["a2"].append(to_sub[at(a, 2)])
                cols["m1"].append(idx + 1 < n)
                cols["m2"].append(idx + 2 < n)
                cols["ans"].append(idx + 1 >= p)  # the bonus t+1 is a generated token
    return {k: np.stack(v) for k, v in cols.items()}


def depth_loss(g, h_next, lab, mask, rows, w_hard, w_feat):
    logits = g @ rows.T
    teach = mx.stop_gradient(h_next @ rows.T)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    tlogp = teach - mx.logsumexp(teach, axis=-1, keepdims=True)
    kl = (mx.exp(tlogp) * (tlogp - logp)).sum(-1)
    hard_mask = mask * (lab >= 0)
    ce = nn.losses.cross_entropy(logits, mx.maximum(lab, 0), reduction="none") * hard_mask
    feat = nn.losses.smooth_l1_loss(g, h_next, reduction="none").mean(-1)
    m = mask.sum() + 1e-6
    kl, ce, feat = (kl * mask).sum() / m, ce.sum() / (hard_mask.sum() + 1e-6), (feat * mask).sum() / m
    return kl + w_hard * ce + w_feat * feat, kl


def forward(head, target, b):
    emb, norm = target.embed_tokens, target.final_norm
    g1 = head(emb(b["x1"]), b["h0"], norm)
    g2 = head(emb(b["x2"]), g1, norm)
    return g1, g2


def batch_of(data: dict, idx: np.ndarray) -> dict:
    out = {}
    for k, v in data.items():
        a = mx.array(v[idx])
        out[k] = a.astype(mx.float32) if v.dtype in (np.float16, np.bool_) else a
    return out


def agreement(head, target, rows, val: dict, ids: np.ndarray, chunk: int = 16) -> dict:
    """Teacher-forced rates: head argmax == target argmax at t+2 (depth 1) and t+3 (chained), over
    all held-out positions and over answer positions only; `covered`: targets inside the vocabulary."""
    hits = {k: 0.0 for k in ("t2", "t3", "t2_answer", "t3_answer", "covered")}
    n1 = n2 = n1a = n2a = 0.0
    for i in range(0, len(val["x1"]), chunk):
        b = batch_of(val, np.arange(i, min(i + chunk, len(val["x1"]))))
        g1, g2 = forward(head, target, b)
        for g, lab, m, key in ((g1, b["a1"], b["m1"], "t2"), (g2, b["a2"], b["m2"], "t3")):
            ok = (mx.argmax(g @ rows.T, axis=-1) == lab) * m
            hits[key] += ok.sum().item()  # sync: eval metric
            hits[key + "_answer"] += (ok * b["ans"]).sum().item()  # sync: eval metric
        hits["covered"] += ((b["a1"] >= 0) * b["m1"]).sum().item()  # sync: eval metric
        n1 += b["m1"].sum().item()  # sync: eval metric
        n2 += b["m2"].sum().item()  # sync: eval metric
        n1a += (b["m1"] * b["ans"]).sum().item()  # sync: eval metric
        n2a += (b["m2"] * b["ans"]).sum().item()  # sync: eval metric
    return {"t2": hits["t2"] / n1, "t3": hits["t3"] / n2, "t2_answer": hits["t2_answer"] / n1a,
            "t3_answer": hits["t3_answer"] / n2a, "covered": hits["covered"] / n1, "positions": int(n1)}


def export(head: VocabMTPHead, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    w = {k: (v.astype(mx.float16) if mx.issubdtype(v.dtype, mx.floating) else v)
         for k, v in tree_flatten(head.parameters())}
    mx.save_safetensors(str(out / "mtp_head.safetensors"), w, metadata={"format": "mlx"})
    cfg = {**head.config.to_dict(), VOCAB_KEY: int(head.draft_vocab.shape[0])}
    (out / "mtp_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def keep_best(head: VocabMTPHead, out: Path, curve: list[dict], best: float) -> float:
    """Export when held-out agreement on answers (what serving sees) is the best so far: with
    little data, later epochs may overfit."""
    score = curve[-1]["t2_answer"]
    curve[-1]["exported"] = score > best
    if score > best:
        export(head, out)
    return max(score, best)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, nargs="+", required=True, help="shard directories")
    ap.add_argument("--out", type=Path, default=SHIP_DIR)
    ap.add_argument("--minutes", type=float, default=35.0)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--seq", type=int, default=192)
    ap.add_argument("--batch", type=int, default=12)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--w2", type=float, default=0.0, help="weight of the chained depth-2 loss (0: EAGLE's depth 1 only)")
    ap.add_argument("--w-hard", type=float, default=0.2)
    ap.add_argument("--w-feat", type=float, default=1.0)
    ap.add_argument("--eval-min", type=float, default=6.0)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    mx.random.seed(a.seed)
    target = load(smollm2.converted("float32"), drafter=False).target
    target.model.freeze()
    train_s, val_s = load_shards(a.data, "train"), load_shards(a.data, "val")
    ids = draft_vocab(train_s, a.vocab, target.vocab_size)
    to_sub = np.full(target.vocab_size, -1, dtype=np.int32)
    to_sub[ids] = np.arange(len(ids), dtype=np.int32)
    train, val = windows(train_s, a.seq, to_sub), windows(val_s, a.seq, to_sub)
    n_train = int(train["m1"].sum())
    print(f"train {n_train:,} positions in {len(train['x1'])} windows; val {int(val['m1'].sum()):,}", flush=True)

    c = target.model.args
    cfg = MTPConfig(hidden_size=c.hidden_size, intermediate_size=a.ffn, num_attention_heads=c.num_attention_heads,
                    num_key_value_heads=c.num_key_value_heads, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
                    max_position_embeddings=c.max_position_embeddings)
    head = VocabMTPHead(cfg, len(ids))
    head.draft_vocab = mx.array(ids)
    head.freeze(keys=["draft_vocab"], recurse=False)
    rows = lm_head_rows(target, head.draft_vocab)
    mx.eval(head.parameters(), rows)  # sync: materialise the initial weights

    def loss_fn(b):
        g1 = head(target.embed_tokens(b["x1"]), b["h0"], target.final_norm)
        l1, kl1 = depth_loss(g1, b["h1"], b["a1"], b["m1"], rows, a.w_hard, a.w_feat)
        if a.w2 == 0:
            return l1, (kl1, kl1)
        g2 = head(target.embed_tokens(b["x2"]), g1, target.final_norm)
        l2, kl2 = depth_loss(g2, b["h2"], b["a2"], b["m2"], rows, a.w_hard, a.w_feat)
        return l1 + a.w2 * l2, (kl1, kl2)

    opt, step_fn, state = compiled_step(head, loss_fn, a.lr)
    sched = BudgetSchedule(a.lr, a.warmup, 2000)
    rng = np.random.default_rng(a.seed)
    curve = [{"min": 0.0, "step": 0, **agreement(head, target, rows, val, ids)}]
    print(f"init {curve[-1]}", flush=True)
    t0, step, next_eval = time.time(), 0, a.eval_min * 60
    best = -1.0
    draws = batches(len(train["x1"]), a.batch, rng)
    while time.time() - t0 < a.minutes * 60:
        idx = next(draws)
        opt.learning_rate = sched(step)
        loss, parts = step_fn(batch_of(train, idx))
        mx.eval(loss, parts, state)  # sync: one training step
        step += 1
        el = time.time() - t0
        if step == 10:
            sched.reestimate(step, el, a.minutes * 60)
        if step % 20 == 0:
            print(f"step {step} {el / 60:.1f} min loss {loss.item():.3f} kl {parts[0].item():.3f}"  # sync: log
                  f" {parts[1].item():.3f} lr {sched(step):.1e}", flush=True)  # sync: log
        if el >= next_eval or el >= a.minutes * 60:
            next_eval += a.eval_min * 60
            curve.append({"min": el / 60, "step": step, **agreement(head, target, rows, val, ids)})
            print(f"eval {curve[-1]}", flush=True)
            best = keep_best(head, a.out, curve, best)
    wall = time.time() - t0
    if curve[-1]["step"] != step:
        curve.append({"min": wall / 60, "step": step, **agreement(head, target, rows, val, ids)})
        best = keep_best(head, a.out, curve, best)
    log = {"args": {k: str(v) for k, v in vars(a).items()}, "steps": step, "wall_min": wall / 60, "best_t2_answer": best,
           "positions_per_epoch": n_train, "epochs": step * a.batch / len(train["x1"]),
           "vocab_coverage_val": curve[-1]["covered"], "curve": curve}
    (a.out / LOG_FILE).write_text(json.dumps(log, indent=1) + "\n")
    print(f"done: {log['steps']} steps, {log['epochs']:.2f} epochs, final {curve[-1]}", flush=True)


if __name__ == "__main__":
    main()
