"""`gmlx doctor`: what this installation will run with, and what the model brings to speculation."""

from __future__ import annotations

import platform
import sys

import typer

import gmlx
from gmlx import blas
from gmlx.config import EngineConfig, Switches
from gmlx_cli import ui
from gmlx_cli.loader import loader
from gmlx_cli.options import DebugOpt, DrafterOpt, DraftModelOpt, ModelOpt


def _width_cap(engine) -> tuple[str, str]:
    """The cap the engine starts with and where it comes from (the engine's own resolution; a
    bad switch or config already stopped the engine's start)."""
    d = engine.cap_in_force
    return d.text, d.source + (f"; {d.notice}" if d.notice else "")


def _k_by_width(engine) -> str:
    """The K ceiling that runs at each width (explicit, user config / sweep-cap, or the model's
    default), and where it comes from: what `generate -v` and bench's rounds then show."""
    d = engine.cap_in_force
    ks = ", ".join(f"width {w}: {engine.spec.ceiling(w)}" for w in (1, 2, 4, 8))
    src = ("user config (sweep-cap --write)" if d.k_by_width else f"model default ({engine.lm.default_k})")
    return f"{ks} ({src}; the online control may run fewer, or none)"


def _drafter(lm, engine) -> str:
    from gmlx.drafters.select import available

    others = [k for k in available(lm, engine.draft_lm) if k != getattr(engine.drafter, "kind", None)]
    also = f" (also available: {', '.join(others)})" if others else ""
    if engine.drafter is None:
        if lm.has_drafter and not lm.can_rollback:
            return f"{lm.drafter_kind} (unused: {', '.join(lm.rollback_blockers)} target layers cannot roll back)"
        return "none" + also
    kind = lm.drafter_kind if engine.drafter.kind == "mtp" else engine.drafter.kind
    if engine.drafter.kind == "draft":
        kind += f" ({engine.draft_lm.path})"
    return kind + also


def _hybrid(lm) -> str:
    """A hybrid target's recurrent layers and what rolling them back costs (gmlx/recurrent.py)."""
    from gmlx.models import gated_delta

    line = gated_delta.describe(lm.target.model, lm.rollback_blockers)
    return f"; {line}" if line else ""


def doctor(ctx: typer.Context, model: ModelOpt = None, draft_model: DraftModelOpt = None, drafter: DrafterOpt = None,
           debug: DebugOpt = False) -> None:  # noqa: ARG001 - read by the boundary
    """Report platform, versions, the BLAS in use and the model's speculative defaults."""
    from gmlx.engine import Engine  # mlx-lm (seconds): imported here, not for --help
    from gmlx.gguf.convert import describe_origin
    from gmlx import measured
    from gmlx.models.loading import default_model_path

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
            ("kept at load", measured.summary()),
        ],
        title="environment",
    )
    sys.stdout.flush()
    # Loaded after the environment is printed, so a broken model still leaves a useful report.
    lm = loader(ctx)(model)
    config = EngineConfig(drafter=drafter, draft_model=str(draft_model) if draft_model else None).validated()
    engine = Engine(lm, config, switches=Switches())  # no thread, no request: only what it would run with
    cap, cap_source = _width_cap(engine)
    ui.kv_block(
        [
            ("name", lm.name),
            ("path", str(lm.path)),
            ("origin", describe_origin(lm.path) or "mlx-lm model directory"),
            ("drafter", _drafter(lm, engine)),
            ("target", f"{'routed-expert (MoE)' if lm.is_moe else 'dense'}, hidden {lm.target.hidden_convention}"
                       + _hybrid(lm)),
            ("num_draft_tokens", _k_by_width(engine) if engine.speculative else f"{lm.default_k} (unused)"),
            ("speculation", engine.spec.summary()),
            ("speculative_width_cap", f"{cap} ({cap_source})"),
            ("context length", "unknown" if lm.context_length is None else f"{lm.context_length} tokens"),
        ],
        title="model",
    )
