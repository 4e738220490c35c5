"""Convert a llama-architecture GGUF file (llama.cpp, Ollama) into an mlx-lm model directory.

MLX loads Q4_0, Q4_1 and Q8_0 tensors straight into its affine-quantized layout (`weight`,
`scales`, `biases`; one GGML block of 32 is one quantization group), so a `q` conversion keeps
the file's bits exactly; `float16`/`float32` dequantize them. The mapping onto mlx-lm's llama
(config, tensor names, q/k rows, quantization) is gmlx/gguf/llama_layout.py; the tokenizer is
rebuilt from the metadata (gmlx/gguf/tokenizer.py). This file drives the conversion, records its
origin beside the model, and keeps the cache of conversions.

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
from pathlib import Path

import mlx.core as mx

from gmlx import switches
from gmlx.gguf.llama_layout import dequantized, hf_weights, model_config, quantization
from gmlx.gguf.reader import GGUFError, Header, load_tensors, read_header
from gmlx.gguf.tokenizer import write_tokenizer

DTYPES = ("q", "float16", "float32")
SUPPORTED_TYPES = ("Q4_0", "Q4_1", "Q8_0", "F16", "F32")
ORIGIN_FILE = "gmlx_origin.json"


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
    out = switches.cache_root() / "gguf" / f"{src.stem}-{dtype}-{sha[:16]}"
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
