"""MTP heads that ship inside a checkpoint (DeepSeek-V3 and Qwen3-Next layouts).

Both are the same computation under different tensor names:

    g = out_norm(layer(fc(concat(embed_norm(E[x_{t+1}]), hidden_norm(h_t)))))
    logits = lm_head(g)                     (the target's LM head and embedding: shared)

| part         | DeepSeek-V3: `model.layers.{N}.*`, N = num_hidden_layers | Qwen3-Next: `mtp.*`       |
|--------------|-----------------------------------------------------------|---------------------------|
| embed_norm   | enorm                                                     | pre_fc_norm_embedding     |
| hidden_norm  | hnorm                                                     | pre_fc_norm_hidden        |
| fc (2D -> D) | eh_proj                                                   | fc                        |
| layer        | the block's own self_attn / mlp / norms (layer N's rules) | layers.0.* (full attention) |
| out_norm     | shared_head.norm                                          | norm                      |
| shared       | embed_tokens, shared_head.head (copies of the target's)   | lm_head (the target's)    |

The concat order is [embedding, hidden] and h_t is the target's hidden *after* its final norm:
that is what vLLM (deepseek_mtp.py, qwen3_next_mtp.py: the target model's returned hidden is
its `norm` output) and SGLang (deepseek_nextn.py) feed these heads, and what Megatron's MTP
trains on (the decoder output, final layernorm included). Drafting k > 1 chains g, which is
also post-norm (out_norm applied), as vLLM does for Qwen3-Next and SGLang for DeepSeek
(vLLM chains DeepSeek's pre-`shared_head.norm` output instead). The head's positions are its
own cache's (RoPE is relative, so a head that starts at 0 drafts the same).

The decoder layer is the target family's own mlx-lm class, built with the target's args and
the layer index whose rules the MTP layer follows (N for DeepSeek-V3: MoE or dense as layer N
would be; a full-attention index for Qwen3-Next), and its tensors go through the family's own
`sanitize` (fp8 dequant, expert stacking, MLA's kv_b_proj split) as if they were layer 0.
Norms follow whatever mlx-lm did to the target's final norm: Qwen3-Next's HF checkpoints store
zero-centred norms (x * (1 + w)) and mlx-lm adds 1 at load, so the head's norms get the same
offset (measured, not assumed: loaded final norm - on-disk final norm).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask

from gmlx.errors import ModelLoadError
from gmlx.models.checkpoint import Checkpoint
from gmlx.heads.bound import BoundHead
from gmlx.models.adapter import POST_NORM

_FINAL_NORM_NAMES = ("model.norm.weight", "model.language_model.norm.weight", "language_model.model.norm.weight")


@dataclass(frozen=True)
class Layout:
    name: str  # the drafter kind is f"native-mtp:{name}"
    prefix: str  # every tensor of the head starts with it
    marker: str  # the tensor (under prefix) whose presence identifies the layout
    layer_prefix: str  # the decoder layer's tensors, under `prefix`
    parts: tuple[tuple[str, str], ...]  # (checkpoint name under prefix, head attribute)
    shared: tuple[str, ...]  # names under prefix that duplicate the target's and are not loaded
    depth_keys: tuple[str, ...]  # config fields giving the number of MTP layers


def deepseek_layout(num_layers: int) -> Layout:
    return Layout("deepseek_v3", f"model.layers.{num_layers}.", "eh_proj.weight", "",
                  (("enorm", "embed_norm"), ("hnorm", "hidden_norm"), ("eh_proj", "fc"),
                   ("shared_head.norm", "out_norm")),
                  ("embed_tokens.", "shared_head.head."), ("num_nextn_predict_layers",))


QWEN3_NEXT = Layout("qwen3_next", "mtp.", "fc.weight", "layers.0.",
                    (("pre_fc_norm_embedding", "embed_norm"), ("pre_fc_norm_hidden", "hidden_norm"), ("fc", "fc"),
                     ("norm", "out_norm")),
                    ("embed_tokens.", "lm_head."), ("num_nextn_predict_layers", "mtp_num_hidden_layers"))


class NativeMTPModule(nn.Module):
    def __init__(self, layer: nn.Module, dims: int, eps: float):
        super().__init__()
        self.embed_norm = nn.RMSNorm(dims, eps=eps)
        self.hidden_norm = nn.RMSNorm(dims, eps=eps)
        self.fc = nn.Linear(2 * dims, dims, bias=False)
        self.layer = layer
        self.out_norm = nn.RMSNorm(dims, eps=eps)

    def __call__(self, embeds: mx.array, hidden: mx.array, cache=None) -> mx.array:
        x = self.fc(mx.concatenate([self.embed_norm(embeds), self.hidden_norm(hidden)], axis=-1))
        # An array mask: MLA attention (DeepSeek) masks its scores itself and needs one.
        mask = create_attention_mask(x, cache, return_array=True)
        return self.out_norm(self.layer(x, mask, cache))


class BoundNativeHead(BoundHead):
    hidden_convention = POST_NORM

    def __init__(self, module: NativeMTPModule, target, layout: str):
        super().__init__(target)
        self.module = module
        self.layout = layout
        self.kind = f"native-mtp:{layout}"

    def forward(self, embeds: mx.array, hidden: mx.array, cache) -> mx.array:
        return self.module(embeds, hidden, cache)

    def logits(self, g: mx.array) -> mx.array:
        return self.target.lm_head(g)


# -- finding and loading --------------------------------------------------------------------
def text_args(model: nn.Module):
    """The decoder's ModelArgs (one level down for wrapped families such as qwen3_5)."""
    return getattr(getattr(model, "language_model", model), "args")


def find_layout(ckpt: Checkpoint, model: nn.Module, config: dict) -> Layout | None:
    text = config.get("text_config", config)
    candidates = [deepseek_layout(int(text_args(model).num_hidden_layers)), QWEN3_NEXT]
    for layout in candidates:
        depth = next((text.get(k) for k in layout.depth_keys if text.get(k) is not None), None)
        if depth == 0:  # the config says the checkpoint has no MTP layer: trust it
            continue
        if layout.prefix + layout.marker in ckpt:
            return layout
    return None


def load_native_head(ckpt: Checkpoint, model: nn.Module, config: dict) -> tuple[NativeMTPModule, Layout] | None:
    """The checkpoint's own MTP head (depth 1), or None when it ships none."""
    layout = find_layout(ckpt, model, config)
    if layout is None:
        return None
    raw = {n[len(layout.prefix):]: v for n, v in ckpt.load(_head_names(ckpt, layout)).items()}
    module = _build(model, layout)
    weights = _to_module_names(raw, layout)
    weights = _sanitized(model, weights)
    offset = _norm_offset(ckpt, model)
    for k, v in raw.items():  # norms: what mlx-lm did to the target's final norm (see module doc)
        name = _module_name(k, layout)
        if name is not None and k.endswith("norm.weight") and v.ndim == 1:
            weights[name] = v + mx.array(offset, dtype=v.dtype) if offset else v
    _maybe_quantize(module, weights, config)
    try:
        module.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ModelLoadError(f"the {layout.name}-layout MTP tensors in {ckpt.path} do not fit a"
                             f" {type(module.layer).__name__} built from its config.json: {e}") from None
    module.eval()
    mx.eval(module.parameters())  # sync: materialise weights at load time
    return module, layout


def _head_names(ckpt: Checkpoint, layout: Layout) -> list[str]:
    """The checkpoint names of the depth-1 head, without the copies of the target's weights.
    (DeepSeek's deeper MTP layers are other `model.layers.{N+i}`; Qwen's are `mtp.layers.{i}`.)"""
    out = []
    for n in ckpt.names():
        sub = n[len(layout.prefix):]
        if not n.startswith(layout.prefix) or sub.startswith(layout.shared):
            continue
        if layout.layer_prefix and sub.startswith("layers.") and not sub.startswith(layout.layer_prefix):
            continue
        out.append(n)
    return out


def _build(model: nn.Module, layout: Layout) -> NativeMTPModule:
    args = text_args(model)
    layers = model.model.layers
    cls = type(layers[0])
    if layout.name == "deepseek_v3":
        index = int(args.num_hidden_layers)  # layer N follows layer N's dense/MoE rule
    else:  # a full-attention layer (hybrid families mark linear-attention layers `is_linear`)
        index = next((i for i, lyr in enumerate(layers) if not getattr(lyr, "is_linear", False)), None)
        if index is None:
            raise ModelLoadError(f"{type(model).__module__} has no full-attention layer to build its MTP layer from")
    kwargs = {"layer_idx": index} if "layer_idx" in inspect.signature(cls.__init__).parameters else {}
    return NativeMTPModule(cls(args, **kwargs), int(args.hidden_size), float(getattr(args, "rms_norm_eps", 1e-6)))


def _module_name(name: str, layout: Layout) -> str | None:
    """Checkpoint name (under the layout's prefix) -> the module's parameter name."""
    for ckpt_name, attr in layout.parts:
        if name.startswith(ckpt_name + "."):
            return attr + name[len(ckpt_name):]
    if name.startswith(layout.layer_prefix):
        return "layer." + name[len(layout.layer_prefix):]
    return None


def _to_module_names(raw: dict[str, mx.array], layout: Layout) -> dict[str, mx.array]:
    out = {}
    for k, v in raw.items():
        name = _module_name(k, layout)
        if name is None:
            raise ModelLoadError(f"unexpected MTP tensor {layout.prefix}{k}; gmlx does not know where it goes")
        out[name] = v
    return out


_AS_LAYER = "model.layers.0."


def _sanitized(model: nn.Module, weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Run the family's sanitize over the head's tensors posing as layer 0's (fp8 scales, expert
    stacking, MLA splits are keyed by layer names), then take the names back."""
    if not hasattr(model, "sanitize"):
        return weights
    own = {k.split(".", 1)[0] for k in weights if not k.startswith("layer.")}  # embed_norm, fc, ...
    posed = {_AS_LAYER + k.removeprefix("layer."): v for k, v in weights.items()}
    out = model.sanitize(dict(posed))
    marker = _AS_LAYER[len("model."):]  # wrapped families may move the prefix (qwen3_5: language_model.)
    result = {}
    for k, v in out.items():
        if marker in k:
            name = k.split(marker, 1)[1]
            result[name if name.split(".", 1)[0] in own else "layer." + name] = v
    return result


def _norm_offset(ckpt: Checkpoint, model: nn.Module) -> float:
    name = next((n for n in _FINAL_NORM_NAMES if n in ckpt), None)
    if name is None:
        return 0.0
    disk = ckpt.load([name])[name].astype(mx.float32)
    delta = model.model.norm.weight.astype(mx.float32) - disk
    off = round(float(delta.mean().item()))  # sync: once, at load time
    if float(mx.abs(delta - off).max().item()) > 1e-2:  # sync: once, at load time
        raise ModelLoadError(f"{ckpt.path}: mlx-lm changed the final norm's weights in a way gmlx cannot"
                             " mirror on the MTP head's norms; load without speculation (--no-speculative)")
    return float(off)


def _maybe_quantize(module: NativeMTPModule, weights: dict[str, mx.array], config: dict) -> None:
    """An MLX-quantized checkpoint quantizes the head's linears as mlx-lm does the target's."""
    q = config.get("quantization")
    if not q or not any(k.endswith(".scales") for k in weights):
        return
    nn.quantize(module, group_size=q["group_size"], bits=q["bits"], mode=q.get("mode", "affine"),
                class_predicate=lambda p, m: hasattr(m, "to_quantized") and f"{p}.scales" in weights)
