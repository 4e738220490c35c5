"""The target's residual streams an EAGLE-3 head reads (gmlx/heads/eagle3_head.py): which
layers, and a view of the target that captures them.

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
"""

from __future__ import annotations

import copy

import mlx.core as mx
import mlx.nn as nn

from gmlx import switches
from gmlx.errors import ModelLoadError
from gmlx.models.adapter import one_forward


class _Tap:
    """A layer (or the final norm) of a backbone copy that records the stream entering it."""

    def __init__(self, module, index: int, sink: dict):
        self._module, self._index, self._sink = module, index, sink

    def __call__(self, x, *args, **kwargs):
        self._sink[self._index] = x
        return self._module(x, *args, **kwargs)

    def __getattr__(self, name):  # the backbone may read a layer's attributes (use_sliding, ...)
        return getattr(self._module, name)


def tapped(backbone: nn.Module, entering: tuple[int, ...], sink: dict) -> nn.Module:
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
        self.__dict__["_own"] = (tapped(target.backbone, self.entering, sink), target.lm_head)
        self.__dict__["_wide"] = (None if target.wide is None
                                  else (tapped(target.wide[0], self.entering, sink), target.wide[3]))

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
        with one_forward():  # (shared rotary angles, early dispatch: gmlx/models/adapter.py)
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
