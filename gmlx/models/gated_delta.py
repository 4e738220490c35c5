"""The Gated DeltaNet side of recurrent rollback (gmlx/recurrent.py holds the cache): which mixers
gmlx captures, their capture forward built from mlx-lm's own ops, the load-time check against
mlx-lm's forward, and what the capture costs (the cost model's prior; `gmlx doctor`'s line).

A mixer gets the capture by a subclass swap on the instance (`install`): with a RecurrentCache
that asks for it, a forward of 2..CAPTURE_MAX positions keeps every position's state and conv
window; with any other cache the subclass calls mlx-lm's `__call__` unchanged.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn

from gmlx.model_cache import recurrent_layers
from gmlx.recurrent import RecurrentCache

_GDN_PROJ = {"qwen3_next": ("in_proj_qkvz", "in_proj_ba"), "qwen3_5": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")}
_GDN_COMMON = ("conv1d", "A_log", "dt_bias", "norm", "out_proj", "conv_kernel_size", "conv_dim", "key_dim",
               "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim")


def _family_module(mixer: nn.Module):
    cls = type(mixer)
    base = cls.__mro__[1] if getattr(cls, "_gmlx_capture", False) else cls
    return sys.modules.get(base.__module__)


def gdn_layout(mixer: nn.Module) -> str | None:
    """'qwen3_next' or 'qwen3_5' when the module is a Gated DeltaNet gmlx can capture, else None."""
    mod = _family_module(mixer)
    if mod is None or not hasattr(mod, "gated_delta_update") or not hasattr(mod, "normalize_qk"):
        return None
    if not all(hasattr(mixer, a) for a in _GDN_COMMON):
        return None
    for name, proj in _GDN_PROJ.items():
        if all(hasattr(mixer, p) for p in proj):
            if name == "qwen3_next" and not hasattr(mixer, "fix_query_key_value_ordering"):
                continue
            return name
    return None


def mixer_of(layer: nn.Module) -> nn.Module | None:
    """The layer's recurrent mixer (a Gated DeltaNet gmlx can capture), or None."""
    for _, m in layer.named_modules():
        if m is not layer and gdn_layout(m) is not None:
            return m
    return None


def _mixer_name(layer: nn.Module) -> str:
    """The most telling class name inside a layer gmlx cannot capture (its mixer, when there
    is a child that takes the cache)."""
    for name in ("linear_attn", "mixer", "mamba", "ssm", "conv", "attn", "self_attn", "attention"):
        m = getattr(layer, name, None)
        if isinstance(m, nn.Module):
            return type(m).__name__
    return type(layer).__name__


_CAPTURING: dict[type, type] = {}


def _capturing(cls: type) -> type:
    """cls with a `__call__` that captures per position for a RecurrentCache, mlx-lm's otherwise."""
    if getattr(cls, "_gmlx_capture", False):
        return cls
    sub = _CAPTURING.get(cls)
    if sub is None:
        def __call__(self, inputs, mask=None, cache=None):
            if mask is None and isinstance(cache, RecurrentCache) and cache.captures(inputs.shape[1]):
                return _gdn_capture(self, inputs, cache)
            return cls.__call__(self, inputs, mask, cache)

        sub = type(cls.__name__, (cls,), {"__call__": __call__, "_gmlx_capture": True, "__module__": cls.__module__,
                                          "__qualname__": cls.__qualname__})
        _CAPTURING[cls] = sub
    return sub


def install(model: nn.Module) -> list[str]:
    """Give every recurrent layer's mixer the capture forward; returns the blockers (why this
    model cannot roll back its recurrent layers; empty when it can, or has none)."""
    found = recurrent_layers(model)
    if not found:
        return []
    missing = sorted({_mixer_name(layer) for _, layer, _ in found if mixer_of(layer) is None})
    if missing:
        return [f"ArraysCache ({', '.join(missing)}: gmlx captures per-position state only for Qwen3-Next /"
                " Qwen3.5 Gated DeltaNet layers)"]
    mixers = [mixer_of(layer) for _, layer, _ in found]
    for m in mixers:
        if not getattr(type(m), "_gmlx_capture", False):
            m.__class__ = _capturing(type(m))
    why = _check(mixers[0])
    if why:
        for m in mixers:  # back to mlx-lm's own class: the model decodes plain
            m.__class__ = type(m).__mro__[1]
        return [f"ArraysCache ({type(mixers[0]).__name__}: {why})"]
    return []


def _check(mixer: nn.Module) -> str | None:
    """gmlx's capture forward against mlx-lm's on this layer's weights: 2 tokens, then 3 more
    (output and state), and every position's state against a prefix forward. None when equal."""
    from mlx_lm.models.cache import ArraysCache

    dtype = _param_dtype(mixer)
    x = (0.5 * mx.random.normal((1, 5, int(mixer.hidden_size)), key=mx.random.key(7))).astype(dtype)
    try:
        ref_c = ArraysCache(2)
        base = type(mixer).__mro__[1]
        base.__call__(mixer, x[:, :2], None, ref_c)
        pre = list(ref_c.cache)
        ref = base.__call__(mixer, x[:, 2:], None, ref_c)
        ours_c = RecurrentCache(2)
        ours_c.cache = list(pre)
        ours = _gdn_capture(mixer, x[:, 2:], ours_c)
        diffs = [_diff(ref, ours)] + [_diff(a, b) for a, b in zip(ref_c.cache, ours_c.cache)]
        one_c = ArraysCache(2)
        one_c.cache = list(pre)
        base.__call__(mixer, x[:, 2:3], None, one_c)
        ours_c.trim(2)  # back to the state after the first of the 3 positions
        diffs += [_diff(a, b) for a, b in zip(one_c.cache, ours_c.cache)]
    except Exception as e:  # noqa: BLE001 - any failure means: do not speculate on this layer
        return f"gmlx's capture forward failed on it ({type(e).__name__}: {e})"
    tol = 1e-5 if dtype == mx.float32 else 1e-2
    worst = max(diffs)
    if worst > tol:
        return f"gmlx's capture forward differs from mlx-lm's by {worst:.3g} (mlx-lm changed this layer?)"
    return None


def _diff(a, b) -> float:
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    return float(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item())  # sync: at load, once


def _param_dtype(m: nn.Module):
    w = getattr(m.out_proj, "weight", None)
    if w is None or w.dtype in (mx.uint32, mx.int32, mx.uint8):
        s = getattr(m.out_proj, "scales", None)
        return s.dtype if s is not None else mx.float32
    return w.dtype


def _projections(layer: nn.Module, inputs: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """(the conv's input qkv [B, S, C], z [B, S, Hv, Dv], b, a) as the family's __call__ makes them."""
    B, S, _ = inputs.shape
    if hasattr(layer, "in_proj_qkvz"):  # Qwen3-Next
        q, k, v, z, b, a = layer.fix_query_key_value_ordering(layer.in_proj_qkvz(inputs), layer.in_proj_ba(inputs))
        mixed = mx.concatenate([q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], axis=-1)
        return mixed, z, b, a
    mixed = layer.in_proj_qkv(inputs)  # Qwen3.5
    z = layer.in_proj_z(inputs).reshape(B, S, layer.num_v_heads, layer.head_v_dim)
    return mixed, z, layer.in_proj_b(inputs), layer.in_proj_a(inputs)


def _gdn_capture(layer: nn.Module, inputs: mx.array, cache: RecurrentCache) -> mx.array:
    """The Gated DeltaNet forward of mlx-lm (qwen3_next / qwen3_5 `__call__`, unmasked), keeping
    the state and conv window after every position in the cache's journal."""
    mod = _family_module(layer)
    B, S, _ = inputs.shape
    group = getattr(layer, "sharding_group", None)
    if group is not None:
        from mlx.nn.layers.distributed import sum_gradients

        inputs = sum_gradients(group)(inputs)
    mixed, z, b, a = _projections(layer, inputs)
    n_keep = layer.conv_kernel_size - 1
    conv_state = cache[0] if cache[0] is not None else mx.zeros((B, n_keep, layer.conv_dim), dtype=inputs.dtype)
    conv_input = mx.concatenate([conv_state, mixed], axis=1)
    conv_out = nn.silu(layer.conv1d(conv_input))
    q, k, v = [
        t.reshape(B, S, h, d)
        for t, h, d in zip(
            mx.split(conv_out, [layer.key_dim, 2 * layer.key_dim], -1),
            [layer.num_k_heads, layer.num_k_heads, layer.num_v_heads],
            [layer.head_k_dim, layer.head_k_dim, layer.head_v_dim],
        )
    ]
    q, k = mod.normalize_qk(q, k, inv_scale=layer.head_k_dim**-0.5, eps=1e-6)
    out, states = _delta_steps(mod, q, k, v, a, b, layer.A_log, layer.dt_bias, cache[1], not layer.training)
    snaps = [(conv_input[:, t:t + n_keep], states[t - 1]) for t in range(1, S)]
    snaps.append((mx.contiguous(conv_input[:, -n_keep:, :]), states[-1]))
    cache.record(snaps)
    out = layer.norm(out, z)
    out = layer.out_proj(out.reshape(B, S, -1))
    if group is not None:
        out = mx.distributed.all_sum(out, group=group)
    return out


def _delta_steps(mod, q, k, v, a, b, A_log, dt_bias, state, use_kernel: bool) -> tuple[mx.array, list[mx.array]]:
    """mlx-lm's `gated_delta_update` (as the family module calls it), position by position:
    the output [B, S, Hv, Dv] and the state after each position. The same kernel or ops mlx-lm
    would pick for this shape and device, so the numbers are mlx-lm's."""
    gd = sys.modules[mod.gated_delta_update.__module__]
    B, S, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    kernel = (use_kernel and mx.default_device() == mx.gpu and mx.metal.is_available()
              and Dk >= 32 and Dk % 32 == 0)
    step = getattr(gd, "_gated_delta_step_ops", None)
    if kernel or step is None:  # one call of mlx-lm's update per position
        ys, states = [], []
        for t in range(S):
            y, state = mod.gated_delta_update(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], a[:, t:t + 1],
                                              b[:, t:t + 1], A_log, dt_bias, state, None, use_kernel=use_kernel)
            ys.append(y)
            states.append(state)
        return mx.concatenate(ys, axis=1), states
    # gated_delta_update -> gated_delta_ops, written out so each position's state is kept
    beta = mx.sigmoid(b)
    g = gd.compute_g(A_log, a, dt_bias)
    if (r := Hv // Hk) > 1:
        q = mx.repeat(q, r, -2)
        k = mx.repeat(k, r, -2)
    ys, states = [], []
    for t in range(S):
        y, state = step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state, None)
        ys.append(y)
        states.append(state)
    return mx.stack(ys, axis=1), states


def describe(model: nn.Module, blockers: Sequence[str] = ()) -> str | None:
    """One line for `gmlx doctor`: the recurrent layers and how they roll back (None: no such layer)."""
    found = recurrent_layers(model)
    if not found:
        return None
    layers = getattr(model, "layers", None) or model.model.layers
    names = sorted({type(m).__name__ if (m := mixer_of(layer)) is not None else _mixer_name(layer)
                    for _, layer, _ in found})
    how = ("not rolled back: decodes plain" if blockers else "rolled back per row by per-position capture (a verify"
           f" of k = 3 costs ~{100 * CAPTURE_COST[3]:.0f} % more at width 1, ~4 % at width 8: benchmarks/bench_hybrid.py)")
    return f"hybrid: {len(found)} of {len(layers)} layers recurrent ({', '.join(names)}), {how}"


# What the capture and the per-row rollback add to a verify forward of k+1 tokens (a fraction
# of it), measured by benchmarks/bench_hybrid.py on a tiny hybrid on this project's 2-core CPU
# (bench_results/20261201T173353Z_hybrid.md: width 1, the mean of the Qwen3-Next and Qwen3.5
# layouts, 21 interleaved pairs; widths 2-8 add 1-4 %, the per-row gather). The engine's probe
# times a hybrid target's verify on its own caches, capture included; these figures scale the
# built-in prior instead when nothing is measured (GMLX_ROUND_COSTS=prior, or a probe that failed).
CAPTURE_COST = {1: 0.015, 2: 0.015, 3: 0.01, 4: 0.015}


def captures(model: nn.Module) -> bool:
    """Whether this model's recurrent layers run the capture forward (a hybrid that speculates)."""
    return any(getattr(type(mixer_of(layer)), "_gmlx_capture", False) for _, layer, _ in recurrent_layers(model))


def prior_verify(verify: Sequence[float], model: nn.Module) -> tuple[float, ...]:
    """The cost model's prior verify[k] for this target: a hybrid's grows by CAPTURE_COST[k]."""
    if not captures(model):
        return tuple(verify)
    last = CAPTURE_COST[max(CAPTURE_COST)]
    return tuple(v if k == 0 else v * (1.0 + CAPTURE_COST.get(k, last)) for k, v in enumerate(verify))
