"""`gmlx convert`: a GGUF file (llama.cpp, Ollama) -> an mlx-lm model directory gmlx and mlx-lm load."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from gmlx.gguf.convert import convert_gguf, describe_origin
from gmlx_cli import ui
from gmlx_cli.options import DebugOpt


def convert(
    src: Annotated[Path, typer.Argument(metavar="FILE.gguf", help="A llama-architecture GGUF file"
                                        " (Q4_0, Q4_1, Q8_0, F16 or F32 tensors).", show_default=False)],
    out: Annotated[Path, typer.Argument(metavar="OUT_DIR", help="The model directory to write (new or empty).",
                                        show_default=False)],
    dtype: Annotated[str, typer.Option("--dtype", help="q keeps the file's quantization; float16 or float32"
                                       " dequantize (bigger; float32 decodes faster on a CPU with BLAS).")] = "q",
    debug: DebugOpt = False,  # noqa: ARG001 - read by the error boundary
) -> None:
    """Convert a GGUF file into an mlx-lm model directory (then: gmlx generate --model OUT_DIR)."""
    t0 = time.perf_counter()
    path = convert_gguf(src, out, dtype)
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    ui.kv_block(
        [
            ("model", str(path)),
            ("origin", describe_origin(path) or "?"),
            ("size", f"{size / 2**20:.0f} MiB"),
            ("time", f"{time.perf_counter() - t0:.1f} s"),
        ],
        title="converted",
    )

