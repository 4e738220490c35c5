"""The embedded model's MODEL_CARD.md: corpus, architecture, training run and held-out measurements."""

from __future__ import annotations

import sys

from gmlx import blas
from gmlx.models.mtp import MTPConfig

EOS = "<|endoftext|>"
EXCLUDE_DIRS = {"test", "tests", "idlelib", "site-packages", "__pycache__", "turtledemo"}


def model_card(cfg: dict, mtp_cfg: MTPConfig, run: dict, metrics: dict, costs: dict) -> str:
    n_target = run["params_target"]
    n_head = run["params_head"]
    lines = [
        "# gmlx embedded default model",
        "",
        "A small llama-family code model with a jointly trained MTP head, made by",
        "`python -m gmlx.models.train_default` on this repository's build machine. It exists so that",
        "`gmlx generate` works offline on a fresh machine and so that speculation has a real drafter",
        "to measure. It writes plausible-looking Python, not correct programs.",
        "",
        "## Corpus",
        f"- The `.py` files of the Python {sys.version.split()[0]} standard library (`sysconfig` stdlib path),",
        f"  excluding {', '.join(sorted(EXCLUDE_DIRS))}; sorted by path.",
        f"- {run['num_files']} files; every 20th file (index % 20 == 7) held out for validation:",
        f"  {run['train_tokens']:,} training tokens, {run['val_tokens']:,} validation tokens.",
        f"- Tokenizer: byte-level BPE, vocab {cfg['vocab_size']}, `{EOS}` between files.",
        "",
        "## Architecture",
        f"- Target: llama, {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, MLP"
        f" {cfg['intermediate_size']}, {cfg['num_attention_heads']} heads ({cfg['num_key_value_heads']} KV),"
        f" tied embeddings, context {cfg['max_position_embeddings']} (trained on windows of {run['seq']}):"
        f" {n_target / 1e6:.2f} M parameters, fp32.",
        f"- MTP head: fc(concat(norm(embed(t+1)), norm(h_t))) -> one llama block (MLP"
        f" {mtp_cfg.intermediate_size}) -> the target's final norm and tied LM head:"
        f" {n_head / 1e6:.2f} M parameters.",
        "",
        "## Training",
        f"- Loss = CE(next) + {run['w1']} CE(t+2 via head) + {run['w2']} CE(t+3 via head chained on its own hidden).",
        f"- AdamW (lr {run['lr']}, warm-up {run['warmup']} steps, cosine to 10%, weight decay 0.01),"
        f" batch {run['batch']} x {run['seq']} tokens, `mx.compile`d step.",
        f"- {run['steps']} steps, {run['tokens_seen']:,} tokens seen, wall time {run['wall_min']:.1f} min"
        f" ({run['tok_per_s']:.0f} tokens/s) on {run['machine']}.",
        f"- Final training losses: target {run['last_ce0']:.3f}, head depth 1 {run['last_ce1']:.3f},"
        f" depth 2 {run['last_ce2']:.3f}.",
        "",
        "## Held-out measurements",
        f"- Validation CE (target): {metrics['val_ce']:.3f} nats/token; target top-1 accuracy"
        f" {metrics['target_top1']:.1%}.",
        f"- Head greedy agreement with the target's argmax (teacher-forced, held-out files):"
        f" **{metrics['head_agreement']:.1%}**.",
        f"- Step cost at batch 1 with KV caches (median of 200): target decode {costs['target_step_ms']:.2f} ms,"
        f" head step {costs['head_step_ms']:.2f} ms: ratio **{costs['head_cost_ratio']:.2f}**.",
        "",
        "Measured acceptance inside the engine is reported by `bench_results/` runs, not here.",
        "",
    ]
    return "\n".join(lines)


def machine_line() -> str:
    import os
    import platform
    from pathlib import Path

    import mlx.core as mx

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, BLAS {blas.active_blas()}, mlx {mx.__version__}"
