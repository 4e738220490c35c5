"""Train the embedded default model: a small llama on the Python standard library, with an MTP head.

Run: ``python -m gmlx_training.train_default --minutes 90 --out gmlx/weights/default_model``

Corpus and tokenizer: gmlx_training/stdlib_corpus.py (the standard library's ``.py`` files,
every 20th held out; byte-level BPE, vocab 2048). Model: mlx-lm ``llama`` with tied embeddings.
Loss = CE(next token) + w1 * CE(token t+2 through the MTP head on the target's hidden)
+ w2 * CE(token t+3 through the head chained on its own hidden), so the head also learns to draft
from its own output, as it does at k >= 2.

The output directory is an mlx-lm model directory (``mlx_lm.load`` loads it) plus
``mtp_head.safetensors`` / ``mtp_config.json`` and ``MODEL_CARD.md``.
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
import mlx.nn as nn  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.models import llama  # noqa: E402

from gmlx_training.training import BudgetSchedule, compiled_step  # noqa: E402
from gmlx_training.model_card import EOS, machine_line, model_card  # noqa: E402
from gmlx_training.stdlib_corpus import (  # noqa: E402
    batches, corpus_files, encode_all, read, split_files, train_tokenizer)
from gmlx.heads.mtp_head import MTPConfig, MTPHead  # noqa: E402


class Joint(nn.Module):
    """Target + head, so one optimizer and one compiled step cover both."""

    def __init__(self, target: llama.Model, head: MTPHead):
        super().__init__()
        self.target = target
        self.head = head

    def losses(self, x: mx.array, w1: float, w2: float):
        # x: [B, S+3]; target reads x[:, :N] with N = S+2.
        inp = x[:, :-1]
        embed = self.target.model.embed_tokens
        norm = self.target.model.norm
        hid = self.target.model(inp)  # [B, N, D], after final norm
        lm = embed.as_linear
        ce0 = nn.losses.cross_entropy(lm(hid), x[:, 1:], reduction="mean")
        # depth 1: position i sees h_i and token i+1, predicts i+2
        g1 = self.head(embed(x[:, 1:-1]), hid[:, :-1], norm)  # [B, N-1, D]
        ce1 = nn.losses.cross_entropy(lm(g1), x[:, 2:], reduction="mean")
        # depth 2: chained on the head's own hidden, predicts i+3
        g2 = self.head(embed(x[:, 2:-1]), g1[:, :-1], norm)  # [B, N-2, D]
        ce2 = nn.losses.cross_entropy(lm(g2), x[:, 3:], reduction="mean")
        return ce0 + w1 * ce1 + w2 * ce2, (ce0, ce1, ce2)


def evaluate(joint: Joint, val: np.ndarray, seq: int, n: int = 24) -> dict:
    """Validation CE of the target, and the head's teacher-forced greedy agreement with the
    target's own argmax at the same position (what acceptance of a first draft needs)."""
    span = seq + 3
    rng = np.random.default_rng(1234)
    starts = rng.integers(0, len(val) - span, size=n)
    ce, agree, top1, count = 0.0, 0, 0, 0
    for s in starts:
        x = mx.array(val[s : s + span][None])
        inp = x[:, :-1]
        tm = joint.target.model
        hid = tm(inp)
        logits = tm.embed_tokens.as_linear(hid)
        ce += nn.losses.cross_entropy(logits, x[:, 1:], reduction="mean").item()  # sync: eval metric
        g1 = joint.head(tm.embed_tokens(x[:, 1:-1]), hid[:, :-1], tm.norm)
        head_pred = mx.argmax(tm.embed_tokens.as_linear(g1), axis=-1)  # predicts positions 2..N
        tgt_pred = mx.argmax(logits, axis=-1)[:, 1:]  # target's prediction for the same positions
        agree += (head_pred == tgt_pred).sum().item()  # sync: eval metric
        top1 += (mx.argmax(logits, axis=-1) == x[:, 1:]).sum().item()  # sync: eval metric
        count += head_pred.size
    return {"val_ce": ce / n, "head_agreement": agree / count, "target_top1": top1 / (n * (span - 1))}


def step_costs(target: llama.Model, head: MTPHead, reps: int = 200) -> dict:
    """Median wall time of one target decode step and one head step at batch 1 with KV caches."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    cache = make_prompt_cache(target)
    hcache = KVCache()
    tm = target.model
    prompt = mx.zeros((1, 64), dtype=mx.int32)
    hid = tm(prompt, cache=cache)
    head(tm.embed_tokens(prompt), hid, tm.norm, cache=hcache)
    mx.eval([c.state for c in cache], hcache.state)  # sync: warm-up prefill
    tok = mx.array([[1]])

    def time_it(fn):
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            mx.eval(fn())  # sync: timing one step
            ts.append(time.perf_counter() - t0)
        return float(np.median(ts))

    t_target = time_it(lambda: tm.embed_tokens.as_linear(tm(tok, cache=cache)))
    h1 = hid[:, -1:]
    t_head = time_it(lambda: tm.embed_tokens.as_linear(head(tm.embed_tokens(tok), h1, tm.norm, cache=hcache)))
    return {"target_step_ms": t_target * 1e3, "head_step_ms": t_head * 1e3, "head_cost_ratio": t_head / t_target}


def export(final_out: Path, joint: Joint, args_dict: dict, mtp_cfg: MTPConfig, tok, card: str) -> None:
    """Write the model directory beside the destination, then swap it in, so readers never see half."""
    import shutil

    out = final_out.with_name(final_out.name + ".tmp")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    weights = dict(tree_flatten(joint.target.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    head_w = dict(tree_flatten(joint.head.parameters()))
    mx.save_safetensors(str(out / "mtp_head.safetensors"), head_w, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(args_dict, indent=2) + "\n")
    (out / "mtp_config.json").write_text(json.dumps(mtp_cfg.to_dict(), indent=2) + "\n")
    tok.save(str(out / "tokenizer.json"))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS,
        "bos_token": None,
        "model_max_length": args_dict["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps({"eos_token": EOS}, indent=2) + "\n")
    (out / "MODEL_CARD.md").write_text(card)
    old = final_out.with_name(final_out.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if final_out.exists():
        final_out.rename(old)
    out.rename(final_out)
    shutil.rmtree(old, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--minutes", type=float, default=90.0, help="wall-clock training budget")
    ap.add_argument("--export-every", type=float, default=0.0, help="also export every N minutes")
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--mlp", type=int, default=768)
    ap.add_argument("--head-mlp", type=int, default=512)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--w1", type=float, default=0.5)
    ap.add_argument("--w2", type=float, default=0.25)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)

    t_start = time.time()
    random.seed(a.seed)
    np.random.seed(a.seed)
    mx.random.seed(a.seed)
    files = corpus_files()
    train_f, val_f = split_files(files)
    train_texts = [read(f) for f in train_f]
    val_texts = [read(f) for f in val_f]
    tok = train_tokenizer(train_texts, a.vocab)
    train_ids = encode_all(tok, train_texts)
    val_ids = encode_all(tok, val_texts)
    print(f"corpus: {len(files)} files, train {len(train_ids):,} tok, val {len(val_ids):,} tok"
          f" ({time.time() - t_start:.0f}s)", flush=True)

    cfg = {
        "model_type": "llama",
        "hidden_size": a.hidden,
        "num_hidden_layers": a.layers,
        "intermediate_size": a.mlp,
        "num_attention_heads": a.heads,
        "num_key_value_heads": a.kv_heads,
        "rms_norm_eps": 1e-5,
        "vocab_size": tok.get_vocab_size(),
        "max_position_embeddings": 1024,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "eos_token_id": tok.token_to_id(EOS),
        "speculative_width_cap": 4,
        "num_draft_tokens": 3,
    }
    target = llama.Model(llama.ModelArgs.from_dict(cfg))
    mtp_cfg = MTPConfig(hidden_size=a.hidden, intermediate_size=a.head_mlp, num_attention_heads=a.heads,
                        num_key_value_heads=a.kv_heads, max_position_embeddings=1024)
    head = MTPHead(mtp_cfg)
    joint = Joint(target, head)
    n_target = sum(v.size for _, v in tree_flatten(target.parameters()))
    n_head = sum(v.size for _, v in tree_flatten(head.parameters()))
    print(f"params: target {n_target / 1e6:.2f} M, head {n_head / 1e6:.2f} M", flush=True)

    budget_s = a.minutes * 60
    tok_per_step = a.batch * (a.seq + 2)
    # The schedule is laid over an estimated step count; re-estimated after warm-up timing.
    lr_at = BudgetSchedule(a.lr, a.warmup, max(200, int(budget_s * 1300 / tok_per_step)))
    opt, step_fn, state = compiled_step(joint, lambda x: joint.losses(x, a.w1, a.w2), a.lr)

    rng = np.random.default_rng(a.seed)
    it = batches(train_ids, a.batch, a.seq, rng)
    t_train = time.time()
    last_export = t_train
    step = 0
    parts_v = (0.0, 0.0, 0.0)
    run: dict = {}

    def do_export(final: bool):
        wall = time.time() - t_train
        metrics = evaluate(joint, val_ids, a.seq)
        costs = step_costs(target, head)
        run.update(
            num_files=len(files), train_tokens=len(train_ids), val_tokens=len(val_ids), seq=a.seq,
            batch=a.batch, lr=a.lr, warmup=a.warmup, w1=a.w1, w2=a.w2, steps=step,
            tokens_seen=step * tok_per_step, wall_min=wall / 60, tok_per_s=step * tok_per_step / max(wall, 1e-9),
            machine=machine_line(), params_target=n_target, params_head=n_head,
            last_ce0=parts_v[0], last_ce1=parts_v[1], last_ce2=parts_v[2],
        )
        card = model_card(cfg, mtp_cfg, run, metrics, costs)
        export(a.out, joint, cfg, mtp_cfg, tok, card)
        (a.out / "training_log.json").write_text(json.dumps({"run": run, "metrics": metrics, "costs": costs,
                                                             "final": final}, indent=2) + "\n")
        print(f"export step {step}: {metrics} {costs}", flush=True)

    while time.time() - t_train < budget_s:
        opt.learning_rate = lr_at(step)
        loss, parts = step_fn(next(it))
        mx.eval(loss, parts, state)  # sync: one training step
        step += 1
        if step == 20:
            print(f"estimated steps: {lr_at.reestimate(step, time.time() - t_train, budget_s)}", flush=True)
        if step % 25 == 0:
            parts_v = tuple(p.item() for p in parts)  # sync: progress log
            el = time.time() - t_train
            print(f"step {step} {el / 60:.1f}min loss {loss.item():.3f} ce {parts_v[0]:.3f}"  # sync: log
                  f" h1 {parts_v[1]:.3f} h2 {parts_v[2]:.3f} lr {lr_at(step):.2e}"
                  f" {step * tok_per_step / el:.0f} tok/s", flush=True)
        if a.export_every and time.time() - last_export > a.export_every * 60:
            do_export(final=False)
            last_export = time.time()
    parts_v = tuple(p.item() for p in parts)  # sync: final losses
    do_export(final=True)


if __name__ == "__main__":
    main()
