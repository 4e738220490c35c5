"""`gmlx` run in-process by the tests: through `gmlx_cli.app.main`, the error boundary included, with
the model handed in through main()'s `load_model` seam (gmlx_cli/loader.py) instead of loaded from
disk by every command.

Typer 0.29 vendors click and its CliRunner always keeps stdout and stderr apart (there is no
`mix_stderr` any more), so text and stats are asserted on their own streams.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from typer.testing import CliRunner

from gmlx_cli import app as app_mod

_LOADER: dict[str, Callable] = {}  # "load_model": what `run` hands to main() in the current test (use_model)


@dataclass
class Outcome:
    code: int
    stdout: str
    stderr: str


def use_model(monkeypatch, load_model: Callable | None) -> None:
    """Every `run` of the current test loads its model with `load_model(path)` (None: from disk,
    as users run it); undone when the test ends."""
    monkeypatch.setitem(_LOADER, "load_model", load_model)


def run(*args: str, input: str | None = None, env: dict[str, str] | None = None,
        load_model: Callable | None = None) -> Outcome:
    """Invoke `gmlx ARGS` through main(), so the error boundary is under test too. The commands load
    their model with `load_model`, else with what `use_model` set for this test, else from disk."""
    runner = CliRunner()
    with runner.isolation(input=input, env=env) as (out, err, _):
        try:
            app_mod.main(list(args), load_model=load_model or _LOADER.get("load_model"))
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        return Outcome(code, out.getvalue().decode(), err.getvalue().decode())
