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
near-ties (docs/design.md §3). Costs 4 bytes per weight in memory (and, for a twin up to
KEEP_MAX_BYTES, on disk: kept across processes, `materialized`).
"""

from __future__ import annotations

import copy
import os

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


def _dequantized(m: nn.Module, rows: slice = slice(None)) -> mx.array:
    biases = m.get("biases")
    return mx.dequantize(m.weight[rows], m.scales[rows], None if biases is None else biases[rows], m.group_size,
                         m.bits, mode=m.mode, dtype=mx.float32)


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


# A twin up to this size is kept on disk across processes (GMLX_KEEP_MEASURED, gmlx/measured.py): read
# back, it is the same float32 values (`_read` checks rows of it). SmolLM2-135M at 4 bits: 538 MB,
# read and checked in ~0.3 s where dequantizing took ~1.7 s of each `gmlx generate`'s start here
# (2026-12-06); a larger twin is computed at every load rather than written out.
KEEP_MAX_BYTES = 1 << 30


def materialized(model: nn.Module, source: tuple | None = None) -> nn.Module:
    """The twin with its dequantized weights computed now (at load time, not in a first verify), or
    read where an earlier process kept them for the model's `source` (its files)."""
    out = twin(model)
    own = dict(out.named_modules())
    quantized = {f"{name}.weight": m for name, m in model.named_modules()
                 if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))}
    made = {k: own[k[:-len(".weight")]] for k in quantized}  # (the modules whose weight twin() dequantized)
    size = sum(4 * m.weight.size for m in made.values())
    path = measured.artifact("twin", source) if source is not None and size <= KEEP_MAX_BYTES else None
    kept = _read(path, made, quantized) if path is not None else None
    for k, w in (kept or {}).items():
        made[k].weight = w
    mx.eval([v for _, v in tree_flatten(out.parameters())])  # sync: once, at load time
    if path is not None and kept is None:
        _write(path, {k: m.weight for k, m in made.items()})
    return out


def _read(path, made: dict[str, nn.Module], quantized: dict[str, nn.Module]) -> dict[str, mx.array] | None:
    """The kept twin's weights (by name, for the twin's modules `made` from `quantized`), if fresh and
    whole: every array of the shape and type the twin's, and its first and last rows those rows
    dequantized now (a file of another model, or one damaged where it was written, is not taken).
    The rows are compared within a float32 ulp or two, not bit for bit: one row dequantized alone is
    another shape than the whole matrix, and a kernel may round another shape differently."""
    if not measured.fresh(path):
        return None
    try:
        got = mx.load(str(path))
    except (OSError, RuntimeError, ValueError):
        return None  # cut short: computed again and written anew
    want = {k: m.weight for k, m in made.items()}
    if got.keys() != want.keys() or any(got[k].shape != want[k].shape or got[k].dtype != want[k].dtype for k in want):
        return None
    ends = (slice(0, 1), slice(-1, None))
    same = mx.stack([mx.allclose(got[k][r], _dequantized(m, r), rtol=1e-6, atol=1e-7)
                     for k, m in quantized.items() for r in ends]).all().item()  # sync: once, at load time
    return got if same else None


def _write(path, weights: dict[str, mx.array]) -> None:
    tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.safetensors")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        mx.save_safetensors(str(tmp), weights)
        tmp.replace(path)  # whole or not at all
        measured.prune()
    except (OSError, RuntimeError) as e:
        tmp.unlink(missing_ok=True)
        measured.cannot_keep("twin", path.parent, e)


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
