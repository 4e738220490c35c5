"""A llama GGUF file (llama.cpp, Ollama) mapped onto mlx-lm's llama: the config.json from the
`llama.*` metadata, the tensor names, and the quantization block (gmlx/gguf/convert.py drives the
conversion).

What the mapping does beyond renaming: q/k rows are un-permuted from llama.cpp's rotary layout back
to the Hugging Face one mlx-lm's llama expects, and bits are declared per layer where they differ
(the embedding is often 8 bits beside 4-bit linears); what mlx-lm's llama cannot run (mixture of
experts, rope frequency scaling, partial rotary embeddings) is refused with its reason.
"""

from __future__ import annotations

from collections import Counter

import mlx.core as mx

from gmlx.gguf.reader import GGUFError
from gmlx.gguf.tokenizer import eos_ids

GROUP_SIZE = 32  # GGML's block for Q4_0/Q4_1/Q8_0; MLX loads each block as one group

_LAYER = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_PARTS = ("weight", "scales", "biases")


def _meta(meta: dict, key: str, default=None):
    v = meta.get(f"llama.{key}", default)
    if v is None:
        raise GGUFError(f"the GGUF metadata has no llama.{key}")
    return v


def model_config(meta: dict, raw: dict) -> dict:
    """mlx-lm's llama config.json from the `llama.*` metadata; refuses what mlx-lm's llama cannot run."""
    if meta.get("llama.expert_count"):
        raise GGUFError(f"llama.expert_count = {meta['llama.expert_count']}: mixture-of-experts GGUF is not supported")
    if "rope_freqs.weight" in raw:
        raise GGUFError("rope_freqs.weight (Llama 3.1-style rope frequency scaling) is not supported")
    heads = int(_meta(meta, "attention.head_count"))
    hidden = int(_meta(meta, "embedding_length"))
    head_dim = int(meta.get("llama.attention.key_length", hidden // heads))
    rope_dims = int(meta.get("llama.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise GGUFError(f"llama.rope.dimension_count = {rope_dims} with heads of {head_dim}: partial rotary"
                        " embeddings are not supported")
    vocab = meta.get("llama.vocab_size") or len(meta.get("tokenizer.ggml.tokens", ())) or raw["token_embd.weight"].shape[0]
    config = {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(_meta(meta, "block_count")),
        "intermediate_size": int(_meta(meta, "feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(meta.get("llama.rope.freq_base", 10000.0)),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in raw,
        "eos_token_id": eos_ids(meta),
    }
    if "tokenizer.ggml.bos_token_id" in meta:
        config["bos_token_id"] = int(meta["tokenizer.ggml.bos_token_id"])
    if meta.get("llama.context_length"):
        config["max_position_embeddings"] = int(meta["llama.context_length"])
    scaling = meta.get("llama.rope.scaling.type", "none")
    if scaling == "linear":
        config["rope_scaling"] = {"type": "linear", "factor": float(meta["llama.rope.scaling.factor"])}
    elif scaling != "none":
        raise GGUFError(f"llama.rope.scaling.type = {scaling!r} is not supported (only linear)")
    return config


def hf_name(name: str) -> str:
    """GGUF tensor name -> mlx-lm llama parameter name ("blk.3.attn_q.scales" ->
    "model.layers.3.self_attn.q_proj.scales")."""
    stem, _, part = name.rpartition(".")
    if part in _PARTS:
        if stem in _TOP:
            return f"{_TOP[stem]}.{part}"
        bits = stem.split(".")
        if len(bits) == 3 and bits[0] == "blk" and bits[1].isdigit() and bits[2] in _LAYER:
            return f"model.layers.{bits[1]}.{_LAYER[bits[2]]}.{part}"
    raise GGUFError(f"tensor {name!r} has no place in a llama model (unexpected for architecture llama)")


def unpermute(w: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's q/k row permutation (its converter interleaves each head's two rotary
    halves). Rows only, so a quantized weight, its scales and biases permute alike."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_weights(raw: dict[str, mx.array], config: dict) -> dict[str, mx.array]:
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    out = {}
    for name, w in raw.items():
        kind = name.split(".")[2] if name.startswith("blk.") and name.count(".") >= 3 else None
        out[hf_name(name)] = unpermute(w, heads[kind]) if kind in heads else w
    return out


def _bits(weights: dict, prefix: str) -> int:
    w, scales = weights[f"{prefix}.weight"], weights[f"{prefix}.scales"]
    return w.shape[1] * 32 // (scales.shape[1] * GROUP_SIZE)  # 32 packed bits per uint32


def quantization(weights: dict) -> dict | None:
    """mlx-lm's quantization block: the commonest bits as the default, the others per layer."""
    bits = {k[: -len(".scales")]: _bits(weights, k[: -len(".scales")]) for k in weights if k.endswith(".scales")}
    if not bits:
        return None
    default = Counter(bits.values()).most_common(1)[0][0]
    quant = {"group_size": GROUP_SIZE, "bits": default, "mode": "affine"}
    quant.update({p: {"group_size": GROUP_SIZE, "bits": b} for p, b in sorted(bits.items()) if b != default})
    return quant


def dequantized(weights: dict, dtype) -> dict[str, mx.array]:
    out = {}
    for name, w in weights.items():
        if name.endswith((".scales", ".biases")):
            continue
        prefix = name[: -len(".weight")]
        if f"{prefix}.scales" in weights:
            # float32 scales: exact products, one rounding, and ~4x faster than float16 math on a CPU
            scales, biases = (weights[f"{prefix}.{p}"].astype(mx.float32) for p in ("scales", "biases"))
            w = mx.dequantize(w, scales, biases, group_size=GROUP_SIZE, bits=_bits(weights, prefix))
        out[name] = w.astype(dtype)
    return out
