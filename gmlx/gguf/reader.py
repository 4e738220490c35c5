"""Read a GGUF file: its header (tensor names, shapes and storage types, which `mx.load` hides)
and its tensors and metadata as MLX loads them.

The header is read here because `mx.load` silently dequantizes some storage types (K-quants,
BF16) to float16 and fails on others with an unnamed error; the converter must know what each
tensor really is, to accept only what it handles and to name what it refuses.
"""

from __future__ import annotations

import mmap
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from gmlx.errors import ModelLoadError


class GGUFError(ModelLoadError):
    """A GGUF file gmlx cannot convert: not GGUF, or an architecture or tensor type it does not handle."""


# ggml_type ids (ggml.h); the names are llama.cpp's own.
GGML_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1", 10: "Q2_K",
    11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS",
    19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32",
    27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
}
# Metadata value types: fixed sizes; 8 is a string, 9 an array.
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: the fastest-varying dimension first (the reverse of MLX's)
    type: str  # "Q4_1", "F32", ... ("type 99" for an id this table does not know)
    offset: int  # from the start of the data section


@dataclass(frozen=True)
class Header:
    version: int
    tensors: tuple[TensorInfo, ...]
    data_offset: int  # where tensor data starts in the file

    def type_counts(self) -> dict[str, int]:
        return dict(Counter(t.type for t in self.tensors).most_common())


class _Cursor:
    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str):
        vals = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return vals[0] if len(vals) == 1 else vals

    def string(self) -> str:
        n = self.unpack("Q")
        self.pos += n
        return bytes(self.buf[self.pos - n : self.pos]).decode("utf-8", errors="replace")

    def skip_value(self, vtype: int) -> None:
        if vtype == _STRING:
            n = self.unpack("Q")  # read before adding: `pos += unpack()` would add to the old pos
            self.pos += n
        elif vtype == _ARRAY:
            etype, count = self.unpack("IQ")
            if etype in _SIZES:
                self.pos += _SIZES[etype] * count
            else:
                for _ in range(count):
                    self.skip_value(etype)
        elif vtype in _SIZES:
            self.pos += _SIZES[vtype]
        else:
            raise ValueError(f"unknown metadata value type {vtype}")

    def value(self, vtype: int):
        fmt = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
        return self.string() if vtype == _STRING else self.unpack(fmt[vtype])


def read_header(path: Path) -> Header:
    """The tensor table of a GGUF file (v2 or v3), read without loading any tensor data."""
    path = Path(path)
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            if buf[:4] != b"GGUF":
                raise GGUFError(f"{path.name} is not a GGUF file (it does not start with 'GGUF')")
            return _parse(_Cursor(buf), len(buf))
    except (OSError, ValueError, struct.error) as e:
        raise GGUFError(f"could not read the GGUF header of {path.name}: {e}") from None


def _parse(cur: _Cursor, size: int) -> Header:
    cur.pos = 4
    version = cur.unpack("I")
    if version not in (2, 3):
        raise GGUFError(f"GGUF version {version} is not supported (gmlx reads versions 2 and 3)")
    n_tensors, n_kv = cur.unpack("QQ")
    alignment = 32
    for _ in range(n_kv):
        key, vtype = cur.string(), cur.unpack("I")
        if key == "general.alignment" and vtype != _ARRAY:
            alignment = int(cur.value(vtype))
        else:
            cur.skip_value(vtype)
    tensors = []
    for _ in range(n_tensors):
        name = cur.string()
        ndim = cur.unpack("I")
        shape = tuple(cur.unpack("Q") for _ in range(ndim))
        type_id, offset = cur.unpack("IQ")
        tensors.append(TensorInfo(name, shape, GGML_TYPES.get(type_id, f"type {type_id}"), offset))
    data_offset = cur.pos + (-cur.pos) % alignment
    if data_offset > size:
        raise ValueError("the file ends inside its header (truncated download?)")
    return Header(version, tuple(tensors), data_offset)


def load_tensors(path: Path) -> tuple[dict[str, mx.array], dict]:
    """Tensors (quantized ones as MLX's affine `weight`/`scales`/`biases` triples) and metadata,
    with metadata scalars and arrays as Python values."""
    try:
        weights, meta = mx.load(str(path), return_metadata=True)
    except (RuntimeError, ValueError, OSError) as e:
        raise GGUFError(f"MLX could not load {Path(path).name}: {e}") from None
    return weights, {k: _python(v) for k, v in meta.items()}


def _python(v):
    if isinstance(v, mx.array):
        return v.tolist()  # sync: metadata values are small; the converter reads them as Python values
    return v
