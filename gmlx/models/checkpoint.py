"""Read tensors from a local checkpoint's safetensors files by name, without mlx-lm.

mlx-lm's loader reads `model*.safetensors` and its families' `sanitize` drop the tensors the
model class has no place for (MTP layers among them). gmlx reads those itself: it lists every
tensor name (from `model.safetensors.index.json`, and from the header of any *.safetensors file
the index does not name), then loads only the files that hold the tensors it wants.

A safetensors file starts with an 8-byte little-endian header length and a JSON header mapping
each tensor name to its dtype, shape and byte range, so listing names never reads weights.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import mlx.core as mx

from gmlx.errors import ModelLoadError

INDEX_FILE = "model.safetensors.index.json"
GMLX_HEAD_FILE = "mtp_head.safetensors"  # gmlx's own head, read by gmlx.heads.mtp_head
_MAX_HEADER = 256 * 1024 * 1024


def header_names(file: Path) -> list[str]:
    """Tensor names in one safetensors file (reads the header only)."""
    try:
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > _MAX_HEADER:
                raise ValueError(f"header of {n} bytes")
            header = json.loads(f.read(n))
    except (OSError, ValueError, struct.error) as e:
        raise ModelLoadError(f"{str(file)!r} is not a readable safetensors file ({e}); re-download or"
                             " re-convert the checkpoint") from None
    return [k for k in header if k != "__metadata__"]


class Checkpoint:
    """Where each tensor of a local checkpoint lives. Cheap to build: headers only."""

    def __init__(self, path: Path):
        self.path = path
        self.files: dict[str, Path] = {}
        index = path / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ModelLoadError(f"{str(index)!r} is not a valid safetensors index ({e})") from None
            self.files.update({k: path / f for k, f in weight_map.items()})
        named = set(self.files.values())
        for f in sorted(path.glob("*.safetensors")):
            if f.name != GMLX_HEAD_FILE and f not in named:
                self.files.update({k: f for k in header_names(f)})

    def names(self) -> list[str]:
        return list(self.files)

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def load(self, names: list[str]) -> dict[str, mx.array]:
        """The named tensors, reading each file that holds any of them once."""
        missing = [n for n in names if n not in self.files]
        if missing:
            raise ModelLoadError(f"{self.path}: tensors {missing[:3]} are not in the checkpoint")
        by_file: dict[Path, list[str]] = {}
        for n in names:
            by_file.setdefault(self.files[n], []).append(n)
        out = {}
        for f, wanted in by_file.items():
            try:
                arrays = mx.load(str(f))
            except (OSError, ValueError, RuntimeError) as e:
                raise ModelLoadError(f"cannot read {str(f)!r}: {e}") from None
            for n in wanted:
                if n not in arrays:
                    raise ModelLoadError(f"{str(f)!r} has no tensor {n!r} although the index names it there")
                out[n] = arrays[n]
        return out


def load_beside(path: str | Path, config_name: str, weights_name: str, build):
    """A module stored beside a model as `config_name` (JSON, given to `build`) and `weights_name`
    (safetensors, loaded strictly); None when either file is absent."""
    p = Path(path)
    cfg_file, w_file = p / config_name, p / weights_name
    if not cfg_file.is_file() or not w_file.is_file():
        return None
    try:
        module = build(json.loads(cfg_file.read_text()))
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ModelLoadError(f"{str(cfg_file)!r} is not a valid head config ({_first_line(e)})") from None
    try:
        module.load_weights(str(w_file), strict=True)
    except (OSError, ValueError, RuntimeError) as e:
        raise weights_error(w_file, e) from None
    module.eval()
    mx.eval(module.parameters())  # sync: materialise weights at load time
    return module


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def weights_error(file: Path, e: BaseException) -> ModelLoadError:
    """A weights file that could not be loaded, named: unreadable (truncated, corrupt), or of
    other names and shapes than its config (a ValueError from a strict load)."""
    detail = _first_line(e).replace("[load_safetensors] ", "").replace(
        " Perhaps an incomplete download or corrupt file?", "")
    if isinstance(e, ValueError):
        return ModelLoadError(f"the weights file {str(file)!r} does not match its config ({detail})")
    return ModelLoadError(f"the weights file {str(file)!r} is truncated or corrupt ({detail}); re-download or"
                          " re-export it")
