"""How a command gets its model: one seam, passed down explicitly.

`load_model` loads from disk (or the embedded default) and says when the weights' dtype will decode
slowly here. `gmlx_cli.app.main(load_model=...)` hands every command of one invocation another
loader (an in-process caller, e.g. the tests, reuses a model it loaded); it travels in the click
context's `obj`, and a command that loads asks its context with `loader(ctx)`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from gmlx_cli import ui

if TYPE_CHECKING:  # the loader imports mlx-lm: when a command runs, never for --help
    from gmlx.models.loading import LoadedModel

LoadModel = Callable[[Path | None], "LoadedModel"]


def load_model(path: Path | None) -> LoadedModel:
    """The model at `path` (None: the embedded default), with a notice when its dtype is slow here."""
    from gmlx.models.loading import load

    lm = load(path)
    if (line := ui.slow_dtype_notice(lm)) is not None:
        ui.notice(line)
    return lm


def loader(ctx: typer.Context) -> LoadModel:
    """The loader of this invocation: the one main() was given, else `load_model`."""
    return ctx.obj if ctx.obj is not None else load_model
