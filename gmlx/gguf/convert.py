"""Convert a llama-architecture GGUF file (llama.cpp, Ollama) into an mlx-lm model directory.

MLX loads Q4_0, Q4_1 and Q8_0 tensors straight into its affine-quantized layout (`weight`,
`scales`, `biases`; one GGML block of 32 is one quantization group), so a `q` conversion keeps
the file's bits exactly; `float16`/`float32` dequantize them. What the conversion does beyond
renaming: q/k rows are un-permuted from llama.cpp's rotary layout back to the Hugging Face one
mlx-lm's llama expects, bits are declared per layer where they differ (the embedding is often 8
bits beside 4-bit linears), and the tokenizer is rebuilt from the metadata (`gguf_tokenizer`).

`cached_conversion` is what `gmlx.models.loading.load` calls for a `.gguf` path: it converts
once into a cache directory keyed by the file's name, size, mtime and the dtype.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path

import mlx.core as mx

from gmlx import switches
from gmlx.gguf.reader import GGUFError, Header, load_tensors, read_header
from gmlx.gguf.tokenizer import eos_ids, write_tokenizer

DTYPES = ("q", "float16", "float32")
SUPPORTED_TYPES = ("Q4_0", "Q4_1", "Q8_0", "F16", "F32")
GROUP_SIZE = 32  # GGML's block for Q4_0/Q4_1/Q8_0; MLX loads each block as one group
ORIGIN_FILE = "gmlx_origin.json"

_LAYER = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_PARTS = ("weight", "scales", "biases")


def convert_gguf(src: str | Path, out_dir: str | Path, dtype: str = "q") -> Path:
    """Write an mlx-lm llama directory for `src` into `out_dir` (absent or empty) and return it.

    dtype "q" keeps the file's quantization; "float16"/"float32" dequantize every tensor. The
    directory appears complete or not at all (written beside it, then renamed)."""
    src, out = Path(src).expanduser(), Path(out_dir).expanduser()
    if dtype not in DTYPES:
        raise GGUFError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if not src.is_file():
        raise GGUFError(f"GGUF file {str(src)!r} does not exist")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise GGUFError(f"output {str(out)!r} already exists and is not an empty directory; choose a new one")
    header = read_header(src)
    unsupported = {t.type for t in header.tensors} - set(SUPPORTED_TYPES)
    if unsupported:
        first = next(t for t in header.tensors if t.type in unsupported)
        raise GGUFError(f"{src.name}: tensor type {', '.join(sorted(unsupported))} (e.g. {first.name}) is not"
                        f" supported; gmlx converts {', '.join(SUPPORTED_TYPES)} (re-quantize with llama.cpp)")
    raw, meta = load_tensors(src)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise GGUFError(f"{src.name}: architecture {arch!r} is not supported (gmlx converts llama-architecture GGUF)")
    config = model_config(meta, raw)
    weights = hf_weights(raw, config)
    if dtype == "q":
        quant = quantization(weights)
        if quant:
            config["quantization"] = config["quantization_config"] = quant
    else:
        weights = dequantized(weights, getattr(mx, dtype))

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        tmp.chmod(0o755)  # mkdtemp's 0700 would make a model directory private to its writer
    except OSError as e:
        raise GGUFError(f"cannot write into {str(out.parent)!r}: {e.strerror or e}") from None
    try:
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        write_tokenizer(meta, tmp, config.get("max_position_embeddings"))
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / ORIGIN_FILE).write_text(json.dumps(origin(src, header, meta, dtype), indent=2) + "\n")
        return _publish(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _publish(tmp: Path, out: Path) -> Path:
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()  # renaming onto a directory fails on some platforms, even onto an empty one
    try:
        os.rename(tmp, out)
    except OSError as e:
        if not (out / "config.json").is_file():  # not another process's finished conversion of the same file
            raise GGUFError(f"cannot create {str(out)!r}: {e.strerror or e}") from None
    return out


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


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def origin(src: Path, header: Header, meta: dict, dtype: str) -> dict:
    st = src.stat()
    return {
        "source": src.name,
        "source_path": str(src.resolve()),
        "size": st.st_size,
        "mtime": st.st_mtime,
        "sha256": file_sha256(src),
        "name": meta.get("general.name"),
        "architecture": meta.get("general.architecture"),
        "tensor_types": header.type_counts(),
        "dtype": dtype,
        "converted": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def read_origin(model_dir: str | Path) -> dict | None:
    """The conversion record beside a converted model, or None for a model not made from GGUF."""
    p = Path(model_dir) / ORIGIN_FILE
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def describe_origin(model_dir: str | Path) -> str | None:
    """One line for `gmlx doctor`: the GGUF file, its tensor types and the dtype converted to."""
    o = read_origin(model_dir)
    if o is None:
        return None
    types = ", ".join(f"{t} x{n}" for t, n in o.get("tensor_types", {}).items())
    kept = "quantization kept" if o.get("dtype") == "q" else f"dequantized to {o.get('dtype')}"
    return f"GGUF {o.get('source')} ({types}; {kept}; sha256 {str(o.get('sha256'))[:12]})"


def cache_root() -> Path:
    if (chosen := switches.CACHE.value()) is not None:
        return Path(chosen).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "gmlx"


def cached_conversion(src: str | Path, dtype: str = "q") -> Path:
    """The converted directory for a GGUF file, converting it on first use (`--model FILE.gguf`).

    Keyed by the file's content (sha256; ~0.1-0.3 s for 100 MB) and the dtype, not by its path or
    mtime: the same file installed into another virtualenv reuses the conversion. Writing a new
    conversion removes the stale ones of the same file name (see `prune_stale`)."""
    src = Path(src).expanduser().resolve()
    if not src.is_file():
        raise GGUFError(f"GGUF file {str(src)!r} does not exist")
    if dtype not in DTYPES:
        raise GGUFError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    sha = file_sha256(src)
    out = cache_root() / "gguf" / f"{src.stem}-{dtype}-{sha[:16]}"
    if (out / "config.json").is_file():  # a finished conversion: directories appear only complete
        return out
    out = convert_gguf(src, out, dtype)
    prune_stale(out)
    return out


def prune_stale(keep: Path) -> list[Path]:
    """Remove the stale conversions beside `keep` of a file with the same name: the same content
    and dtype under another key (the mtime-keyed caches before), or other content whose file is
    gone or was replaced since (an old virtualenv's copy, an upgraded package), whatever the dtype.
    Kept: other dtypes of this content, and conversions of a different file that is still in
    place (another installation may be using it). Returns what was removed."""
    mine = read_origin(keep)
    if mine is None:
        return []
    removed = []
    for d in keep.parent.iterdir():
        if d == keep or not d.is_dir() or d.name.startswith("."):
            continue
        o = read_origin(d)
        if o is None or o.get("source") != mine.get("source"):
            continue
        same_content = o.get("sha256") == mine.get("sha256")
        if (same_content and o.get("dtype") == mine.get("dtype")) or (not same_content and not _source_unchanged(o)):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


def _source_unchanged(o: dict) -> bool:
    """Whether the file a conversion was made from is still there as it was (size and mtime)."""
    try:
        st = Path(str(o.get("source_path"))).stat()
    except OSError:
        return False
    return st.st_size == o.get("size") and st.st_mtime == o.get("mtime")
