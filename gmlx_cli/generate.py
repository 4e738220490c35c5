"""`gmlx generate`: parse -> build config -> call the engine -> render. Nothing else lives here."""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from gmlx import blas
from gmlx.config import EngineConfig, SamplingParams
from gmlx.errors import GmlxError, InvalidRequest
from gmlx.finish import FinishReason
from gmlx.engine.stream import FinalRecord
from gmlx_cli import dist, ui
from gmlx_cli.loader import loader
from gmlx_cli.options import (
    SAMPLING_DEFAULTS as D,
    ChatOpt,
    DebugOpt,
    DistributedOpt,
    DrafterOpt,
    DraftModelOpt,
    JsonOpt,
    MaxTokensOpt,
    MinPOpt,
    FrequencyPenaltyOpt,
    LogitBiasOpt,
    LogprobsOpt,
    MinTokensOpt,
    PredictionOpt,
    PresencePenaltyOpt,
    RepetitionContextOpt,
    RepetitionPenaltyOpt,
    ModelOpt,
    NumDraftOpt,
    PromptArg,
    SeedOpt,
    SpeculativeOpt,
    StopOpt,
    TempOpt,
    TopKOpt,
    TopPOpt,
    VerboseOpt,
    check_no_speculative,
    logprobs_json,
    parse_logit_bias,
)

if TYPE_CHECKING:  # the engine and the loader import mlx-lm: when a command runs, never for --help
    from gmlx.engine import Engine
    from gmlx.models.loading import LoadedModel


class GenerationError(GmlxError):
    """The engine finished the request with an error (reported in its FinalRecord)."""


def read_prompt(prompt: str) -> str:
    """`-` means stdin. Checked here, before the (slow) model load."""
    text = sys.stdin.read() if prompt == "-" else prompt
    if text == "":
        raise InvalidRequest("the prompt is empty" + (" (nothing on stdin)" if prompt == "-" else ""))
    return text


def generate(
    ctx: typer.Context,
    prompt: PromptArg,
    model: ModelOpt = None,
    max_tokens: MaxTokensOpt = D.max_tokens,
    temp: TempOpt = D.temperature,
    top_p: TopPOpt = D.top_p,
    top_k: TopKOpt = D.top_k,
    min_p: MinPOpt = D.min_p,
    repetition_penalty: RepetitionPenaltyOpt = D.repetition_penalty,
    repetition_context_size: RepetitionContextOpt = D.repetition_context_size,
    presence_penalty: PresencePenaltyOpt = D.presence_penalty,
    frequency_penalty: FrequencyPenaltyOpt = D.frequency_penalty,
    logit_bias: LogitBiasOpt = None,
    min_tokens: MinTokensOpt = D.min_tokens,
    logprobs: LogprobsOpt = None,
    seed: SeedOpt = None,
    stop: StopOpt = None,
    num_draft_tokens: NumDraftOpt = None,
    draft_model: DraftModelOpt = None,
    drafter: DrafterOpt = None,
    speculative: SpeculativeOpt = None,
    prediction: PredictionOpt = None,
    chat: ChatOpt = None,
    verbose: VerboseOpt = False,
    json_output: JsonOpt = False,
    distributed: DistributedOpt = False,
    debug: DebugOpt = False,  # noqa: ARG001 - consumed by the error boundary from argv
) -> None:
    """Generate text from PROMPT, streaming it to stdout; statistics go to stderr.

    Speculates with the model's MTP head when it has one. The output depends only on the model, the prompt, the sampling options and the seed: [bold]--no-speculative[/bold] gives the same tokens.
    """
    blas.warn_if_reference()
    text = read_prompt(prompt)
    # Validate everything cheap before loading the model: a typo should not cost a load.
    params = SamplingParams(
        temperature=temp, top_p=top_p, top_k=top_k, min_p=min_p, max_tokens=max_tokens, seed=seed,
        stop=tuple(stop or ()), repetition_penalty=repetition_penalty,
        repetition_context_size=repetition_context_size, presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty, logit_bias=parse_logit_bias(logit_bias), min_tokens=min_tokens,
        logprobs=logprobs, prediction=read_prediction(prediction),
    ).validated()
    if logprobs is not None and not json_output:
        raise InvalidRequest("--logprobs is reported in the --json output; add --json")
    check_no_speculative(speculative, drafter=drafter, draft_model=draft_model, num_draft_tokens=num_draft_tokens,
                         prediction=prediction)
    config = EngineConfig(speculative=speculative, num_draft_tokens=num_draft_tokens, drafter=drafter,
                          draft_model=str(draft_model) if draft_model else None).validated()
    cluster = dist.join(distributed)
    lm = dist.load(cluster, model, loader(ctx))
    if params.prediction and drafter is None and draft_model is None:
        from gmlx.drafters.select import can_draft

        if not can_draft(lm) and lm.can_rollback:  # nothing of its own to draft with: the prediction alone
            config = replace(config, drafter="prediction")
    # The engine checks prompt length against the context itself; transformers' tokenizer would
    # add a second, misleading "will result in indexing errors" line. Set after the load, which
    # is what configures transformers' logger.
    logging.getLogger("transformers").setLevel(logging.ERROR)
    from gmlx.engine import Engine

    engine = (cluster.engine if cluster else Engine)(lm, config)
    for line in engine.notices:
        ui.notice(line)
    if speculative is None and not engine.speculative and not engine.notices:
        ui.notice(f"{lm.name} has no MTP or assistant head; decoding without speculation (--drafter ngram drafts"
                  " from the prompt, --draft-model PATH with a small model)")
    seed_matters = seed is None and temp > 0  # a greedy run does not depend on its seed

    def interrupted(partial: FinalRecord, k: int) -> None:  # Ctrl-C: the stats so far; then exit 130
        if not json_output and partial.text and not partial.text.endswith("\n"):
            sys.stdout.write("\n")
            sys.stdout.flush()
        render_stats(partial, lm, k, verbose=verbose, seed_drawn=seed_matters)

    record, k = _run(engine, chat_prompt(lm, text, chat), params, stream_text=not json_output,
                     on_interrupt=interrupted)
    if record.error:
        if not json_output and record.text:
            sys.stdout.write("\n")
        raise GenerationError(f"generation failed: {record.error}")
    if json_output:
        sys.stdout.write(json.dumps(as_json(record, lm, k)) + "\n")
    else:
        if record.text and not record.text.endswith("\n"):
            sys.stdout.write("\n")
        render_stats(record, lm, k, verbose=verbose, seed_drawn=seed_matters)
    sys.stdout.flush()


def read_prediction(path: Path | None) -> str | None:
    """--prediction FILE: its text (checked before the model load)."""
    if path is None:
        return None
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidRequest(f"--prediction {path}: cannot read it ({type(e).__name__}: {e})") from None


def chat_prompt(lm: LoadedModel, text: str, chat: bool | None) -> str | list[int]:
    """The prompt as token ids of a one-message chat when asked (or, by default, when the model has
    a chat template, as mlx_lm.generate does); else the text as is."""
    has_template = getattr(lm.tokenizer, "chat_template", None) is not None
    if chat and not has_template:
        raise InvalidRequest(f"{lm.name} has no chat template; drop --chat to send the prompt as it is")
    if not (has_template if chat is None else chat):
        return text
    return list(lm.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True))


def _run(engine: Engine, text: str | list[int], params: SamplingParams, *, stream_text: bool,
         on_interrupt=None) -> tuple[FinalRecord, int]:
    """Submit one request, stream its text, close the engine; returns the record and the K used.
    Ctrl-C: `on_interrupt(partial record, K)` (the tokens so far, finish reason "cancelled"), then
    the KeyboardInterrupt goes on (gmlx_cli.app says "interrupted" and exits 130)."""
    try:
        stream = engine.submit(text, params)
        try:
            for piece in stream:
                if stream_text and piece.text:
                    sys.stdout.write(piece.text)
                    sys.stdout.flush()  # stream as produced, also when piped
        except KeyboardInterrupt:
            stream.cancel()
            engine.close()  # ends the request with its final record: what it generated so far
            if on_interrupt is not None and stream.done:
                on_interrupt(stream.result, engine.spec.ceiling(1))
            raise
        except BaseException:  # broken pipe, ...: free the row at the next boundary
            stream.cancel()
            raise
        return stream.result, engine.spec.ceiling(1)  # the K ceiling at width 1 (config, sweep-cap)
    finally:
        engine.close()


def as_json(record: FinalRecord, lm: LoadedModel, k: int) -> dict:
    """One object per request. Stats keep vLLM's names; the prompt's length is `num_prompt_tokens`
    because `prompt_tokens` holds the ids."""
    stats = dict(record.stats)
    num_prompt = stats.pop("prompt_tokens", len(record.prompt_tokens))
    return {
        "text": record.text,
        "tokens": list(record.tokens),
        "prompt_tokens": list(record.prompt_tokens),
        "finish_reason": record.finish_reason,
        "seed": record.seed,
        "model": lm.name,
        "model_path": str(lm.path),
        "speculative": record.speculative,
        # the largest K a round of this request ran (None: none drafted), not a configured value
        "num_draft_tokens": record.stats.get("max_draft_tokens") or None,
        "num_prompt_tokens": num_prompt,
        **({"logprobs": logprobs_json(record, lm.tokenizer)} if record.logprobs is not None else {}),
        **stats,
    }


def render_stats(record: FinalRecord, lm: LoadedModel, k: int, *, verbose: bool, seed_drawn: bool = False) -> None:
    """The stats block on stderr. A seed drawn at random is always shown: without it the run
    cannot be repeated (the caller passes seed_drawn=False for a greedy run, which no seed changes)."""
    s = record.stats
    ttft = s.get("ttft_s")
    no_ttft = "- (ended at EOS before the first token)" if record.finish_reason == FinishReason.STOP else "-"
    rows = [
        ("prompt", f"{s.get('prompt_tokens', len(record.prompt_tokens))} tokens"),
        ("TTFT", no_ttft if ttft is None else f"{ttft * 1000:.1f} ms"),
        ("generation", f"{len(record.tokens)} token{'' if len(record.tokens) == 1 else 's'}, "
                       + ("- tokens/s (no decode interval after the first token)" if s.get("tokens_per_s") is None
                          else f"{s['tokens_per_s']:.1f} tokens/s")),
    ]
    if s.get("speculation"):  # what ran and why: the online control's decision, or the setting
        rows.append(("speculation", s["speculation"]))
    if s.get("prediction_tokens") is not None:
        rows.append(("prediction", f"{s['accepted_prediction_tokens']} of its {s['prediction_tokens']} tokens in the"
                                   f" output, {s['rejected_prediction_tokens']} drafted and rejected"))
    if record.speculative and not s.get("num_drafted", 0):
        rows.append(("acceptance rate", "- (nothing drafted)"))
    elif record.speculative:
        rows += [
            ("acceptance rate",
             f"{s.get('draft_acceptance_rate', 0.0):.1%} ({s.get('num_accepted', 0)}/{s.get('num_drafted', 0)} drafts)"),
            ("mean acceptance length", f"{s.get('mean_acceptance_length', 0.0):.2f} tokens/round"),
            ("rounds", str(s.get("num_rounds", 0))),
        ]
    elif not s.get("speculation"):
        rows.append(("speculation", "off"))
    if verbose:
        rows += [
            ("model", f"{lm.name} ({lm.path})"),
            ("BLAS", blas.active_blas()),
            ("K (num_draft_tokens)", f"{s['max_draft_tokens']} (the most drafts a round ran; ceiling {k})"
             if s.get("max_draft_tokens") else f"- (ceiling {k})" if record.speculative else "-"),
            ("mlx / mlx-lm", f"{ui.version_of('mlx')} / {ui.version_of('mlx-lm')}"),
            ("finish reason", record.finish_reason),
        ]
    if verbose or seed_drawn:
        rows.append(("seed", f"{record.seed} (drawn at random; --seed {record.seed} repeats this run)" if seed_drawn
                     else str(record.seed)))
    print("==========", file=sys.stderr)
    ui.kv_block(rows, file=sys.stderr)
