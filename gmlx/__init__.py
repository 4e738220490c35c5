"""gmlx: speculative decoding and continuous batching on MLX."""

from gmlx import blas as _blas

_blas.ensure_loaded()  # must precede the first `import mlx.core`

__version__ = "0.1.0"

from gmlx.config import EngineConfig, SamplingParams  # noqa: E402
from gmlx.errors import GmlxError  # noqa: E402

__all__ = ["Engine", "EngineConfig", "SamplingParams", "GmlxError", "default_model_path", "load"]

# The engine and the loader pull in mlx-lm (and transformers): about a second. They are imported
# on first use (PEP 562), so that `import gmlx.errors` or `gmlx --help` does not pay for them.
_LAZY = {"Engine": "gmlx.engine", "default_model_path": "gmlx.models.loading", "load": "gmlx.models.loading"}


def __getattr__(name: str):
    import importlib

    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    try:  # a submodule not imported yet (`gmlx.engine` after a bare `import gmlx`), as before
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
