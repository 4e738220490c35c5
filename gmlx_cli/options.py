"""Command-line options, defined once so every command (generate, bench, sweep-cap) spells them alike.

Ranges are deliberately NOT checked here (no typer `min=`/`max=`): `SamplingParams.validated()`
and `EngineConfig.validated()` are the single source of truth, and their InvalidRequest messages
reach the user through the error boundary in `gmlx_cli.app.main`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from gmlx.config import SamplingParams

# Defaults come from the engine's own records, so the CLI cannot drift from the library.
SAMPLING_DEFAULTS = SamplingParams()

_SAMPLING = "Sampling"
_SPEC = "Speculation"
_OUTPUT = "Output"

PromptArg = Annotated[
    str,
    typer.Argument(metavar="PROMPT", help="The prompt text; [bold]-[/bold] reads it from stdin.", show_default=False),
]
ModelOpt = Annotated[
    Path | None,
    typer.Option(
        "--model",
        help="Local mlx-lm model directory (an MTP head beside it enables speculation)."
        " Default: the embedded model.",
        show_default=False,
    ),
]
MaxTokensOpt = Annotated[
    int, typer.Option("--max-tokens", help="Most tokens to generate (> 0).", rich_help_panel=_SAMPLING)
]
TempOpt = Annotated[
    float, typer.Option("--temp", help="Sampling temperature (0 = greedy).", rich_help_panel=_SAMPLING)
]
TopPOpt = Annotated[
    float, typer.Option("--top-p", help="Nucleus sampling mass, in (0, 1] (1 = off).", rich_help_panel=_SAMPLING)
]
TopKOpt = Annotated[
    int, typer.Option("--top-k", help="Keep the k most likely tokens (0 = off).", rich_help_panel=_SAMPLING)
]
MinPOpt = Annotated[
    float,
    typer.Option("--min-p", help="Drop tokens below min-p x the top probability, in [0, 1] (0 = off).",
                 rich_help_panel=_SAMPLING),
]
SeedOpt = Annotated[
    int | None,
    typer.Option("--seed", help="Sampling seed (>= 0). Default: drawn at random and reported.",
                 show_default=False, rich_help_panel=_SAMPLING),
]
StopOpt = Annotated[
    list[str] | None,
    typer.Option("--stop", help="Stop at this string (not included in the output). Repeatable.",
                 show_default=False, rich_help_panel=_SAMPLING),
]
NumDraftOpt = Annotated[
    int | None,
    typer.Option("--num-draft-tokens", help="Tokens drafted per round (>= 1). Default: the model's.",
                 show_default=False, rich_help_panel=_SPEC),
]
SpeculativeOpt = Annotated[
    bool | None,
    typer.Option(
        "--speculative/--no-speculative",
        help="Speculate with the model's MTP head. Default: when the model has one;"
        " --speculative on a model without a head is an error.",
        show_default=False,
        rich_help_panel=_SPEC,
    ),
]
VerboseOpt = Annotated[
    bool, typer.Option("--verbose", "-v", help="Also report model path, BLAS, K, versions, seed, finish reason.",
                       rich_help_panel=_OUTPUT)
]
JsonOpt = Annotated[
    bool, typer.Option("--json", help="Print one JSON object (text, tokens, stats) instead of streaming.",
                       rich_help_panel=_OUTPUT)
]
# Read by the error boundary straight from argv (it must know before parsing can fail);
# declared here so that it is accepted and documented by every command.
DebugOpt = Annotated[
    bool, typer.Option("--debug", help="Show the full traceback on errors (also GMLX_DEBUG=1).",
                       rich_help_panel=_OUTPUT)
]
