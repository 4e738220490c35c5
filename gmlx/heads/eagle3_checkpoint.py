"""An EAGLE-3 head's checkpoint (gmlx/heads/eagle3_head.py: the head): its layout, reading it, and
loading it beside a target.

A directory with `config.json` (`architectures: ["LlamaForCausalLMEagle3"]`, or vLLM's name
`Eagle3LlamaForCausalLM`) and `model.safetensors` (or shards `model-*.safetensors`):

| tensor | shape | what |
|---|---|---|
| `fc.weight` | [H, 3 T] | fuses the target's low, middle and high residual streams (T: `target_hidden_size`, default H) |
| `midlayer.input_layernorm.weight`, `midlayer.hidden_norm.weight` | [H] | norms of the token embedding and of the fused hidden |
| `midlayer.self_attn.{q,k,v}_proj.weight` | [heads x head_dim, 2 H] | attention over concat(embedding, hidden) |
| `midlayer.self_attn.o_proj.weight`, `midlayer.post_attention_layernorm.weight`, `midlayer.mlp.{gate,up,down}_proj.weight` | | a llama decoder layer's |
| `norm.weight` | [H] | before the LM head |
| `lm_head.weight` | [draft_vocab_size, H] | the draft's own reduced vocabulary (absent: the target's LM head, its rows for the draft ids where `d2t` names them) |
| `d2t` | [draft_vocab_size] int | draft id -> target id offset: target = draft + d2t[draft] |
| `t2d` | [vocab_size] bool | which target ids the draft vocabulary has (not needed to draft) |
| `embed_tokens.weight` | [vocab_size, H] | optional; absent: the target's embedding (as SGLang shares it) |

A leading `model.` on the names is accepted. One draft layer (`num_hidden_layers: 1`), SiLU MLP.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama

from gmlx.errors import ModelLoadError
from gmlx.heads.eagle3_head import KIND, BoundEagle3Head, Eagle3Model
from gmlx.heads.eagle3_streams import AuxTarget, layers_entering

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
_OPTIONAL = ("lm_head.weight", "embed_tokens.weight")


def read_config(path: Path) -> dict:
    f = path / "config.json"
    try:
        cfg = json.loads(f.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{str(path)!r} has no config.json: not an EAGLE-3 checkpoint directory") from None
    except ValueError as e:
        raise ModelLoadError(f"{str(f)!r} is not valid JSON ({e})") from None
    archs = cfg.get("architectures") or []
    if not any(a in ARCHITECTURES for a in archs):
        raise ModelLoadError(f"{str(path)!r} is not an EAGLE-3 checkpoint (architectures {archs}; expected one of"
                             f" {', '.join(ARCHITECTURES)})")
    return cfg


def read_weights(path: Path) -> dict[str, mx.array]:
    files = sorted(path.glob("model*.safetensors"))
    if not files:
        bins = sorted(path.glob("pytorch_model*.bin"))
        hint = (" (it has PyTorch .bin weights: convert them to safetensors, e.g. with safetensors.torch.save_file)"
                if bins else "")
        raise ModelLoadError(f"{str(path)!r} has no model*.safetensors{hint}")
    out: dict[str, mx.array] = {}
    for f in files:
        try:
            out.update(mx.load(str(f)))
        except Exception as e:  # a truncated or corrupt file
            raise ModelLoadError(f"could not read {str(f)!r}: {e}") from None
    return {k[len("model."):] if k.startswith("model.") else k: v for k, v in out.items()}


def layer_args(cfg: dict) -> llama.ModelArgs:
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "rms_norm_eps", "vocab_size")
    missing = [k for k in keys if k not in cfg]
    if missing:
        raise ModelLoadError(f"EAGLE-3 config.json lacks {', '.join(missing)}")
    return llama.ModelArgs(
        model_type="llama", hidden_size=cfg["hidden_size"], num_hidden_layers=1,
        intermediate_size=cfg["intermediate_size"], num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
        head_dim=cfg.get("head_dim"), rms_norm_eps=cfg["rms_norm_eps"], vocab_size=cfg["vocab_size"],
        max_position_embeddings=cfg.get("max_position_embeddings"), attention_bias=cfg.get("attention_bias", False),
        mlp_bias=cfg.get("mlp_bias", False), rope_theta=cfg.get("rope_theta", 10000.0),
        rope_scaling=cfg.get("rope_scaling"), tie_word_embeddings=False)


def load_eagle3_head(path: str | Path, lm):
    """The loaded model as the engine sees it with this head: its target an AuxTarget, its head
    the bound EAGLE-3 head (gmlx.drafters.eagle3 wraps it in its drafter). The loaded model `lm`
    itself is not changed."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise ModelLoadError(f"--draft-model {str(p)!r}: no such directory (an EAGLE-3 checkpoint directory)")
    cfg = read_config(p)
    target = lm.target
    if int(cfg.get("num_hidden_layers", 1)) != 1:
        raise ModelLoadError(f"{p.name}: EAGLE-3 heads with {cfg['num_hidden_layers']} layers are not supported"
                             " (one draft layer, as the released checkpoints)")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{p.name}: hidden_act {cfg['hidden_act']!r} is not supported (silu)")
    args = layer_args(cfg)
    t_hidden = int(cfg.get("target_hidden_size") or args.hidden_size)
    if t_hidden != target.hidden_size or int(cfg["vocab_size"]) != target.vocab_size:
        raise ModelLoadError(f"{p.name} was trained for a target with hidden size {t_hidden} and vocabulary"
                             f" {cfg['vocab_size']}; {lm.name} has {target.hidden_size} and {target.vocab_size}")
    entering = layers_entering(cfg, target.num_layers)
    weights = read_weights(p)
    d2t = weights.pop("d2t", None)
    weights.pop("t2d", None)
    draft_vocab = int(cfg.get("draft_vocab_size") or cfg["vocab_size"])
    own_head = "lm_head.weight" in weights
    if own_head and weights["lm_head.weight"].shape[0] != draft_vocab:
        raise ModelLoadError(f"{p.name}: lm_head has {weights['lm_head.weight'].shape[0]} rows, draft_vocab_size is"
                             f" {draft_vocab}")
    if not own_head and draft_vocab != target.vocab_size and d2t is None:
        raise ModelLoadError(f"{p.name}: no lm_head.weight, nor a d2t map to take its draft vocabulary of"
                             f" {draft_vocab} from the target's LM head")
    if "embed_tokens.weight" not in weights and args.hidden_size != target.hidden_size:
        raise ModelLoadError(f"{p.name}: no embed_tokens.weight, and its width {args.hidden_size} is not the"
                             f" target's {target.hidden_size}, so it cannot share the target's embedding")
    aux = AuxTarget(target, entering)
    if 3 * t_hidden == args.hidden_size or aux.aux_size == args.hidden_size:
        raise ModelLoadError(f"{p.name}: the fused width equals the draft width ({args.hidden_size}): unsupported")
    module = Eagle3Model(args, t_hidden, draft_vocab, len(entering), fc_bias="fc.bias" in weights,
                         norm_before_residual=bool(cfg.get("norm_before_residual", False)), own_lm_head=own_head,
                         own_embed="embed_tokens.weight" in weights)
    expected = {k for k, _ in _flat(module)}
    missing = sorted(expected - set(weights))
    unknown = sorted(set(weights) - expected)
    if missing or unknown:
        raise ModelLoadError(f"{p.name}: not the EAGLE-3 layout: " + "; ".join(
            s for s in (f"missing {', '.join(missing[:5])}" if missing else "",
                        f"unexpected {', '.join(unknown[:5])}" if unknown else "") if s))
    module.load_weights(list(weights.items()))
    if mx.default_device().type == mx.DeviceType.cpu:  # CPU matmuls in float32 are faster than in bf16/f16
        module.set_dtype(mx.float32, lambda d: mx.issubdtype(d, mx.floating))
    mx.eval(module.parameters())  # sync: once, at load time
    ids = None
    if d2t is not None:
        ids = (mx.arange(d2t.shape[0]) + d2t.astype(mx.int64)).astype(mx.int32)
        lo, hi = mx.min(ids).item(), mx.max(ids).item()  # sync: once, at load time
        if lo < 0 or hi >= target.vocab_size:
            raise ModelLoadError(f"{p.name}: d2t maps draft ids outside the target's vocabulary [0, {target.vocab_size})")
    elif draft_vocab != target.vocab_size:
        raise ModelLoadError(f"{p.name}: a draft vocabulary of {draft_vocab} needs its d2t map")
    head = BoundEagle3Head(module, aux, ids)
    view = dataclasses.replace(lm, target=aux, head=head, drafter_kind=KIND,
                               default_k=int(cfg.get("num_draft_tokens", lm.default_k)))
    return view


def _flat(module: nn.Module):
    from mlx.utils import tree_flatten

    return tree_flatten(module.parameters())
