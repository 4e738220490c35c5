"""Train the embedded model's two extra drafters against the frozen target: a tiny draft model and a
KV-sharing assistant head.

Run: ``python -m gmlx_training.train_drafters --minutes-draft 12 --minutes-assistant 12 --out gmlx/weights/default_model``

Corpus and split: those of `gmlx_training.train_default` (`gmlx_training.stdlib_corpus`: the same
files, the same held-out set), encoded with the *shipped* tokenizer, so the drafters speak the
target's vocabulary.

- Draft model (``<out>/draft/``, a complete mlx-lm directory with the target's tokenizer): the
  target's embeddings, first `--draft-layers` blocks and final norm, fine-tuned as a model of its
  own. The truncated target already agrees with the full one (about 42% at 2 layers, untrained), which
  training from scratch did not reach in this budget. Loss: CE on the data; `--draft-alpha` mixes in
  CE against the target's softmax, which costs a target forward per step (about twice the step).
- Assistant head (``<out>/assistant_*``, see `gmlx.heads.assistant_head`): trained on the frozen
  target's hidden states and layer-`kv_layer` K/V with alpha * CE(target's softmax) + (1 - alpha) *
  CE(data) at depth 1 (token t+2; the teacher is the target's logits at t+1, free from the same
  forward) plus w2 times the same at depth 2 (t+3, chained on its own output, same keys) and w3 at
  depth 3 (t+4; the third draft of a K = 3 round, EAGLE-3's training-time test). It starts from the
  MTP head (see `init_from_mtp`), or with `--resume-assistant` from the shipped head, so every
  further run adds to it (the log keeps each run; `--checkpoint DIR` saves the head as it trains).

A phase given 0 minutes keeps the shipped drafter and only re-measures it. Retraining the target
(`train_default`) replaces the whole directory and so drops these drafters, as it must: they are
fitted to one target.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from gmlx import blas

blas.ensure_loaded()

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx_lm  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten, tree_map  # noqa: E402
from mlx_lm.models import llama  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from gmlx.data import load_prompts  # noqa: E402
from gmlx.heads.assistant_head import (  # noqa: E402
    AssistantConfig,
    AssistantHead,
    causal_key_mask,
    load_assistant,
    save_assistant,
)
from gmlx_training.drafter_eval import agreement, greedy_acceptance, step_costs  # noqa: E402
from gmlx.models.loading import load  # noqa: E402
from gmlx_training.model_card import machine_line, with_drafters_section  # noqa: E402
from gmlx_training.training import BudgetSchedule, compiled_step  # noqa: E402
from gmlx_training.stdlib_corpus import batches, corpus_files, encode_all, read, split_files  # noqa: E402

DRAFT_DIR = "draft"
GMLX_KEYS = ("speculative_width_cap", "num_draft_tokens")  # the target's engine defaults, not a draft's
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
LOG_FILE = "drafters_log.json"


def mixed_ce(logits: mx.array, teacher: mx.array, labels: mx.array, alpha: float) -> tuple[mx.array, mx.array]:
    """alpha * CE against the teacher's softmax + (1 - alpha) * CE against the data; also the data CE."""
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    soft = -(mx.softmax(teacher, axis=-1) * logp).sum(axis=-1).mean()
    hard = nn.losses.cross_entropy(logits, labels, reduction="mean")
    return alpha * soft + (1 - alpha) * hard, hard


def truncated_target(target, target_cfg: dict, layers: int) -> tuple[llama.Model, dict]:
    """The target's embeddings, first `layers` blocks and final norm as a model of its own."""
    cfg = {k: v for k, v in target_cfg.items() if k not in GMLX_KEYS}
    cfg["num_hidden_layers"] = layers
    draft = llama.Model(llama.ModelArgs.from_dict(cfg))
    b = target.backbone
    weights = {"embed_tokens": b.embed_tokens.parameters(), "norm": b.norm.parameters(),
               "layers": [layer.parameters() for layer in b.layers[:layers]]}
    # Copies, so training the draft can never alias the frozen target's arrays.
    draft.update({"model": tree_map(mx.array, weights)})
    mx.eval(draft.parameters())  # sync: materialise the initial weights
    return draft, cfg


def fit(module: nn.Module, loss_fn, data: np.ndarray, a, minutes: float, lr: float, label: str,
        checkpoint=None) -> dict:
    """AdamW with warm-up then cosine to 10% over the steps the wall-clock budget allows;
    `checkpoint()` (if given) every 100 steps, so a run cut short keeps what it learned."""
    opt, step_fn, state = compiled_step(module, loss_fn, lr)
    tok_per_step = a.batch * (a.seq + 2)
    lr_at = BudgetSchedule(lr, a.warmup, max(a.warmup + 50, int(minutes * 60 * 1000 / tok_per_step)))

    it = batches(data, a.batch, a.seq, np.random.default_rng(a.seed))
    t0, step, parts = time.time(), 0, ()
    while time.time() - t0 < minutes * 60:
        opt.learning_rate = lr_at(step)
        loss, parts = step_fn(next(it))
        mx.eval(loss, parts, state)  # sync: one training step
        step += 1
        if step == 20:
            lr_at.reestimate(step, time.time() - t0, minutes * 60)
        if checkpoint is not None and step % 100 == 0:
            checkpoint()
        if step % 25 == 0:
            vals = [p.item() for p in parts]  # sync: progress log
            el = time.time() - t0
            print(f"{label} step {step} {el / 60:.1f}min loss {loss.item():.3f} parts"  # sync: progress log
                  f" {' '.join(f'{v:.3f}' for v in vals)} lr {lr_at(step):.2e} {step * tok_per_step / el:.0f} tok/s",
                  flush=True)
    wall = time.time() - t0
    last = [p.item() for p in parts]  # sync: final losses
    return {"steps": step, "tokens_seen": step * tok_per_step, "wall_min": wall / 60,
            "tok_per_s": step * tok_per_step / max(wall, 1e-9), "lr": lr, "last_losses": last}


def train_draft(target, target_cfg: dict, data: np.ndarray, a) -> tuple[llama.Model, dict, dict]:
    draft, cfg = truncated_target(target, target_cfg, a.draft_layers)

    def loss_fn(x):
        inp, labels = x[:, :-1], x[:, 1:]
        if a.draft_alpha == 0:  # data CE only: no target forward, half the step cost
            ce = nn.losses.cross_entropy(draft(inp), labels, reduction="mean")
            return ce, (ce,)
        teacher = mx.stop_gradient(target.lm_head(target.backbone(inp)))
        loss, ce = mixed_ce(draft(inp), teacher, labels, a.draft_alpha)
        return loss, (ce,)

    run = fit(draft, loss_fn, data, a, a.minutes_draft, a.draft_lr, "draft")
    return draft, cfg, {**run, "alpha": a.draft_alpha, "init": f"target layers 0..{a.draft_layers - 1}"}


def init_from_mtp(head: AssistantHead, mtp) -> None:
    """Start from the MTP head's weights that mean the same thing here, with o_proj at zero: its
    attention read the head's own keys, so through the target's K/V its output is noise (15.7%
    agreement at t+2 when copied). From zero the head begins as the MTP head without attention
    (45.6%) and training grows the attention path."""
    layer = mtp.layer
    head.update(tree_map(mx.array, {
        "embed_norm": mtp.embed_norm.parameters(), "hidden_norm": mtp.hidden_norm.parameters(),
        "fc": mtp.fc.parameters(), "attn_norm": layer.input_layernorm.parameters(),
        "q_proj": layer.self_attn.q_proj.parameters(), "mlp_norm": layer.post_attention_layernorm.parameters(),
        "mlp": layer.mlp.parameters(),
    }))
    head.o_proj.weight = mx.zeros_like(head.o_proj.weight)


def assistant_unroll(head: AssistantHead, target, x: mx.array, depths: int) -> tuple[mx.array, list[mx.array]]:
    """The head as the engine drafts, teacher-forced over one window x [B, N+1] (target frozen):
    (the target's logits [B, N, V], row i predicting token i+1; [g_1 .. g_depths]), g_d [B, N-d, D]
    row i the head's output at depth d from position i (predicting token i+1+d). Depth 1 reads
    (x_{i+1}, h_i); depth d > 1 chains on the previous depth's output and the true token x_{i+d}
    (the draft when it was right), with its query at i+d; every depth reads the keys 0..i."""
    B, N = x.shape[0], x.shape[1] - 1
    cache = make_prompt_cache(target.model)
    hid = target.backbone(x[:, :N], cache=cache)
    kv = cache[head.config.kv_layer]
    keys, values = kv.keys[:, :, :N], kv.values[:, :, :N]
    hid, keys, values = mx.stop_gradient(hid), mx.stop_gradient(keys), mx.stop_gradient(values)
    teacher = mx.stop_gradient(target.lm_head(hid))
    emb, norm = target.embed_tokens, target.final_norm
    gs, g = [], hid
    for d in range(1, depths + 1):
        at = mx.full((B,), d, dtype=mx.int32)
        g = head(emb(x[:, d:N]), g[:, :-1], keys, values, at, causal_key_mask(N - d, N), norm)
        gs.append(g)
    return teacher, gs


def assistant_losses(head: AssistantHead, target, x: mx.array, alpha: float, w2: float, w3: float = 0.0):
    """Depth 1 + w2 x depth 2 (+ w3 x depth 3 when w3 > 0), each mixed_ce against the target's
    prediction of the same token; the parts: each depth's data CE."""
    weights = [1.0, w2] + ([w3] if w3 > 0 else [])
    teacher, gs = assistant_unroll(head, target, x, len(weights))
    loss, parts = 0.0, []
    for d, (w, g) in enumerate(zip(weights, gs), start=1):
        l, ce = mixed_ce(target.lm_head(g), teacher[:, d:], x[:, d + 1:], alpha)
        loss, parts = loss + w * l, parts + [ce]
    return loss, tuple(parts)


def export_draft(out: Path, draft: llama.Model, cfg: dict) -> None:
    """Write the draft directory beside its destination, then swap it in."""
    final = out / DRAFT_DIR
    tmp = out / (DRAFT_DIR + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    weights = dict(tree_flatten(draft.parameters()))
    mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        shutil.copyfile(out / name, tmp / name)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="the target's model directory")
    ap.add_argument("--minutes-draft", type=float, default=12.0, help="0: keep the shipped draft model")
    ap.add_argument("--minutes-assistant", type=float, default=12.0, help="0: keep the shipped assistant")
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--draft-lr", type=float, default=1e-3)
    ap.add_argument("--draft-alpha", type=float, default=0.0,
                    help="weight of CE against the target's softmax (> 0 adds a target forward per step)")
    ap.add_argument("--assistant-lr", type=float, default=2e-3)
    ap.add_argument("--kv-layer", type=int, default=None, help="target layer whose K/V the assistant reads")
    ap.add_argument("--assistant-alpha", type=float, default=0.7,
                    help="weight of CE against the target's softmax (free: the same forward gives it)")
    ap.add_argument("--w2", type=float, default=0.5, help="weight of the assistant's chained depth-2 loss")
    ap.add_argument("--w3", type=float, default=0.0, help="weight of the assistant's chained depth-3 loss")
    ap.add_argument("--resume-assistant", action="store_true",
                    help="continue from the shipped assistant head instead of the MTP head")
    ap.add_argument("--checkpoint", type=Path, default=None, help="save the assistant here every 100 steps")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=20, help="steps; both drafters start from trained weights")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts", type=int, default=8, help="shipped prompts for the replayed acceptance")
    ap.add_argument("--k", type=int, default=3, help="drafts a round for the replayed acceptance")
    a = ap.parse_args(argv)

    mx.random.seed(a.seed)
    lm = load(a.out)
    target = lm.target
    mtp = lm.head.module  # the trained MTPHead itself (lm.head is its bound view)
    target.model.freeze()
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(a.out / "tokenizer.json"))
    train_f, val_f = split_files(corpus_files())
    train_ids = encode_all(tok, [read(f) for f in train_f])
    val_ids = encode_all(tok, [read(f) for f in val_f])
    print(f"corpus: train {len(train_ids):,} tok, val {len(val_ids):,} tok", flush=True)
    old = json.loads((a.out / LOG_FILE).read_text()) if (a.out / LOG_FILE).is_file() else {}
    runs = old.get("runs", {})
    common = {"batch": a.batch, "seq": a.seq, "warmup": a.warmup, "machine": machine_line()}

    if a.minutes_draft > 0:
        draft, cfg, run = train_draft(target, lm.config, train_ids, a)
        export_draft(a.out, draft, cfg)
        runs["draft"] = {**common, **run}
    draft, _, cfg = mlx_lm.load(str(a.out / DRAFT_DIR), return_config=True)

    if a.minutes_assistant > 0:
        if a.resume_assistant:
            head = load_assistant(a.out)
            if head is None:
                raise SystemExit(f"--resume-assistant: no assistant head in {a.out}")
        else:
            head = AssistantHead(AssistantConfig.for_target(lm.config, mtp.config.intermediate_size, a.kv_layer))
            init_from_mtp(head, mtp)
            mx.eval(head.parameters())  # sync: materialise the initial weights
            runs["assistant_init"] = agreement(target, None, head, None, val_ids, a.seq)
            print(f"assistant at init (MTP weights): {runs['assistant_init']}", flush=True)
        if a.checkpoint is not None:
            a.checkpoint.mkdir(parents=True, exist_ok=True)
        run = fit(head, lambda x: assistant_losses(head, target, x, a.assistant_alpha, a.w2, a.w3), train_ids, a,
                  a.minutes_assistant, a.assistant_lr, "assistant",
                  checkpoint=None if a.checkpoint is None else lambda: save_assistant(head, a.checkpoint))
        save_assistant(head, a.out)
        run = {**common, "alpha": a.assistant_alpha, "w2": a.w2, "w3": a.w3, **run}
        if a.resume_assistant:  # keep the first run's record; each resumed run is added after it
            runs["assistant_resumed"] = runs.get("assistant_resumed", []) + [run]
        else:
            runs["assistant"] = {**run, "init": "mtp_head"}
            runs.pop("assistant_resumed", None)
    head = load_assistant(a.out)

    metrics = agreement(target, draft, head, mtp, val_ids, a.seq)
    prompts = [lm.tokenizer.encode(p) for p in load_prompts()[: a.prompts]]
    metrics.update(greedy_acceptance(target, draft, head, mtp, prompts, k=a.k))
    costs = step_costs(target, draft, head, mtp)
    sizes = {"params_draft": sum(v.size for _, v in tree_flatten(draft.parameters())),
             "params_assistant": sum(v.size for _, v in tree_flatten(head.parameters()))}
    log = {"runs": runs, "sizes": sizes, "metrics": metrics, "costs": costs}
    (a.out / LOG_FILE).write_text(json.dumps(log, indent=2) + "\n")
    card = a.out / "MODEL_CARD.md"
    card.write_text(with_drafters_section(card.read_text(), cfg, head.config, log))
    print(f"metrics {metrics}\ncosts {costs}", flush=True)


if __name__ == "__main__":
    main()
