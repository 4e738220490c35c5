"""Small rendering helpers shared by the commands: messages, key/value blocks, versions.

Streams are looked up at call time (never bound at import), so tests that swap sys.stdout /
sys.stderr (click's CliRunner) see everything.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import TextIO

PROG = "gmlx"


def one_line(message: str) -> str:
    """Collapse a message to one line: the boundary promises exactly one line per error."""
    return " ".join(str(message).split()) or "(no message)"


def error(message: str) -> None:
    print(f"{PROG}: error: {one_line(message)}", file=sys.stderr, flush=True)


def notice(message: str) -> None:
    print(f"{PROG}: notice: {one_line(message)}", file=sys.stderr, flush=True)


def version_of(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def install_extra(extra: str) -> str:
    """The pip command that adds an extra (serve, client) to this gmlx: from PyPI for an installed
    package, or `pip install -e` of the checkout that gmlx runs from (an editable install, as the
    README's commands make)."""
    root = Path(__file__).resolve().parent.parent
    if (root / "pyproject.toml").is_file() and (root / "gmlx").is_dir():
        where = "." if Path.cwd().resolve() == root else str(root)
        return f"pip install -e \"{where}[{extra}]\""
    return f"pip install 'gmlx[{extra}]'"


def slow_dtype_notice(lm) -> str | None:
    """One line when the model's weights are float16/bfloat16 and MLX computes on the CPU, where
    half-precision matmuls are several times slower than float32 ones (a float16 conversion of
    SmolLM2 decodes at ~1 token/s); None otherwise (float32, quantized, or a GPU)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    if mx.default_device().type != mx.cpu:
        return None
    sizes: dict = {}
    for _, w in tree_flatten(lm.target.model.parameters()):
        sizes[w.dtype] = sizes.get(w.dtype, 0) + w.size
    dtype = max(sizes, key=sizes.get, default=None)  # what most of the weights are (uint32: quantized)
    if dtype not in (mx.float16, mx.bfloat16):
        return None
    from gmlx.gguf.convert import read_origin

    origin = read_origin(lm.path)
    if origin is not None and origin.get("source_path"):
        fix = f"gmlx convert {origin['source_path']} OUT_DIR --dtype float32 (or --dtype q for a quantized file)"
    else:
        fix = f"mlx_lm.convert --hf-path {lm.path} --mlx-path OUT_DIR --dtype float32 (or -q to quantize)"
    name = str(dtype).rsplit(".", 1)[-1]
    return (f"{lm.name} has {name} weights, which decode slowly on the CPU; for speed convert it once: {fix},"
            " then --model OUT_DIR")


def kv_block(rows: Sequence[tuple[str, str]], *, title: str | None = None, file: TextIO | None = None) -> None:
    """Print aligned `key: value` rows; a rich table on a terminal, plain text otherwise.

    Plain text when piped keeps the output greppable and free of escape codes.
    """
    out = file or sys.stdout
    if out.isatty():
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title, show_header=False, box=None, title_justify="left", pad_edge=False)
        table.add_column(style="bold cyan", no_wrap=True)
        table.add_column(overflow="fold")
        for key, value in rows:
            table.add_row(key, value)
        Console(file=out, highlight=False).print(table)
        return
    if title:
        print(title, file=out)
    width = max((len(k) for k, _ in rows), default=0)
    for key, value in rows:
        print(f"{key + ':':<{width + 1}} {value}", file=out)
    out.flush()
