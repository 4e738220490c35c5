"""`gmlx doctor`: what this installation will run with, and what the model brings to speculation."""

from __future__ import annotations

import platform
import sys

import gmlx
from gmlx import blas, caps
from gmlx.config import parse_cap_env
from gmlx.errors import GmlxError
from gmlx.models.loading import default_model_path
from gmlx_cli import generate as _generate
from gmlx_cli import ui
from gmlx_cli.options import DebugOpt, ModelOpt


def _width_cap(lm) -> tuple[str, str]:
    """The cap the engine would start with and where it comes from (engine's precedence)."""
    try:
        key = caps.model_key(None if lm.path == default_model_path() else lm.path)
        d = caps.resolve_cap(cli_cap=None, env_cap=parse_cap_env(), model_key=key, **lm.cap_defaults())
    except GmlxError as e:  # a bad switch or config is worth showing here, not worth aborting the report
        return "invalid", ui.one_line(str(e))
    return d.text, d.source + (f"; {d.notice}" if d.notice else "")


def _drafter(lm) -> str:
    if not lm.has_drafter:
        return "none"
    if not lm.can_rollback:
        return f"{lm.drafter_kind} (unused: {', '.join(lm.rollback_blockers)} target layers cannot roll back)"
    return lm.drafter_kind


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
    cap, cap_source = _width_cap(lm)
    ui.kv_block(
        [
            ("name", lm.name),
            ("path", str(lm.path)),
            ("drafter", _drafter(lm)),
            ("target", f"{'routed-expert (MoE)' if lm.is_moe else 'dense'}, hidden {lm.target.hidden_convention}"),
            ("num_draft_tokens", f"{lm.default_k} (model default)" if lm.can_speculate else f"{lm.default_k} (unused)"),
            ("speculative_width_cap", f"{cap} ({cap_source})"),
            ("context length", "unknown" if lm.context_length is None else f"{lm.context_length} tokens"),
        ],
        title="model",
    )
