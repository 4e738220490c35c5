"""Tiny random targets (llama, qwen3; the embedded model's tokenizer) and tiny random EAGLE-3
checkpoints written in the public layout (config.json + model.safetensors with SGLang's / EAGLE's
tensor names, d2t and t2d), for tests/test_eagle3.py."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np

from gmlx.models.loading import default_model_path
from micro import make_micro_model, write_random_model



def random_target(family: str, out: Path, layers: int = 6, d: int = 64, seed: int = 0, scale: float = 3.0) -> Path:
    """An mlx-lm directory with random weights: a llama or a qwen3 (QK norms, head_dim). The
    projections are scaled by `scale`: at 1 (mlx's init) greedy streams repeat one token, at 3 they
    wander over the vocabulary (a stream comparison then means something)."""
    if family == "llama":
        make_micro_model(out, layers=layers, d=d, heads=4, kv_heads=2, seed=seed)
        return _scaled(out, scale)
    from mlx_lm.models import qwen3

    src = default_model_path()
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    cfg = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": d,
           "num_hidden_layers": layers, "intermediate_size": 3 * d, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 32, "rms_norm_eps": 1e-6, "vocab_size": vocab,
           "max_position_embeddings": 4096, "rope_theta": 1000000.0, "tie_word_embeddings": True, "eos_token_id": 0}
    return _scaled(write_random_model(out, cfg, qwen3, seed), scale)


def _scaled(out: Path, scale: float) -> Path:
    if scale != 1.0:
        w = mx.load(str(out / "model.safetensors"))
        mx.save_safetensors(str(out / "model.safetensors"), {k: v * scale if "proj" in k else v for k, v in w.items()})
    return out


def write_eagle3(out: Path, target_dir: Path, *, hidden: int | None = None, draft_vocab: int = 96, seed: int = 1,
                 agree_with: int | None = None, layer_ids=None, prefix: str = "", embed: bool = False,
                 dtype=mx.bfloat16) -> Path:
    """A random EAGLE-3 head for the target in `target_dir`, in the released layout. With
    `agree_with=T`, its LM head is zero, so every draft id scores alike and the draft is the lowest
    target id of its vocabulary, made T: the drafts agree with the target wherever it emits T."""
    tcfg = json.loads((target_dir / "config.json").read_text())
    vocab, t_hidden = tcfg["vocab_size"], tcfg["hidden_size"]
    hidden = hidden or t_hidden  # the released heads have the target's width (and share its embedding)
    heads, kv, head_dim, inter = 4, 2, 16, 2 * hidden
    rng = np.random.default_rng(seed)

    def w(*shape, scale=0.08):
        return mx.array(rng.normal(0.0, scale, size=shape).astype(np.float32)).astype(dtype)

    ones = lambda n: mx.ones((n,), dtype=dtype)  # noqa: E731
    t = {
        "fc.weight": w(hidden, 3 * t_hidden),
        "midlayer.input_layernorm.weight": ones(hidden),
        "midlayer.hidden_norm.weight": ones(hidden),
        "midlayer.post_attention_layernorm.weight": ones(hidden),
        "midlayer.self_attn.q_proj.weight": w(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": w(kv * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": w(kv * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": w(hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": w(inter, hidden),
        "midlayer.mlp.up_proj.weight": w(inter, hidden),
        "midlayer.mlp.down_proj.weight": w(hidden, inter),
        "norm.weight": ones(hidden),
        "lm_head.weight": w(draft_vocab, hidden, scale=0.5) if agree_with is None else mx.zeros((draft_vocab, hidden),
                                                                                               dtype=dtype),
    }
    if embed:
        t["embed_tokens.weight"] = w(vocab, hidden)
    # the draft vocabulary: distinct target ids, sorted (as the released maps), `agree_with` first
    pool = np.arange(1, vocab) if agree_with is None else np.arange(agree_with + 1, vocab)
    assert len(pool) >= draft_vocab, "the agreeing token must leave room above it"
    chosen = np.sort(rng.choice(pool, size=draft_vocab - (agree_with is not None), replace=False))
    if agree_with is not None:
        chosen = np.concatenate([[agree_with], chosen])
    t["d2t"] = mx.array((chosen - np.arange(draft_vocab)).astype(np.int64))
    t2d = np.zeros(vocab, dtype=bool)
    t2d[chosen] = True
    t["t2d"] = mx.array(t2d)
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
           "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim,
           "num_hidden_layers": 1, "rms_norm_eps": 1e-5, "vocab_size": vocab, "draft_vocab_size": draft_vocab,
           "target_hidden_size": t_hidden, "max_position_embeddings": 4096, "rope_theta": 10000.0,
           "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    if layer_ids is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(layer_ids), "use_aux_hidden_state": True}
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    mx.save_safetensors(str(out / "model.safetensors"), {prefix + k: v for k, v in t.items()})
    return out
