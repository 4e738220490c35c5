"""The OpenAI wire protocol, requests side: a JSON body -> a validated `GenRequest`, or an ApiError
carrying OpenAI's error object (`{"error": {"message", "type", "param", "code"}}`: api_error.py).
Chat's own fields (messages, tools, template kwargs, role mapping) are read by chat_wire.py.

Validation is strict, so that a client never gets silently different behaviour from what it asked:
- an unknown field is a 400 naming it;
- a known OpenAI field that gmlx does not implement is accepted only at its no-op value (its
  default, e.g. `best_of: 1`, `suffix: ""`, `tool_choice: "auto"`), else a 400 naming it
  (`NOOP_VALUES`); `user` is accepted with any string and ignored (it changes nothing);
- wrong types are 400s here (booleans are not numbers); ranges are checked by
  `SamplingParams.validated()`, the engine's single source of truth, whose messages become 400s.

Implemented besides the basics: `n` (up to MAX_N choices; with a `seed`, choice i uses seed + i),
`logprobs` (completions: an integer N, the sampled token's logprob and the top N; chat: `logprobs`
and `top_logprobs`), `echo` (completions: the prompt before the text, with prompt logprobs when
`logprobs` is set), `presence_penalty`, `frequency_penalty`, `logit_bias` (token id -> bias), and
chat's `tools` and `chat_template_kwargs` (passed to the chat template), and `prediction`
(predicted outputs: gmlx/serve/prediction_wire.py).
Extensions beside OpenAI's fields, under vLLM's and mlx_lm.server's names: `top_k`, `min_p`,
`ignore_eos`, `min_tokens`, `repetition_penalty`, `repetition_context_size`,
`presence_context_size`, `frequency_context_size`, `role_mapping` (chat on a model without a chat
template), and `return_token_ids` (the response carries `prompt_token_ids` and each choice's
`token_ids`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from gmlx.config import MAX_LOGPROBS, SamplingParams
from gmlx.errors import InvalidRequest
from gmlx.serve.api_error import ApiError, bad, show
from gmlx.serve.chat_wire import parse_messages, parse_role_mapping, parse_template_kwargs, parse_tools
from gmlx.serve.prediction_wire import parse_prediction

# OpenAI's defaults: completions generate 16 tokens unless told; temperature 1 samples.
COMPLETION_MAX_TOKENS = 16
DEFAULT_TEMPERATURE = 1.0
MAX_N = 16  # the most choices one request may ask for

PROCESSOR_FIELDS = ("repetition_penalty", "repetition_context_size", "presence_penalty", "presence_context_size",
                    "frequency_penalty", "frequency_context_size", "min_tokens")
_COMMON = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "user",
           "top_k", "min_p", "ignore_eos", "return_token_ids", "logit_bias", "logprobs", "prediction",
           *PROCESSOR_FIELDS}
COMPLETION_FIELDS = _COMMON | {"prompt", "echo"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "chat_template_kwargs",
                         "role_mapping"}

_ANY_BOOL = (None, True, False)
# Fields gmlx does not implement, accepted only at values that change nothing.
NOOP_VALUES: dict[str, dict[str, tuple]] = {
    "completion": {"best_of": (None, 1), "suffix": (None, "")},
    "chat": {"tool_choice": (None, "none", "auto"), "parallel_tool_calls": _ANY_BOOL,
             "response_format": (None, {"type": "text"}), "functions": (None, []), "function_call": (None, "none")},
}


@dataclass(frozen=True)
class GenRequest:
    """One validated generation request. `prompt`: text or token ids (completions) or None with
    `messages` (chat: the template is rendered off the event loop, see app.py)."""

    kind: str  # "completion" | "chat"
    model: str
    params: SamplingParams  # validated; max_tokens is a placeholder when `max_tokens` is None
    max_tokens: int | None  # None (chat only): the rest of the model's context
    prompt: str | list[int] | None = None
    messages: list[dict] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    n: int = 1
    logprobs: int | None = None  # None: off; N: each token's logprob and the top N alternatives
    echo: bool = False  # completions: the prompt comes back before the text (and its logprobs)
    tools: list | None = None  # chat: passed to the chat template
    chat_template_kwargs: dict = field(default_factory=dict)
    role_mapping: dict | None = None  # chat without a template: mlx_lm.server's role prefixes

    seed_given: bool = False

    def choice_params(self, params: SamplingParams, i: int) -> SamplingParams:
        """Choice i's parameters: with a seed given, choice i samples with seed + i (the first
        is the request's own stream); without one, each choice draws its own."""
        if i == 0:
            return params
        return replace(params, seed=params.seed + i if self.seed_given else None).validated()

    def with_prompt_length(self, n: int, context: int | None) -> SamplingParams:
        """The final parameters once the prompt's length is known (a chat default budget)."""
        if self.max_tokens is not None:
            return self.params
        return replace(self.params, max_tokens=max(1, context - n) if context else SamplingParams().max_tokens)


# ---- typed field readers -------------------------------------------------------------------
def _typed(body: dict, name: str, kinds: tuple, what: str):
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) and bool not in kinds or not isinstance(v, kinds):
        raise bad(f"`{name}` must be {what}, got {show(v)}", name)
    if isinstance(v, float) and not math.isfinite(v):
        raise bad(f"`{name}` must be a finite number, got {v}", name)
    return v


def _int(body, name):
    return _typed(body, name, (int,), "an integer")


def _num(body, name):
    return _typed(body, name, (int, float), "a number")


def _bool(body, name):
    return _typed(body, name, (bool,), "true or false")


def _check_fields(body: dict, kind: str, allowed: set[str]) -> None:
    noop = NOOP_VALUES[kind]
    for name, value in body.items():
        if name in allowed:
            continue
        if name in noop:
            if not any(value == ok and type(value) is not bool or value is ok for ok in noop[name]):
                raise bad(f"`{name}` is not supported by gmlx (only {_noop_text(noop[name])}); remove it", name,
                          "unsupported_parameter")
            continue
        raise bad(f"unknown field `{name}` (gmlx implements: {', '.join(sorted(allowed))})", name,
                  "unsupported_parameter")


def _noop_text(values: tuple) -> str:
    shown = ["null" if v is None else str(v).lower() if isinstance(v, bool) else repr(v) for v in values]
    return "any true/false" if values == _ANY_BOOL else " or ".join(shown)


def _common(body: dict, kind: str, max_tokens: int | None, served: str) -> dict:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad(f"`model` must be a string, got {show(model)}", "model")
    if model is not None and model != served:
        raise ApiError(404, f"the model `{model}` does not exist; this server serves `{served}` (GET /v1/models)",
                       param="model", code="model_not_found")
    if (user := body.get("user")) is not None and not isinstance(user, str):
        raise bad(f"`user` must be a string, got {show(user)}", "user")
    n = _int(body, "n")
    if n is not None and not 1 <= n <= MAX_N:
        raise bad(f"`n` must be an integer in [1, {MAX_N}], got {n}", "n")
    stream = bool(_bool(body, "stream"))
    include_usage = _stream_options(body.get("stream_options"), stream)
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) or isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise bad("`stop` must be a string or a list of strings", "stop")
    temperature, top_p = _num(body, "temperature"), _num(body, "top_p")
    top_k, min_p, ignore_eos, seed = _int(body, "top_k"), _num(body, "min_p"), _bool(body, "ignore_eos"), _int(body, "seed")
    logprobs = _logprobs(body, kind)
    processors = {name: v for name in PROCESSOR_FIELDS
                  if (v := (_int if name.endswith(("_size", "_tokens")) else _num)(body, name)) is not None}
    echo = kind == "completion" and bool(_bool(body, "echo"))
    params = SamplingParams(
        max_tokens=max_tokens if max_tokens is not None else 1,
        temperature=DEFAULT_TEMPERATURE if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p, top_k=top_k or 0, min_p=min_p or 0.0, seed=seed,
        stop=tuple([stop] if isinstance(stop, str) else stop or ()), ignore_eos=bool(ignore_eos),
        logit_bias=_logit_bias(body.get("logit_bias")), logprobs=logprobs,
        prompt_logprobs=logprobs if echo else None, prediction=parse_prediction(body.get("prediction"), bad),
        **processors)
    try:
        params = params.validated()
    except InvalidRequest as e:
        raise bad(str(e), _param_of(str(e))) from None
    return {"model": served, "params": params, "max_tokens": max_tokens, "stream": stream,
            "include_usage": include_usage, "return_token_ids": bool(_bool(body, "return_token_ids")),
            "n": n or 1, "logprobs": logprobs, "echo": echo, "seed_given": seed is not None}


def _logprobs(body: dict, kind: str) -> int | None:
    """Completions: `logprobs` N (an integer). Chat: `logprobs` true, with `top_logprobs` N."""
    if kind == "completion":
        n = _int(body, "logprobs")
        name = "logprobs"
    else:
        on, n = _bool(body, "logprobs"), _int(body, "top_logprobs")
        name = "top_logprobs"
        if n is not None and not on:
            raise bad("`top_logprobs` needs `logprobs: true`", "top_logprobs")
        if not on:
            return None
        n = n or 0
    if n is not None and not 0 <= n <= MAX_LOGPROBS:
        raise bad(f"`{name}` must be an integer in [0, {MAX_LOGPROBS}], got {n}", name)
    return n


def _logit_bias(bias) -> dict | None:
    """OpenAI's map of token ids (JSON keys are strings) to biases in [-100, 100]."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise bad(f"`logit_bias` must be an object mapping token ids to numbers, got {show(bias)}", "logit_bias")
    out = {}
    for k, v in bias.items():
        try:
            tok = int(k)
        except (TypeError, ValueError):
            tok = None
        if tok is None or str(tok) != str(k).strip() or tok < 0:
            raise bad(f"`logit_bias` keys must be token ids (integers >= 0), got {show(k)}", "logit_bias")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise bad(f"`logit_bias` values must be numbers in [-100, 100], got {show(v)} for token {tok}",
                      "logit_bias")
        out[tok] = float(v)
    return out


def _stream_options(opts, stream: bool) -> bool:
    if opts is None:
        return False
    if not stream:
        raise bad("`stream_options` is only allowed when `stream` is true", "stream_options")
    if not isinstance(opts, dict):
        raise bad("`stream_options` must be an object", "stream_options")
    unknown = set(opts) - {"include_usage"}
    if unknown:
        raise bad(f"unknown field `stream_options.{sorted(unknown)[0]}` (gmlx implements: include_usage)",
                  f"stream_options.{sorted(unknown)[0]}", "unsupported_parameter")
    return bool(_bool(opts, "include_usage"))


def _param_of(message: str) -> str | None:
    first = message.split(" ", 1)[0]
    if first == "prompt_logprobs":
        return "logprobs"
    return first if first in COMPLETION_FIELDS | CHAT_FIELDS else None


def _positive(v: int | None, name: str) -> int | None:
    if v is not None and v < 1:
        raise bad(f"`{name}` must be a positive integer, got {v}", name)
    return v


# ---- the two endpoints ---------------------------------------------------------------------
def parse_completion(body: dict, served: str) -> GenRequest:
    _check_fields(body, "completion", COMPLETION_FIELDS)
    max_tokens = _positive(_int(body, "max_tokens"), "max_tokens")
    common = _common(body, "completion", COMPLETION_MAX_TOKENS if max_tokens is None else max_tokens, served)
    return GenRequest(kind="completion", prompt=_prompt(body.get("prompt")), **common)


def _prompt(p) -> str | list[int]:
    """A string, a list of token ids, or a list holding exactly one of those."""
    if p is None:
        raise bad("`prompt` is required", "prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        if p == "":
            raise bad("`prompt` is empty", "prompt")
        return p
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return list(p)
    if isinstance(p, list) and len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
        raise bad("`prompt` holds several prompts; gmlx takes one per request (send them as separate requests)",
                  "prompt", "unsupported_parameter")
    raise bad("`prompt` must be a non-empty string or a non-empty list of token ids", "prompt")


def parse_chat(body: dict, served: str) -> GenRequest:
    _check_fields(body, "chat", CHAT_FIELDS)
    a = _positive(_int(body, "max_completion_tokens"), "max_completion_tokens")
    b = _positive(_int(body, "max_tokens"), "max_tokens")
    if a is not None and b is not None and a != b:
        raise bad("`max_tokens` and `max_completion_tokens` differ; send one of them", "max_tokens")
    common = _common(body, "chat", a if a is not None else b, served)
    return GenRequest(kind="chat", messages=parse_messages(body.get("messages")),
                      tools=parse_tools(body.get("tools")),
                      chat_template_kwargs=parse_template_kwargs(body.get("chat_template_kwargs")),
                      role_mapping=parse_role_mapping(body.get("role_mapping")), **common)
