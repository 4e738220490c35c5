"""Train an EAGLE-3 head for SmolLM2-135M-Instruct, with training-time test, on self-distillation data.

Run: ``nice -n 5 python -m gmlx_training.train_smollm2_eagle3 --data DIR --minutes 60 [--init DIR]``
(DIR from ``python -m gmlx_training.smollm2_data --aux``: the frozen fp32 target's answers with its
post-norm hidden states and the residual streams entering layers 2, 15 and 27).

The head is `gmlx.heads.eagle3_head.Eagle3Model` and is written in EAGLE-3's public checkpoint
layout (`gmlx/heads/eagle3_checkpoint.py`), so `--drafter eagle3 --draft-model DIR` loads it:

    g_1(t) = layer(embed(x_{t+1}), fc(a_low, a_mid, a_high)(t))       drafts x_{t+2}
    g_d(t) = layer(embed(x_{t+d}), g_{d-1}(t))                          drafts x_{t+1+d}, chained

scored as norm(g) @ E_v^T, E_v the target's LM-head rows of a reduced draft vocabulary (`--vocab`
ids the target chose most often; `d2t` maps them), which the checkpoint does not store.

Training-time test (EAGLE-3): depth d > 1 is trained on the head's own output g_{d-1}, as drafting
runs it, and its attention sees what the drafting cache holds at that step: the depth-1 keys of
positions <= t (what verify wrote) and the keys the chain itself wrote at t (one per earlier depth),
at RoPE position t + d - 1. Loss per depth, weighted 0.8^(d-1) (EAGLE-3's decay):

    KL(softmax(h_{t+d} E_v^T) || softmax(norm(g_d) E_v^T)) + w_hard CE(norm(g_d) E_v^T, target's choice)

(h: the target's post-norm hidden, so its logits over E_v are free). Held-out agreement per depth
and the chain's accepted length (teacher-forced) are logged every `--eval-min` minutes; the head
is exported (float16) whenever its accepted length on answer positions is the best so far.
`--init DIR` continues from a checkpoint this script wrote (the same draft vocabulary).
`--model embedded` trains one for gmlx's embedded default model instead (data from
``smollm2_data --model embedded --aux``; written to `gmlx/weights/default_model/eagle3`).
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

from gmlx.heads.draft_vocab import lm_head_rows  # noqa: E402
from gmlx.heads.eagle3_checkpoint import layer_args, read_weights  # noqa: E402
from gmlx.heads.eagle3_head import Eagle3Model  # noqa: E402
from gmlx.heads.eagle3_streams import layers_entering  # noqa: E402
from gmlx.models.loading import load  # noqa: E402
from gmlx.weights import EMBEDDED_EAGLE3, SMOLLM2_EAGLE3  # noqa: E402
from gmlx_training.smollm2_data import load_shards, target_model  # noqa: E402
from gmlx_training.train_smollm2_head import draft_vocab  # noqa: E402
from gmlx_training.training import BudgetSchedule, batches, compiled_step  # noqa: E402

LOG_FILE = "training_log.json"


def shard_kinds(dirs: list[Path], split: str) -> list[str]:
    """Each shard's prompt kind ("code", "chat", "corpus"; "?" where its run left no log), in
    `load_shards`' order: a data run's `data_log.json` lists its batches in the order they became
    shards."""
    kinds = []
    for d in dirs:
        log = Path(d) / "data_log.json"
        said = [b["kind"] for b in json.loads(log.read_text())["batches"] if b["split"] == split] if log.exists() else []
        n = len(list(Path(d).glob(f"{split}-*.npz")))
        kinds += [said[i] if i < len(said) else "?" for i in range(n)]
    return kinds


def windows(shards: list[dict], seq: int, depths: int, to_sub: np.ndarray,
            kinds: list[str] | None = None) -> dict[str, np.ndarray]:
    """Each row cut into windows of `seq` positions t, with `depths` more tokens after them;
    `chat`: the window's row answered a chat prompt (`kinds`: each shard's)."""
    span = seq + depths
    cols: dict[str, list] = {k: [] for k in ("aux", "x", "h", "a", "valid", "ans", "chat")}
    for i, s in enumerate(shards):
        chat = kinds is not None and kinds[i] == "chat"
        st = s["starts"]
        for r in range(len(st) - 1):
            lo, n, p = int(st[r]), int(st[r + 1] - st[r]), int(s["prompt_len"][r])
            for w0 in range(0, n - 2, seq):
                j = np.minimum(np.arange(w0, w0 + span), n - 1)
                cols["aux"].append(s["aux"][lo + j[:seq]])
                cols["x"].append(s["tokens"][lo + j])
                cols["h"].append(s["hidden"][lo + j])
                cols["a"].append(to_sub[s["argmax"][lo + j]])
                cols["valid"].append(np.arange(w0, w0 + span) < n)
                cols["ans"].append(np.arange(w0, w0 + seq) + 1 >= p)  # x_{t+1} was generated
                cols["chat"].append(np.full(seq, chat))
    return {k: np.stack(v) for k, v in cols.items()}


def batch_of(data: dict, idx: np.ndarray) -> dict:
    return {k: (mx.array(v[idx]).astype(mx.float32) if v.dtype in (np.float16, np.bool_) else mx.array(v[idx]))
            for k, v in data.items()}


def _qkv(attn, x: mx.array, offset: int):
    B, L, _ = x.shape
    q = attn.q_proj(x).reshape(B, L, attn.n_heads, -1).transpose(0, 2, 1, 3)
    k = attn.k_proj(x).reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    v = attn.v_proj(x).reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    return attn.rope(q, offset=offset), attn.rope(k, offset=offset), v


def unroll(model: Eagle3Model, embed, b: dict, depths: int) -> list[mx.array]:
    """g_1 .. g_depths [B, S, H] (module docstring): the layer of eagle3_head.Eagle3Layer, written
    out so that depth d's queries see depth 1's keys causally and each earlier depth's key at t."""
    layer, attn = model.midlayer, model.midlayer.self_attn
    S = b["aux"].shape[1]
    hidden = model.fc(b["aux"])
    causal = mx.tril(mx.ones((S, S), dtype=mx.bool_))
    diag = mx.eye(S, dtype=mx.bool_)
    keys, values, out = [], [], []
    for d in range(depths):
        h = layer.hidden_norm(hidden)
        residual = h if layer.norm_before_residual else hidden
        x = mx.concatenate([layer.input_layernorm(embed(b["x"][:, 1 + d : 1 + d + S])), h], axis=-1)
        q, k, v = _qkv(attn, x, d)
        keys.append(k)
        values.append(v)
        mask = mx.concatenate([causal] + [diag] * d, axis=1)
        o = mx.fast.scaled_dot_product_attention(q, mx.concatenate(keys, axis=2), mx.concatenate(values, axis=2),
                                                 scale=attn.scale, mask=mask)
        r = attn.o_proj(o.transpose(0, 2, 1, 3).reshape(*x.shape[:2], -1)) + residual
        hidden = layer.mlp(layer.post_attention_layernorm(r)) + r
        out.append(hidden)
    return out


def depth_terms(model, g, b, d: int, rows: mx.array):
    """(KL, CE, mask) at depth d (1-based): the head drafts x_{t+1+d}; the target's view is h_{t+d}."""
    S = g.shape[1]
    logits = model.norm(g) @ rows.T
    teach = mx.stop_gradient(b["h"][:, d : d + S] @ rows.T)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    tlogp = teach - mx.logsumexp(teach, axis=-1, keepdims=True)
    lab = b["a"][:, d : d + S]
    mask = b["valid"][:, d : d + S]
    kl = (mx.exp(tlogp) * (tlogp - logp)).sum(-1) * mask
    hard = mask * (lab >= 0)
    ce = nn.losses.cross_entropy(logits, mx.maximum(lab, 0), reduction="none") * hard
    return kl.sum() / (mask.sum() + 1e-6), ce.sum() / (hard.sum() + 1e-6), logits, lab, mask


def agreement(model, embed, rows, val: dict, depths: int, chunk: int = 8) -> dict:
    """Teacher-forced: per depth, the head's argmax == the target's; `accept`: the mean accepted
    length of a depths-long chain (drafts up to the first miss), all positions and answers only,
    and answers to chat prompts and to the others (code) apart."""
    hit = np.zeros(depths)
    n = np.zeros(depths)
    acc = acc_a = pos = pos_a = acc_c = pos_c = 0.0
    for i in range(0, len(val["x"]), chunk):
        b = batch_of(val, np.arange(i, min(i + chunk, len(val["x"]))))
        run = None
        for d, g in enumerate(unroll(model, embed, b, depths), start=1):
            _, _, logits, lab, mask = depth_terms(model, g, b, d, rows)
            ok = (mx.argmax(logits, axis=-1) == lab) * mask
            hit[d - 1] += ok.sum().item()  # sync: eval metric
            n[d - 1] += mask.sum().item()  # sync: eval metric
            run = ok if run is None else run * ok
            ans = b["ans"] * b["valid"][:, 1 : 1 + ok.shape[1]]
            acc += run.sum().item()  # sync: eval metric
            acc_a += (run * ans).sum().item()  # sync: eval metric
            acc_c += (run * ans * b["chat"]).sum().item()  # sync: eval metric
        pos += b["valid"][:, 1 : 1 + ok.shape[1]].sum().item()  # sync: eval metric
        pos_a += ans.sum().item()  # sync: eval metric
        pos_c += (ans * b["chat"]).sum().item()  # sync: eval metric
    by_kind = {"accept_chat": acc_c / pos_c} if pos_c else {}
    if pos_c and pos_a > pos_c:
        by_kind["accept_code"] = (acc_a - acc_c) / (pos_a - pos_c)
    return {**{f"t{d + 2}": hit[d] / n[d] for d in range(depths)}, "accept": acc / pos,
            "accept_answer": acc_a / pos_a, **by_kind, "positions": int(pos)}


def config_json(target, ffn: int, vocab: int, entering: tuple[int, ...]) -> dict:
    c = target.model.args
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
            "hidden_size": c.hidden_size, "intermediate_size": ffn, "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads, "head_dim": c.hidden_size // c.num_attention_heads,
            "num_hidden_layers": 1, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
            "max_position_embeddings": c.max_position_embeddings, "vocab_size": target.vocab_size,
            "draft_vocab_size": vocab, "target_hidden_size": c.hidden_size, "tie_word_embeddings": False,
            "eagle_aux_hidden_state_layer_ids": [i - 1 for i in entering], "torch_dtype": "float16"}


def export(model: Eagle3Model, cfg: dict, ids: np.ndarray, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    w = {k: v.astype(mx.float16) for k, v in tree_flatten(model.parameters())}
    w["d2t"] = mx.array(ids.astype(np.int64) - np.arange(len(ids)))
    t2d = np.zeros(cfg["vocab_size"], dtype=np.bool_)
    t2d[ids] = True
    w["t2d"] = mx.array(t2d)
    mx.save_safetensors(str(out / "model.safetensors"), w, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, nargs="+", required=True, help="shard directories (with aux)")
    ap.add_argument("--model", choices=("smollm2", "embedded"), default="smollm2")
    ap.add_argument("--out", type=Path, help="default: the shipped head's directory for --model")
    ap.add_argument("--init", type=Path, help="continue from this checkpoint (its draft vocabulary)")
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--ffn", type=int, default=1536)
    ap.add_argument("--depths", type=int, default=3)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--w-hard", type=float, default=0.1)
    ap.add_argument("--eval-min", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    mx.random.seed(a.seed)
    a.out = a.out or (SMOLLM2_EAGLE3 if a.model == "smollm2" else EMBEDDED_EAGLE3)
    target = target_model(a.model).target
    target.model.freeze()
    train_s, val_s = load_shards(a.data, "train"), load_shards(a.data, "val")
    if a.init:
        d2t = np.array(read_weights(a.init)["d2t"])
        ids = (np.arange(len(d2t)) + d2t).astype(np.int32)
    else:
        ids = draft_vocab(train_s, a.vocab, target.vocab_size)
    to_sub = np.full(target.vocab_size, -1, dtype=np.int32)
    to_sub[ids] = np.arange(len(ids), dtype=np.int32)
    train = windows(train_s, a.seq, a.depths, to_sub)
    val = windows(val_s, a.seq, a.depths, to_sub, shard_kinds(a.data, "val"))
    del train_s, val_s
    print(f"train {int(train['valid'][:, 1:].sum()):,} positions in {len(train['x'])} windows;"
          f" val {int(val['valid'][:, 1:].sum()):,}", flush=True)

    entering = layers_entering({}, target.num_layers)
    cfg = config_json(target, a.ffn, len(ids), entering)
    model = Eagle3Model(layer_args(cfg), cfg["target_hidden_size"], len(ids), len(entering), own_lm_head=False)
    if a.init:
        w = read_weights(a.init)
        model.load_weights([(k, v) for k, v in w.items() if k not in ("d2t", "t2d")])
    else:
        model.norm.weight = mx.array(target.final_norm.weight)  # start in the target's output space
    model.set_dtype(mx.float32, lambda d: mx.issubdtype(d, mx.floating))
    rows = lm_head_rows(target, mx.array(ids))
    embed = target.embed_tokens
    mx.eval(model.parameters(), rows)  # sync: materialise the initial weights

    def loss_fn(b):
        total, kls = 0.0, []
        for d, g in enumerate(unroll(model, embed, b, a.depths), start=1):
            kl, ce, *_ = depth_terms(model, g, b, d, rows)
            total = total + 0.8 ** (d - 1) * (kl + a.w_hard * ce)
            kls.append(kl)
        return total, mx.stack(kls)

    opt, step_fn, state = compiled_step(model, loss_fn, a.lr)
    sched = BudgetSchedule(a.lr, a.warmup, 2000)
    rng = np.random.default_rng(a.seed)
    curve = [{"min": 0.0, "step": 0, **agreement(model, embed, rows, val, a.depths)}]
    print(f"init {curve[-1]}", flush=True)
    t0, step, next_eval, best = time.time(), 0, a.eval_min * 60, -1.0

    def evaluate(el: float) -> None:
        nonlocal best
        curve.append({"min": el / 60, "step": step, **agreement(model, embed, rows, val, a.depths)})
        curve[-1]["exported"] = curve[-1]["accept_answer"] > best
        if curve[-1]["exported"]:
            best = curve[-1]["accept_answer"]
            export(model, cfg, ids, a.out)
        print(f"eval {curve[-1]}", flush=True)
        (a.out / LOG_FILE).write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "steps": step,
                                                  "wall_min": el / 60, "best_accept_answer": best,
                                                  "windows": len(train["x"]), "curve": curve}, indent=1) + "\n")

    draws = batches(len(train["x"]), a.batch, rng)
    while time.time() - t0 < a.minutes * 60:
        idx = next(draws)
        opt.learning_rate = sched(step)
        loss, kls = step_fn(batch_of(train, idx))
        mx.eval(loss, kls, state)  # sync: one training step
        step += 1
        el = time.time() - t0
        if step == 10:
            sched.reestimate(step, el, a.minutes * 60)
        if step % 25 == 0:
            print(f"step {step} {el / 60:.1f} min loss {loss.item():.3f} kl {np.round(np.array(kls), 3)}"  # sync: log
                  f" lr {sched(step):.1e}", flush=True)
        if el >= next_eval:
            next_eval += a.eval_min * 60
            evaluate(el)
    evaluate(time.time() - t0)
    print(f"done: {step} steps, {step * a.batch / len(train['x']):.2f} epochs, best accept {best:.3f}", flush=True)


if __name__ == "__main__":
    main()
