"""gmlx: speculative decoding and continuous batching on MLX."""

from gmlx import blas as _blas

_blas.ensure_loaded()  # must precede the first `import mlx.core`

__version__ = "0.1.0"

from gmlx.config import EngineConfig, SamplingParams  # noqa: E402
from gmlx.engine import Engine  # noqa: E402
from gmlx.errors import GmlxError  # noqa: E402
from gmlx.models.loading import default_model_path, load  # noqa: E402

__all__ = ["Engine", "EngineConfig", "SamplingParams", "GmlxError", "default_model_path", "load"]
