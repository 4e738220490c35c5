"""The embedded model's MODEL_CARD.md: corpus, architecture, training run and held-out measurements."""

from __future__ import annotations

import sys

from gmlx import blas
from gmlx.heads.mtp_head import MTPConfig

EOS = "<|endoftext|>"
EXCLUDE_DIRS = {"test", "tests", "idlelib", "site-packages", "__pycache__", "turtledemo"}


def model_card(cfg: dict, mtp_cfg: MTPConfig, run: dict, metrics: dict, costs: dict) -> str:
    n_target = run["params_target"]
    n_head = run["params_head"]
    lines = [
        "# gmlx embedded default model",
        "",
        "A small llama-family code model with a jointly trained MTP head, made by",
        "`python -m gmlx_training.train_default` on this repository's build machine. It exists so that",
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


DRAFTERS_HEADING = "## Drafters"


def with_drafters_section(card: str, draft_cfg: dict, asst_cfg, log: dict) -> str:
    """The card with its drafters section (from `train_drafters`) replaced or appended."""
    head, sep, rest = card.partition(DRAFTERS_HEADING)
    after = rest.partition("\n## ")
    tail = "\n## " + after[2] if sep and after[1] else ""
    return head.rstrip("\n") + "\n\n" + drafters_section(draft_cfg, asst_cfg, log) + tail


def _loss(alpha: float) -> str:
    if alpha == 0:
        return "CE on the data"
    return f"{alpha} CE(target's softmax) + {1 - alpha:.2g} CE(data)"


def drafters_section(dc: dict, ac, log: dict) -> str:
    runs, m, c, sz = log["runs"], log["metrics"], log["costs"], log["sizes"]
    rd, ra, init = runs["draft"], runs["assistant"], runs.get("assistant_init", {})
    resumed = runs.get("assistant_resumed", [])

    def trained(r: dict) -> str:
        return (f"AdamW (lr {r['lr']}, warm-up {r['warmup']} steps, cosine to 10%), batch {r['batch']} x {r['seq']},"
                f" {r['steps']} steps, {r['tokens_seen']:,} tokens seen, {r['wall_min']:.1f} min"
                f" ({r['tok_per_s']:.0f} tokens/s) on {r['machine']}")

    lines = [
        DRAFTERS_HEADING,
        "Trained afterwards by `python -m gmlx_training.train_drafters` against the frozen target above, on",
        "the same corpus split, encoded with the shipped tokenizer.",
        "",
        f"- Draft model (`draft/`, a complete mlx-lm directory with the target's tokenizer): llama,"
        f" {dc['num_hidden_layers']} layers, hidden {dc['hidden_size']}, MLP {dc['intermediate_size']},"
        f" {dc['num_attention_heads']} heads ({dc['num_key_value_heads']} KV), tied embeddings:"
        f" {sz['params_draft'] / 1e6:.2f} M parameters, initialised from the target (embeddings,"
        f" final norm and {rd['init']}). Loss: {_loss(rd['alpha'])}. {trained(rd)}.",
        f"- Assistant head (`assistant_head.safetensors`, `assistant_config.json`; `gmlx.heads.assistant_head`):"
        f" fc(concat(norm(embed(t+1)), norm(h_t))) -> query-only attention (RoPE at t+1) over the target's"
        f" layer-{ac.kv_layer} cached K/V of positions 0..t -> SwiGLU MLP {ac.intermediate_size} -> the"
        f" target's final norm and LM head; keeps no KV cache: {sz['params_assistant'] / 1e6:.2f} M parameters."
        f" Initialised from the MTP head's fc, norms, q_proj and MLP with o_proj = 0. Loss: depth 1 (t+2)"
        f" + {ra['w2']} x depth 2 (t+3, chained on its own output, same keys), each {_loss(ra['alpha'])}."
        f" {trained(ra)}.",
        *(f"- Assistant head, resumed from the shipped head (`train_drafters --resume-assistant`), run {i + 1}:"
          f" loss as above + {r['w3']} x depth 3 (t+4, chained again). {trained(r)}." for i, r in enumerate(resumed)),
        "",
        f"Held-out, teacher-forced agreement of each drafter's argmax with the target's argmax for the same"
        f" token ({m['windows']} windows, {m['positions']:,} positions; the windows of the measurement above),"
        f" and step cost at batch 1 with a {c['context']}-token context (medians of {c['reps']} interleaved"
        f" steps, each up to logits; 1-minute load average {c['load_average']:.1f} while measuring). The target"
        " has computed positions 0..t and emitted the bonus token t+1; the first draft is token t+2.",
        "",
        "| drafter | first draft (t+2) | second draft (t+3, chained) | greedy acceptance, replayed | step |"
        " cost / target step |",
        "|---|---|---|---|---|---|",
        f"| draft model | {m['draft_next']:.1%} | {m['draft_next']:.1%} (sees the full prefix) |"
        f" {m['draft_acceptance']:.1%} | {c['draft_step_ms']:.2f} ms | {c['draft_cost_ratio']:.2f} |",
        f"| MTP head | {m['mtp_t2']:.1%} | {m['mtp_t3']:.1%} | {m['mtp_acceptance']:.1%} | {c['mtp_step_ms']:.2f} ms |"
        f" {c['mtp_cost_ratio']:.2f} |",
        f"| assistant head | {m['assistant_t2']:.1%} | {m['assistant_t3']:.1%} | {m['assistant_acceptance']:.1%} |"
        f" {c['assistant_step_ms']:.2f} ms | {c['assistant_cost_ratio']:.2f} |",
        f"| (target decode) | | | | {c['target_step_ms']:.2f} ms | 1.00 |",
        "",
        f"- Greedy acceptance, replayed: drafts accepted / proposed with K = {m['k']} drafts a round at batch 1,"
        f" over the target's greedy stream of {m['gen']} tokens after each of the first {m['prompts']} shipped"
        " prompts (`gmlx/data/prompts.jsonl`); each round drafts from the state the engine has (the target's"
        " cache over 0..t, h_t, bonus t+1), so it includes the drafters' chaining on their own drafts.",
        "- Step costs here are interleaved, so the three drafters are timed under the same load; the MTP"
        " head's ratio in the section above was timed alone, right after training.",
        f"- Draft model validation CE: {m['draft_ce']:.3f} nats/token (target {m['target_ce']:.3f}, target top-1"
        f" {m['target_top1']:.1%} on these windows).",
    ]
    if init:
        lines.append(f"- Assistant at initialisation (MTP weights, o_proj = 0): {init['assistant_t2']:.1%}"
                     f" at t+2, {init['assistant_t3']:.1%} at t+3.")
    lines.append("")
    return "\n".join(lines)
