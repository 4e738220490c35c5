"""Tiny random checkpoints on disk with a native MTP head, in the real tensor layouts.

The target is an mlx-lm model with random weights, saved under mlx-lm's own names (or, for
qwen3_next, converted back to the HF layout its `sanitize` expects: unstacked experts,
zero-centred norms, HF conv1d shape, which is also what makes mlx-lm drop `mtp.*`). The MTP
tensors are saved under their real checkpoint names in the HF layout (DeepSeek's kv_b_proj,
experts one by one), so gmlx's loader does the conversions a real checkpoint needs. Each
builder returns the *reference* head parameters in mlx space, for manual forwards in tests.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import deepseek_v3, qwen3, qwen3_next

from gmlx.models.loading import default_model_path

VOCAB = 2048
_TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def randomize(module: nn.Module, seed: int) -> dict[str, mx.array]:
    """Random weights everywhere (norms near 1, the rest small normal); returns them by name."""
    flat = {}
    for i, (k, v) in enumerate(tree_flatten(module.parameters())):
        r = mx.random.normal(v.shape, key=mx.random.key(seed * 100_003 + i))
        flat[k] = (1.0 + 0.2 * r) if k.endswith("norm.weight") else 0.2 * r
    module.load_weights(list(flat.items()))
    mx.eval(module.parameters())
    return flat


def write_model(path: Path, config: dict, shards: dict[str, dict[str, mx.array]]) -> Path:
    """config.json, the shards (with an index when more than one), the default model's tokenizer."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"eos_token_id": 0, **config}))
    for name, tensors in shards.items():
        mx.save_safetensors(str(path / name), tensors)
    if len([n for n in shards if n.startswith("model")]) > 1:
        weight_map = {k: n for n, t in shards.items() if n.startswith("model") for k in t}
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for f in _TOKENIZER:
        shutil.copy(default_model_path() / f, path / f)
    return path


def unstack_experts(flat: dict[str, mx.array]) -> dict[str, mx.array]:
    """mlx-lm's stacked `switch_mlp.{proj}.weight` [E, ...] -> HF's `experts.{e}.{proj}.weight`."""
    out = {}
    for k, v in flat.items():
        if ".switch_mlp." in k:
            head, proj = k.split(".switch_mlp.")
            for e in range(v.shape[0]):
                out[f"{head}.experts.{e}.{proj}"] = v[e]
        else:
            out[k] = v
    return out


# -- DeepSeek-V3 layout ------------------------------------------------------------------------
DS_CONFIG = {
    "model_type": "deepseek_v3", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
    "moe_intermediate_size": 16, "num_hidden_layers": 61, "num_attention_heads": 2, "num_key_value_heads": 2,
    "n_shared_experts": 1, "n_routed_experts": 4, "num_experts_per_tok": 2, "first_k_dense_replace": 61,
    "kv_lora_rank": 16, "q_lora_rank": None, "qk_rope_head_dim": 8, "v_head_dim": 8, "qk_nope_head_dim": 8,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "num_nextn_predict_layers": 1,
}


def deepseek_checkpoint(path: Path, seed: int = 0) -> tuple[Path, dict[str, mx.array]]:
    """61 dense layers (mlx-lm drops only `model.layers.61`, DeepSeek-V3's MTP index) + the MTP
    layer 61: MoE (61 >= first_k_dense_replace), MLA attention, in two shards with an index."""
    args = deepseek_v3.ModelArgs.from_dict(DS_CONFIG)
    model = deepseek_v3.Model(args)
    target = randomize(model, seed)
    layer = deepseek_v3.DeepseekV3DecoderLayer(args, 61)
    ref = {f"layer.{k}": v for k, v in randomize(layer, seed + 1).items()}
    for i, name in enumerate(("embed_norm", "hidden_norm", "out_norm")):
        ref[f"{name}.weight"] = 1.0 + 0.2 * mx.random.normal((32,), key=mx.random.key(seed + 10 + i))
    ref["fc.weight"] = 0.2 * mx.random.normal((32, 64), key=mx.random.key(seed + 20))
    hf = unstack_experts({k[len("layer."):]: v for k, v in ref.items() if k.startswith("layer.")})
    # MLA: HF stores one kv_b_proj; mlx-lm splits it into embed_q / unembed_out at load.
    wk, wv = hf.pop("self_attn.embed_q.weight"), hf.pop("self_attn.unembed_out.weight")  # [H, r, n], [H, v, r]
    hf["self_attn.kv_b_proj.weight"] = mx.concatenate([wk.swapaxes(-1, -2), wv], axis=1).reshape(-1, wk.shape[1])
    hf.update({"enorm.weight": ref["embed_norm.weight"], "hnorm.weight": ref["hidden_norm.weight"],
               "eh_proj.weight": ref["fc.weight"], "shared_head.norm.weight": ref["out_norm.weight"],
               "shared_head.head.weight": target["lm_head.weight"],
               "embed_tokens.weight": target["model.embed_tokens.weight"]})
    mtp = {f"model.layers.61.{k}": v for k, v in hf.items()}
    return write_model(path, DS_CONFIG, {"model-00001-of-00002.safetensors": target,
                                         "model-00002-of-00002.safetensors": mtp}), ref


# -- Qwen3-Next layout ---------------------------------------------------------------------------
QN_CONFIG = {
    "model_type": "qwen3_next", "hidden_size": 32, "num_hidden_layers": 4, "intermediate_size": 64,
    "num_attention_heads": 2, "linear_num_value_heads": 2, "linear_num_key_heads": 2, "linear_key_head_dim": 8,
    "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4, "num_experts": 4, "num_experts_per_tok": 2,
    "decoder_sparse_step": 1, "shared_expert_intermediate_size": 32, "mlp_only_layers": [], "moe_intermediate_size": 16,
    "rms_norm_eps": 1e-6, "vocab_size": VOCAB, "num_key_value_heads": 1, "rope_theta": 10000.0,
    "partial_rotary_factor": 0.5, "max_position_embeddings": 512, "head_dim": 16, "full_attention_interval": 4,
    "tie_word_embeddings": False, "num_nextn_predict_layers": 1,
}
QWEN3_CONFIG = {
    "model_type": "qwen3", "hidden_size": 32, "num_hidden_layers": 2, "intermediate_size": 64,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "rms_norm_eps": 1e-6, "vocab_size": VOCAB,
    "rope_theta": 10000.0, "max_position_embeddings": 512, "tie_word_embeddings": True,
}
_ZERO_CENTRED = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
                 ".q_norm.weight", ".k_norm.weight", "norm.weight")


def _qwen_mtp(layer: nn.Module, seed: int) -> dict[str, mx.array]:
    ref = {f"layer.{k}": v for k, v in randomize(layer, seed + 1).items()}
    for i, name in enumerate(("embed_norm", "hidden_norm", "out_norm")):
        ref[f"{name}.weight"] = 1.0 + 0.2 * mx.random.normal((32,), key=mx.random.key(seed + 10 + i))
    ref["fc.weight"] = 0.2 * mx.random.normal((32, 64), key=mx.random.key(seed + 20))
    return ref


def _qwen_mtp_tensors(ref: dict[str, mx.array], zero_centred: bool) -> dict[str, mx.array]:
    names = {"embed_norm": "pre_fc_norm_embedding", "hidden_norm": "pre_fc_norm_hidden", "out_norm": "norm", "fc": "fc"}
    out = unstack_experts({"mtp.layers.0." + k[len("layer."):]: v for k, v in ref.items() if k.startswith("layer.")})
    out.update({f"mtp.{names[k.split('.')[0]]}.weight": v for k, v in ref.items() if not k.startswith("layer.")})
    if zero_centred:  # HF Qwen3-Next stores every norm of the MTP block as w - 1
        out = {k: v - 1.0 if k.endswith("norm.weight") and v.ndim == 1 else v for k, v in out.items()}
    return out


def qwen3_next_checkpoint(path: Path, seed: int = 0) -> tuple[Path, dict[str, mx.array], nn.Module]:
    """A real (hybrid, MoE) qwen3_next target in HF layout with `mtp.*` in the same file.
    Returns the reference head parameters and the in-memory target (the HF round trip's oracle)."""
    args = qwen3_next.ModelArgs.from_dict(QN_CONFIG)
    model = qwen3_next.Model(args)
    flat = unstack_experts(randomize(model, seed))
    hf = {}
    for k, v in flat.items():
        if "conv1d.weight" in k:
            v = v.moveaxis(1, 2)
        elif k.endswith(_ZERO_CENTRED[:5]) and v.ndim == 1:
            v = v - 1.0
        hf[k] = v
    ref = _qwen_mtp(qwen3_next.Qwen3NextDecoderLayer(args, 3), seed)
    hf.update(_qwen_mtp_tensors(ref, zero_centred=True))
    return write_model(path, QN_CONFIG, {"model.safetensors": hf}), ref, model


def qwen3_checkpoint(path: Path, seed: int = 0, with_mtp: bool = True) -> tuple[Path, dict[str, mx.array]]:
    """A dense qwen3 target with Qwen3-Next-layout `mtp.*` tensors. mlx-lm's qwen3 has no place
    for them (strict load), so they live in `mtp.safetensors`, beside mlx-lm's model*.safetensors."""
    args = qwen3.ModelArgs.from_dict(QWEN3_CONFIG)
    model = qwen3.Model(args)
    shards = {"model.safetensors": randomize(model, seed)}
    ref = {}
    if with_mtp:
        ref = _qwen_mtp(qwen3.TransformerBlock(args), seed)
        shards["mtp.safetensors"] = _qwen_mtp_tensors(ref, zero_centred=False)
    return write_model(path, QWEN3_CONFIG, shards), ref


# -- Qwen3.5 layout (dense and MoE): the text model under `model.language_model.*` ---------------
Q35_TEXT = {
    "model_type": "qwen3_5_text", "hidden_size": 32, "num_hidden_layers": 4, "intermediate_size": 64,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "linear_num_value_heads": 4,
    "linear_num_key_heads": 2, "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4,
    "full_attention_interval": 4, "rms_norm_eps": 1e-6, "vocab_size": VOCAB, "max_position_embeddings": 512,
    "tie_word_embeddings": False, "mtp_num_hidden_layers": 1,
    "rope_parameters": {"type": "default", "mrope_section": [2, 2, 4], "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
}
Q35_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 32}


def _fuse_experts(flat: dict[str, mx.array]) -> dict[str, mx.array]:
    """mlx-lm's `switch_mlp.{gate,up,down}_proj.weight` -> HF Qwen3.5-MoE's fused
    `experts.gate_up_proj` [E, 2I, D] and `experts.down_proj` [E, D, I]."""
    out = {}
    for k, v in flat.items():
        if ".switch_mlp.gate_proj." in k:
            head = k.split(".switch_mlp.")[0]
            out[f"{head}.experts.gate_up_proj"] = mx.concatenate([v, flat[k.replace("gate_proj", "up_proj")]], axis=-2)
        elif ".switch_mlp.down_proj." in k:
            out[k.split(".switch_mlp.")[0] + ".experts.down_proj"] = v
        elif ".switch_mlp." not in k:
            out[k] = v
    return out


def qwen3_5_checkpoint(path: Path, seed: int = 0, moe: bool = False) -> tuple[Path, dict[str, mx.array], nn.Module]:
    """A Qwen3.5 (`moe`: Qwen3.5-MoE) hybrid target in the HF layout mlx-lm's sanitize expects
    (text model under `model.language_model.`, zero-centred norms, HF conv1d shape, fused experts)
    with its `mtp.*` head. Returns the reference head parameters and the in-memory target."""
    from mlx_lm.models import qwen3_5, qwen3_5_moe

    text = {**Q35_TEXT, **(Q35_MOE if moe else {})}
    if moe:
        text["model_type"] = "qwen3_5_moe_text"
    config = {"model_type": "qwen3_5_moe" if moe else "qwen3_5", "text_config": text}
    family = qwen3_5_moe if moe else qwen3_5
    model = family.Model(family.ModelArgs.from_dict(config))
    flat = randomize(model, seed)
    hf = {}
    for k, v in flat.items():
        if k.startswith("language_model.model."):
            k = "model.language_model." + k[len("language_model.model."):]
        elif k.startswith("language_model."):
            k = k[len("language_model."):]
        if "conv1d.weight" in k:
            v = v.moveaxis(1, 2)
        elif k.endswith(_ZERO_CENTRED[:5]) and v.ndim == 1:
            v = v - 1.0
        hf[k] = v
    hf = _fuse_experts(hf) if moe else hf
    args = model.language_model.args
    ref = _qwen_mtp(qwen3_5.DecoderLayer(args, 3), seed)
    mtp = {"mtp.layers.0." + k[len("layer."):]: v for k, v in ref.items() if k.startswith("layer.")}
    mtp = _fuse_experts(mtp)
    names = {"embed_norm": "pre_fc_norm_embedding", "hidden_norm": "pre_fc_norm_hidden", "out_norm": "norm", "fc": "fc"}
    mtp.update({f"mtp.{names[k.split('.')[0]]}.weight": v for k, v in ref.items() if not k.startswith("layer.")})
    mtp = {k: v - 1.0 if k.endswith("norm.weight") and v.ndim == 1 else v for k, v in mtp.items()}
    hf.update(mtp)
    return write_model(path, config, {"model.safetensors": hf}), ref, model
