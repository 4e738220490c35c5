"""A dequantized twin of a quantized target, for its multi-token forwards on the CPU.

MLX's quantized matmul on the CPU costs about L decode steps for L rows (SmolLM2-135M at 4 bits:
a forward of 4 tokens costs 3.5 one-token steps, 16 tokens 13.5), so a verify of k+1 tokens costs
k+1 steps and speculation can never pay there, while a float32 matmul through OpenBLAS costs
~1.5 steps for 4 rows. The twin is the
same module tree with every QuantizedLinear / QuantizedEmbedding replaced by its float32
dequantization (the same weights: scale * q + bias per group), sharing everything else; the
target uses it for forwards of more than one token (verify, prefill). One-token decode steps use
whichever is faster on this machine, measured at load (`decodes_faster`): a large model's steps
are bound by memory bandwidth, which favours the quantized weights; a small one's are not (the
embedded model at 4 bits: ~38 quantized vs ~67 tokens/s through the twin on a 2-core Xeon).
`GMLX_DEQUANTIZED_DECODE=1/0` forces the choice. The two paths round differently (other
kernels), as a verify and a decode step always do: streams stay equal to plain decoding up to
near-ties (docs/design.md §3). Costs 4 bytes per weight in memory.
"""

from __future__ import annotations

import copy

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from gmlx import measured, switches
from gmlx.timing import fastest


def wanted(model: nn.Module) -> bool:
    """Quantized layers, on the CPU, not switched off (GMLX_DEQUANTIZED_VERIFY=0)."""
    if not switches.DEQUANTIZED_VERIFY.value():
        return False
    if mx.default_device().type != mx.DeviceType.cpu:
        return False  # GPU kernels verify k+1 quantized rows at about one step's cost
    return any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules())


def _dequantized(m: nn.Module) -> mx.array:
    return mx.dequantize(m.weight, m.scales, m.get("biases"), m.group_size, m.bits, mode=m.mode, dtype=mx.float32)


def twin(module: nn.Module) -> nn.Module:
    """The module with its quantized layers dequantized (other arrays shared, not copied)."""
    if isinstance(module, nn.QuantizedLinear):
        out, _ = module.weight.shape
        lin = nn.Linear(1, out, bias="bias" in module)
        lin.weight = _dequantized(module)
        if "bias" in module:
            lin.bias = module.bias
        return lin
    if isinstance(module, nn.QuantizedEmbedding):
        emb = nn.Embedding(module.num_embeddings, module.dims)
        emb.weight = _dequantized(module)
        return emb
    out = copy.copy(module)  # nn.Module is a dict of its children: a shallow copy shares the rest
    for name, child in module.children().items():
        out[name] = _twin_value(child)
    return out


def _twin_value(v):
    if isinstance(v, nn.Module):
        return twin(v)
    if isinstance(v, list):
        return [_twin_value(x) for x in v]
    if isinstance(v, dict):
        return {k: _twin_value(x) for k, x in v.items()}
    return v


def materialized(model: nn.Module) -> nn.Module:
    """The twin with its dequantized weights computed now (at load time, not in a first verify)."""
    out = twin(model)
    mx.eval([v for _, v in tree_flatten(out.parameters())])  # sync: once, at load time
    return out


def decodes_faster(model: nn.Module, twin_model: nn.Module, source: tuple | None = None) -> bool:
    """Whether the twin's one-token step beats the quantized one here by 10 % (fastest of 5 each,
    interleaved, after a warm-up), unless GMLX_DEQUANTIZED_DECODE forces the answer; kept across
    processes under the model's `source` (gmlx/measured.py)."""
    forced = switches.DEQUANTIZED_DECODE.value()
    if forced is not None:
        return forced
    if source is not None and (kept := measured.recall("decode_path", source)) is not None:
        return bool(kept[0])
    x = mx.array([[1]], dtype=mx.int32)

    def step(m):
        return lambda: mx.eval(m(x))  # sync: timing whole one-token forwards, once at load time

    quantized, twin = fastest([step(model), step(twin_model)])
    if source is not None:
        measured.keep("decode_path", source, twin < 0.9 * quantized)
    return twin < 0.9 * quantized
