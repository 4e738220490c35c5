"""`gmlx doctor`: what this installation will run with, and what the model brings to speculation."""

from __future__ import annotations

import platform
import sys

import gmlx
from gmlx import blas
from gmlx.config import Switches
from gmlx.errors import GmlxError
from gmlx.models.loading import default_model_path
from gmlx_cli import generate as _generate
from gmlx_cli import ui
from gmlx_cli.options import DebugOpt, ModelOpt


def _width_cap(default_cap: int | None) -> tuple[str, str]:
    """The cap the engine would start with, and where it comes from (env beats the model)."""
    try:
        env_cap = Switches.from_env().width_cap_env
    except GmlxError as e:  # a bad switch is worth showing here, not worth aborting the report
        return "invalid environment", ui.one_line(str(e))
    if env_cap is not None:
        return _cap_text(env_cap), "environment, GMLX_MTP_WIDTH_CAP"
    if default_cap is None:
        return _cap_text(0), "no model default"
    return _cap_text(default_cap), "model default, config.json"


def _cap_text(cap: int) -> str:
    return "0 = uncapped" if cap == 0 else str(cap)


def doctor(model: ModelOpt = None, debug: DebugOpt = False) -> None:  # noqa: ARG001 - read by the boundary
    """Report platform, versions, the BLAS in use and the model's speculative defaults."""
    active = blas.active_blas()
    hint = "" if blas.is_fast() else f"  [install a fast one: {blas.INSTALL_HINT}]"
    ui.kv_block(
        [
            ("platform", platform.platform()),
            ("python", f"{platform.python_version()} ({sys.executable})"),
            ("gmlx", gmlx.__version__),
            ("mlx", ui.version_of("mlx")),
            ("mlx-lm", ui.version_of("mlx-lm")),
            ("BLAS", active + hint),
            ("default model", str(default_model_path())),
        ],
        title="environment",
    )
    sys.stdout.flush()
    # Loaded after the environment is printed, so a broken model still leaves a useful report.
    lm = _generate._load_model(model)
    cap, cap_source = _width_cap(lm.default_cap)
    ui.kv_block(
        [
            ("name", lm.name),
            ("path", str(lm.path)),
            ("drafter", "mtp" if lm.has_drafter else "none"),
            ("num_draft_tokens", f"{lm.default_k} (model default)" if lm.has_drafter else f"{lm.default_k} (unused)"),
            ("speculative_width_cap", f"{cap} ({cap_source})"),
            ("context length", "unknown" if lm.context_length is None else f"{lm.context_length} tokens"),
        ],
        title="model",
    )
