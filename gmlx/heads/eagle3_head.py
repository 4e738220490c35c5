"""EAGLE-3 draft heads in their public layout (`--drafter eagle3 --draft-model PATH`): the
checkpoints EAGLE-3's authors release and SGLang (llama_eagle3.py) and vLLM load.

A directory with `config.json` (`architectures: ["LlamaForCausalLMEagle3"]`, or vLLM's name
`Eagle3LlamaForCausalLM`) and `model.safetensors` (or shards `model-*.safetensors`):

| tensor | shape | what |
|---|---|---|
| `fc.weight` | [H, 3 T] | fuses the target's low, middle and high residual streams (T: `target_hidden_size`, default H) |
| `midlayer.input_layernorm.weight`, `midlayer.hidden_norm.weight` | [H] | norms of the token embedding and of the fused hidden |
| `midlayer.self_attn.{q,k,v}_proj.weight` | [heads x head_dim, 2 H] | attention over concat(embedding, hidden) |
| `midlayer.self_attn.o_proj.weight`, `midlayer.post_attention_layernorm.weight`, `midlayer.mlp.{gate,up,down}_proj.weight` | | a llama decoder layer's |
| `norm.weight` | [H] | before the LM head |
| `lm_head.weight` | [draft_vocab_size, H] | the draft's own reduced vocabulary (absent: the target's LM head) |
| `d2t` | [draft_vocab_size] int | draft id -> target id offset: target = draft + d2t[draft] |
| `t2d` | [vocab_size] bool | which target ids the draft vocabulary has (not needed to draft) |
| `embed_tokens.weight` | [vocab_size, H] | optional; absent: the target's embedding (as SGLang shares it) |

A leading `model.` on the names is accepted. One draft layer (`num_hidden_layers: 1`), SiLU MLP.

The computation, per position i (hidden from the target at i, the embedding of token i+1):

    x = fc(concat(a_low, a_mid, a_high))                 a_*: the target's residual stream entering
                                                         the captured layers (3 T -> H)
    h = hidden_norm(x);  r = x (or h with `norm_before_residual`, speculators' option)
    r = self_attn(concat(input_layernorm(embed), h)) + r;   g = mlp(post_attention_layernorm(r)) + r
    logits over the draft vocabulary = lm_head(norm(g)), placed at their target ids

and drafting k tokens chains g (the pre-norm residual, SGLang's `hidden_states_to_aux`) as the
next step's hidden, of width H, where fc is not applied (as SGLang: fc runs when the hidden's
width is not H). The head's KV cache is its own (one layer), positions as the target's.

Which layers: `eagle_aux_hidden_state_layer_ids` (at the top level of config.json, as vLLM's
speculators write it, or under `eagle_config`, as SpecForge writes it) name layer *outputs*, as
SGLang reads them (it captures the stream entering layer j + 1); without them, the stream entering
layers (2, L // 2, L - 3) of an L-layer target, the default of EAGLE-3's own code, SGLang and vLLM.
(vLLM reads explicit ids as the stream entering layer j: one layer earlier than SGLang. gmlx follows
SGLang, whose trainer, SpecForge, writes the ids; `GMLX_EAGLE3_LAYERS=i,j,k` overrides with the
streams entering layers i, j, k.) The stream entering layer L is the last layer's output before the
target's final norm.

Capturing them needs the target's intermediate residual streams: `AuxTarget` is a view of the
target whose forward runs a shallow copy of its backbone in which the captured layers (and the
final norm, for index L) are wrapped to record their input; its hidden is the concatenation
[B, L, 3 T]. Everything else (the plain path, caches, the dequantized twin) is the target's own;
the loaded model itself is not changed, so other engines on it are unaffected.

Exactness never depends on the head: every emitted token is the target's (accept iff equal), so
a token outside the draft vocabulary only costs a rejected draft.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama
from mlx_lm.models.base import create_attention_mask

from gmlx import switches
from gmlx.errors import ModelLoadError
from gmlx.heads.draft_vocab import NEVER
from gmlx.heads.bound import BoundHead

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
KIND = "eagle3"
_OPTIONAL = ("lm_head.weight", "embed_tokens.weight")


# ---- the target's residual streams ---------------------------------------------------------

class _Tap:
    """A layer (or the final norm) of a backbone copy that records the stream entering it."""

    def __init__(self, module, index: int, sink: dict):
        self._module, self._index, self._sink = module, index, sink

    def __call__(self, x, *args, **kwargs):
        self._sink[self._index] = x
        return self._module(x, *args, **kwargs)

    def __getattr__(self, name):  # the backbone may read a layer's attributes (use_sliding, ...)
        return getattr(self._module, name)


def _tapped(backbone: nn.Module, entering: tuple[int, ...], sink: dict) -> nn.Module:
    """A shallow copy of the backbone (the same layer objects and weights) whose layers in
    `entering` record their input; index len(layers) taps the final norm's input."""
    twin = copy.copy(backbone)
    n = len(backbone.layers)
    twin.layers = [_Tap(layer, i, sink) if i in entering else layer for i, layer in enumerate(backbone.layers)]
    if n in entering:
        twin.norm = _Tap(backbone.norm, n, sink)
    return twin


class AuxTarget:
    """The target, whose forward returns as its hidden state the residual streams entering the
    layers in `entering`, concatenated: (logits [B, L, V], hidden [B, L, len(entering) x T]).
    Every other attribute is the wrapped target's."""

    def __init__(self, target, entering: tuple[int, ...]):
        n = target.num_layers
        bad = [i for i in entering if not 1 <= i <= n]
        if bad:
            raise ModelLoadError(f"EAGLE-3: layers {bad} are outside the target's 1..{n} (the stream entering layer"
                                 f" i; {n}: the last layer's output)")
        self.__dict__.update(_target=target, entering=tuple(entering), _sink={})
        sink = self._sink
        self.__dict__["_own"] = (_tapped(target.backbone, self.entering, sink), target.lm_head)
        self.__dict__["_wide"] = (None if target.wide is None
                                  else (_tapped(target.wide[0], self.entering, sink), target.wide[3]))

    def __getattr__(self, name):
        return getattr(self.__dict__["_target"], name)

    @property
    def aux_size(self) -> int:
        return len(self.entering) * self._target.hidden_size

    def __call__(self, tokens: mx.array, cache: list, *, parts: tuple | None = None) -> tuple[mx.array, mx.array]:
        t = self._target
        wide = parts is t.wide if parts is not None else (t.wide is not None and (tokens.shape[1] > 1
                                                                                   or t.decode_on_twin))
        backbone, lm_head = self._wide if wide and self._wide is not None else self._own
        self._sink.clear()
        logits = lm_head(backbone(tokens, cache=cache))
        hidden = mx.concatenate([self._sink[i] for i in self.entering], axis=-1)
        return logits, hidden


def layers_entering(config: dict, num_layers: int) -> tuple[int, ...]:
    """The target layers whose entering stream the head reads (see the module docstring)."""
    chosen = switches.EAGLE3_LAYERS.value()
    if chosen is not None:
        return chosen
    ids = config.get("eagle_aux_hidden_state_layer_ids") or (config.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    if ids:
        return tuple(int(i) + 1 for i in ids)  # outputs of layer i = the stream entering layer i + 1
    return (2, num_layers // 2, num_layers - 3)


# ---- the head ------------------------------------------------------------------------------

class Eagle3Layer(nn.Module):
    def __init__(self, args: llama.ModelArgs, norm_before_residual: bool = False):
        super().__init__()
        d = args.hidden_size
        self.norm_before_residual = norm_before_residual
        self.self_attn = attn = llama.Attention(args)
        head_dim = args.head_dim or d // args.num_attention_heads
        bias = args.attention_bias
        attn.q_proj = nn.Linear(2 * d, args.num_attention_heads * head_dim, bias=bias)
        attn.k_proj = nn.Linear(2 * d, args.num_key_value_heads * head_dim, bias=bias)
        attn.v_proj = nn.Linear(2 * d, args.num_key_value_heads * head_dim, bias=bias)
        self.mlp = llama.MLP(args)
        self.input_layernorm = nn.RMSNorm(d, eps=args.rms_norm_eps)
        self.hidden_norm = nn.RMSNorm(d, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(d, eps=args.rms_norm_eps)

    def __call__(self, embeds: mx.array, hidden: mx.array, mask, cache) -> mx.array:
        h = self.hidden_norm(hidden)
        residual = h if self.norm_before_residual else hidden
        x = mx.concatenate([self.input_layernorm(embeds), h], axis=-1)
        r = self.self_attn(x, mask, cache) + residual
        return self.mlp(self.post_attention_layernorm(r)) + r


class Eagle3Model(nn.Module):
    """The checkpoint's modules under their checkpoint names."""

    def __init__(self, args: llama.ModelArgs, target_hidden: int, draft_vocab: int, n_aux: int,
                 fc_bias: bool = False, norm_before_residual: bool = False, own_lm_head: bool = True,
                 own_embed: bool = False):
        super().__init__()
        d = args.hidden_size
        self.fc = nn.Linear(n_aux * target_hidden, d, bias=fc_bias)
        self.midlayer = Eagle3Layer(args, norm_before_residual)
        self.norm = nn.RMSNorm(d, eps=args.rms_norm_eps)
        if own_lm_head:
            self.lm_head = nn.Linear(d, draft_vocab, bias=False)
        if own_embed:
            self.embed_tokens = nn.Embedding(args.vocab_size, d)


class BoundEagle3Head(BoundHead):
    """An EAGLE-3 head bound to its (aux) target, behind the bound-head interface the MTP drafter
    calls: `head(tokens, hidden, cache) -> g`, `head.logits(g)` over the target's vocabulary."""

    hidden_convention = "eagle3-aux"  # AuxTarget's: the captured residual streams, concatenated
    kind = KIND

    def __init__(self, module: Eagle3Model, target: AuxTarget, target_ids: mx.array | None):
        super().__init__(target)
        self.module = module
        self.ids = target_ids  # [draft_vocab] target id of each draft id (None: the same vocabulary)
        self.vocab_size = target.vocab_size
        self.aux_size = target.aux_size

    def embed(self, tokens: mx.array) -> mx.array:
        if "embed_tokens" in self.module:
            return self.module.embed_tokens(tokens)
        return self.target.embed_tokens(tokens)

    def forward(self, embeds: mx.array, hidden: mx.array, cache) -> mx.array:
        if hidden.shape[-1] == self.aux_size:  # the target's streams (a chained draft step passes g)
            hidden = self.module.fc(hidden)
        return self.module.midlayer(embeds, hidden, create_attention_mask(embeds, cache), cache)

    def sub_logits(self, g: mx.array) -> mx.array:
        x = self.module.norm(g)
        head = self.module.lm_head if "lm_head" in self.module else self.target.lm_head
        return head(x).astype(mx.float32)

    def logits(self, g: mx.array) -> mx.array:
        sub = self.sub_logits(g)
        if self.ids is None:
            return sub
        full = mx.full((*sub.shape[:-1], self.vocab_size), NEVER, dtype=sub.dtype)
        return mx.put_along_axis(full, mx.broadcast_to(self.ids, sub.shape), sub, axis=-1)


# ---- loading -------------------------------------------------------------------------------

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
    if not own_head and draft_vocab != target.vocab_size:
        raise ModelLoadError(f"{p.name}: no lm_head.weight for its draft vocabulary of {draft_vocab}")
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
