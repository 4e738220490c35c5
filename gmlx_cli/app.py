"""The command table and the one error boundary. Commands live in their own modules, imported
only when their command runs (or its help is asked for): `gmlx --help` imports none of them."""

from __future__ import annotations

import ast
import atexit
import difflib
import gc
import importlib
import importlib.util
import inspect
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from typer.core import TyperCommand, TyperGroup

from gmlx import switches
from gmlx.errors import ConfigError, GmlxError
from gmlx_cli import dist, ui

if TYPE_CHECKING:
    from gmlx_cli.loader import LoadModel

# name -> (module, function), in the order `gmlx --help` lists them
COMMANDS = {
    "generate": ("gmlx_cli.generate", "generate"),
    "doctor": ("gmlx_cli.doctor", "doctor"),
    "bench": ("gmlx_cli.bench.bench", "bench"),
    "sweep-cap": ("gmlx_cli.bench.sweep", "sweep_cap"),
    "train-default": ("gmlx_cli.app", "train_default"),
    "convert": ("gmlx_cli.convert", "convert"),
    "serve": ("gmlx_cli.serve", "serve"),
}


def docstring_of(module: str, function: str) -> str:
    """A command's docstring read from its module's source, without importing the module (the
    command modules import mlx-lm, pandas, matplotlib: seconds)."""
    spec = importlib.util.find_spec(module)
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function)
    return inspect.cleandoc(ast.get_docstring(node) or "")


def build_command(name: str) -> TyperCommand:
    """The real command: its module imported, its signature read by typer."""
    module, function = COMMANDS[name]
    one = typer.Typer(rich_markup_mode="rich", pretty_exceptions_enable=False, add_completion=False)
    one.command(name)(getattr(importlib.import_module(module), function))
    return typer.main.get_command(one)


class LazyGroup(TyperGroup):
    """The command group. Listed (`gmlx --help`, typo suggestions) from placeholders that carry
    only the name and the docstring; a command's module is imported when the command is resolved."""

    def __init__(self, **attrs) -> None:
        super().__init__(**attrs)
        for name, (module, function) in COMMANDS.items():
            self.commands.setdefault(name, TyperCommand(name, help=docstring_of(module, function),
                                                        rich_markup_mode=self.rich_markup_mode))
        self._listing = False

    def get_command(self, ctx, cmd_name: str):
        cmd = self.commands.get(cmd_name)
        if cmd is not None and not self._listing and cmd.callback is None and cmd_name in COMMANDS:
            cmd = self.commands[cmd_name] = build_command(cmd_name)
        return cmd

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:  # typer would turn it into a silent exit 130: say why the command ended
            ui.error("interrupted")
            raise typer.Exit(130) from None

    def format_help(self, ctx, formatter) -> None:
        self._listing = True
        try:
            super().format_help(ctx, formatter)
        finally:
            self._listing = False


app = typer.Typer(
    cls=LazyGroup,
    no_args_is_help=True,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
    help="Local speculative generation and benchmarking on MLX.",
)


@app.callback()
def _root() -> None:
    """Local speculative generation and benchmarking on MLX."""
    switches.check()  # every GMLX_* switch, before any command runs: an invalid one is one line here


def train_default(
    out: Annotated[Path, typer.Option("--out", help="Output model directory (replaced atomically).")],
    minutes: Annotated[float, typer.Option("--minutes", help="Wall-clock training budget.")] = 90.0,
) -> None:
    """Train the embedded default model (a small llama with an MTP head, on the Python stdlib)."""
    from gmlx_training.train_default import main as train_main  # heavy: only when asked

    train_main(["--out", str(out), "--minutes", str(minutes)])




def _debug_requested(args: Sequence[str]) -> bool:
    # Read from argv, not from the parsed option: parsing itself may be what fails.
    opts = args[: list(args).index("--")] if "--" in args else args
    try:
        env = switches.DEBUG.value()
    except ConfigError:  # said as the command's error by _root's switches.check()
        env = False
    return env or "--debug" in opts


@atexit.register
def release_mlx_thread() -> None:
    """MLX requires every thread that used it, the main thread included, to destroy its streams
    before the interpreter finalises (mlx#4327); the engine thread does so itself. At exit, not
    at the end of main(): in-process callers (tests) keep using MLX after main() returns."""
    if "mlx.core" not in sys.modules:  # `gmlx --help`, a usage error: MLX never started
        return
    import mlx.core as mx

    mx.synchronize()
    mx.clear_streams()


def main(argv: Sequence[str] | None = None, *, load_model: LoadModel | None = None) -> None:
    """Entry point: run the app; every failure becomes `gmlx: error: <one line>` on stderr.

    Exit codes: 0 ok, 1 GmlxError or internal error, 2 command-line usage error, 130 interrupted.
    `load_model`: how the commands load their model (gmlx_cli/loader.py; default: from disk).
    """
    # Bare `gmlx` shows the help (exit 0) without going through click's NoArgsIsHelpError.
    args = list(sys.argv[1:] if argv is None else argv) or ["--help"]
    try:
        code = _dispatch(args, _debug_requested(args), load_model)
        dist.finish(code)  # --distributed: the other ranks exit with rank 0's code
    finally:
        gc.collect()  # free a closed engine's arrays while MLX is alive
    raise SystemExit(code)


def _dispatch(args: list[str], debug: bool, load_model: LoadModel | None = None) -> int:
    """The error boundary: the only place exceptions become messages and exit codes."""
    try:
        # standalone_mode=False: typer hands us its exceptions instead of printing rich panels;
        # obj: the loader every command's context carries (gmlx_cli.loader.loader).
        rv = app(args=args, prog_name=ui.PROG, standalone_mode=False, obj=load_model)
        return rv if isinstance(rv, int) else 0  # an int is an Exit code (--help, typer.Exit)
    except GmlxError as e:
        return _fail(str(e), debug)
    except typer.TyperException as e:  # usage errors from typer's vendored click: bad option, no PROMPT
        ctx = getattr(e, "ctx", None)
        where = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
        return _fail(_usage_message(e, ctx) + where, debug, exit_code=getattr(e, "exit_code", 2))
    except (typer.Abort, KeyboardInterrupt):
        ui.error("interrupted")
        return 130
    except BrokenPipeError:
        # The reader went away (`gmlx generate ... | head`): stay quiet, like other Unix tools;
        # point stdout at /dev/null so the interpreter's final flush does not complain either.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 1
    except Exception as e:  # a bug: one line by default, the traceback on request
        hint = "" if debug else " (rerun with --debug for the traceback)"
        return _fail(f"internal error: {type(e).__name__}: {e}{hint}", debug)


def close_options(name: str, known: Sequence[str]) -> list[str]:
    """Options that `name` is plausibly a typo of. Click's own suggestion compares whole strings
    with difflib's loose default cutoff, so the shared "--" alone nearly qualifies (`--bogus` got
    `--verbose`); here names are compared without dashes, with a stricter cutoff, or when one
    name is a prefix of the other (`--temperature` for `--temp`)."""
    bare = name.lstrip("-").lower()
    if len(bare) < 2:
        return []
    by_bare = {k.lstrip("-").lower(): k for k in known if k.startswith("--")}
    close = difflib.get_close_matches(bare, by_bare, n=3, cutoff=0.75)
    prefix = [b for b in by_bare if len(min(b, bare, key=len)) >= 3 and (b.startswith(bare) or bare.startswith(b))]
    return [by_bare[b] for b in dict.fromkeys(close + prefix)][:3]


def _usage_message(e: Exception, ctx) -> str:
    """Click's message, with our own typo suggestions for an unknown option."""
    if not (hasattr(e, "option_name") and hasattr(e, "possibilities")) or ctx is None:
        return e.format_message()
    known = [o for p in ctx.command.params for o in (*p.opts, *p.secondary_opts)] + ["--help"]
    close = close_options(e.option_name, known)
    return f"no such option: {e.option_name}" + (f" (did you mean {' or '.join(close)}?)" if close else "")


def _fail(message: str, debug: bool, exit_code: int = 1) -> int:
    if debug:
        traceback.print_exc()
    ui.error(message)
    return exit_code


if __name__ == "__main__":
    main()
