"""The HTTP routes (Starlette): OpenAI's completions and chat completions, models, health, metrics.

| route | what |
|---|---|
| POST /v1/completions, /v1/chat/completions | generate; `stream: true` answers with server-sent events |
| GET /v1/models | the one served model |
| GET /health | 200 {"status": "ok", running, waiting, MLX memory, prompt cache bytes}; 503 once closing |
| GET /metrics | Prometheus text format (gmlx/serve/prometheus.py) |

With an API key, the /v1 routes need `Authorization: Bearer KEY` (401 otherwise); /health and
/metrics stay open, as in vLLM (bind to localhost, the default, to keep them private).
Errors are OpenAI error objects: 400 bad input (nothing is queued), 401, 404 unknown model or
route, 413 body over the limit, 429 engine queue full (with Retry-After), 500 a request the
engine failed, 503 the engine is closed. Nothing here blocks the event loop: tokenising, the chat
template and `engine.submit` run in anyio's worker threads (short calls), and the streams are
read by pump threads (gmlx/serve/bridge.py).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import mlx.core as mx

from gmlx.engine import intake
from gmlx.engine.stream import FinalRecord, Stream
from gmlx.errors import EngineClosed, GmlxError, InvalidRequest, Overloaded
from gmlx.finish import FinishReason
from gmlx.serve.api_error import ApiError, bad
from gmlx.serve.bridge import EventStream, Pumps, watch_disconnect
from gmlx.serve.openai_wire import GenRequest, parse_chat, parse_completion
from gmlx.serve.prometheus import CONTENT_TYPE, ServeMetrics
from gmlx.serve.responses import DONE, Reply, sse

MAX_BODY_BYTES = 1 << 20
RETRY_AFTER_S = 1


class Api:
    """The routes' shared state: the engine, the served name, the key, the metrics."""

    def __init__(self, engine, *, model_name: str | None = None, api_key: str | None = None,
                 max_body_bytes: int = MAX_BODY_BYTES):
        self.engine = engine
        self.model_name = model_name or engine.lm.name
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.created = int(time.time())
        self.metrics = ServeMetrics(engine, self.model_name)
        self.closing = False  # set when shutdown begins (server.py): /health answers 503

    # ---- request plumbing ------------------------------------------------------------------
    def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise ApiError(401, "missing or wrong API key: send `Authorization: Bearer <key>`",
                           param=None, code="invalid_api_key")

    async def read_json(self, request: Request) -> dict:
        limit = self.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise self._too_large()
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > limit:
                raise self._too_large()
        try:
            data = json.loads(body, parse_constant=_reject_constant)
        except (ValueError, UnicodeDecodeError) as e:
            raise bad(f"the body is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise bad("the body must be a JSON object")
        return data

    def _too_large(self) -> ApiError:
        return ApiError(413, f"the request body exceeds {self.max_body_bytes} bytes", code="request_too_large")

    def _submit(self, req: GenRequest) -> tuple[list[Stream], str | None]:
        """In a worker thread: render the chat template, tokenise and queue the request's `n`
        choices (all before any engine state changes, so a 400 here leaves nothing queued: the
        choices differ only in their seeds, so the first submit refuses what any would; one that
        fails later, e.g. on a full queue, cancels those already queued). Returns the streams and,
        for a completion with `echo`, the prompt's text."""
        lm = self.engine.lm
        prompt, params = req.prompt, req.params
        if req.kind == "chat":
            prompt = render_chat(lm, req.messages, req.tools, req.chat_template_kwargs, req.role_mapping)
            params = req.with_prompt_length(len(prompt), lm.context_length)
        echo = None
        if req.echo:
            echo = prompt if isinstance(prompt, str) else None
        streams: list[Stream] = []
        try:
            for i in range(req.n):
                streams.append(self.engine.submit(prompt, req.choice_params(params, i)))
        except BaseException:
            for s in streams:
                s.cancel()
            raise
        if req.echo and echo is None:
            echo = lm.tokenizer.decode(list(prompt))
        return streams, echo

    def _queue(self, req: GenRequest) -> tuple[list[Stream], str | None]:
        try:
            return self._submit(req)
        except InvalidRequest as e:  # the prompt against the vocabulary and the context
            raise bad(str(e), _blame(str(e), req)) from None
        except Overloaded:
            raise ApiError(429, f"the server's queue is full ({self.engine.config.max_queued} requests waiting); retry"
                           f" in {RETRY_AFTER_S} s (its operator can raise `gmlx serve --max-queued`)",
                           type="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except EngineClosed as e:
            raise ApiError(503, str(e), type="server_error", code="engine_closed") from None

    # ---- generation --------------------------------------------------------------------
    async def generate(self, request: Request, req: GenRequest) -> Response:
        t0 = time.perf_counter()
        streams, echo = await anyio.to_thread.run_sync(self._queue, req)
        pumps = Pumps(streams, asyncio.get_running_loop())
        reply = Reply.new(req, self.engine.lm.tokenizer, echo)
        if req.stream:
            return EventStream(self._events(reply, pumps, t0), pumps.cancel)
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch_disconnect, request.receive, pumps.cancel)
            recs = await pumps.results()
            tg.cancel_scope.cancel()
        for rec in recs:
            self._finished(rec, t0)
        failed = next((rec for rec in recs if rec.finish_reason == FinishReason.ERROR), None)
        if failed is not None:
            raise ApiError(500, f"generation failed: {failed.error}", type="server_error", code="generation_failed")
        return JSONResponse(reply.full(recs))

    async def _events(self, reply: Reply, pumps: Pumps, t0: float):
        req = reply.req
        if reply.chat:
            for i in range(req.n):
                yield reply.chunk(role=True, index=i)
        recs: list[FinalRecord | None] = [None] * req.n
        sent = [0] * req.n  # characters of each choice's text sent so far (logprobs' text_offset)
        started = [False] * req.n
        failed = False
        async for i, pieces, rec in pumps.batches():
            if req.echo and not started[i]:
                started[i] = True
                prompt_lps = pumps.streams[i].prompt_logprobs or (rec.prompt_logprobs if rec is not None else None)
                prompt_ids = rec.prompt_tokens if rec is not None else pumps.streams[i].prompt_tokens
                yield reply.echo_chunk(i, prompt_ids, prompt_lps)
                sent[i] += len(reply.echo_text or "")
            text = "".join(p.text for p in pieces)
            ids = [p.token for p in pieces if p.token >= 0]
            if text or (ids and (req.return_token_ids or reply.wants_logprobs)):
                lps = [p.logprob for p in pieces if p.token >= 0 and p.logprob is not None]
                yield reply.chunk(text, ids, index=i, logprobs=lps, offset=sent[i])
                sent[i] += len(text)
            if rec is None:
                continue
            self._finished(rec, t0)
            recs[i] = rec
            if rec.finish_reason == FinishReason.ERROR:
                failed = True
                yield sse(ApiError(500, f"generation failed: {rec.error}", type="server_error",
                                   code="generation_failed").body())
            else:
                yield reply.chunk(record=rec, index=i)
        if req.include_usage and not failed:
            yield reply.usage_chunk(recs)
        yield DONE

    def _finished(self, rec: FinalRecord, t0: float) -> None:
        self.metrics.finished(rec, time.perf_counter() - t0)


# mlx_lm.server's role prefixes for a model without a chat template (its `convert_chat`)
DEFAULT_ROLE_MAPPING = {
    "system_prompt": ("A chat between a curious user and an artificial intelligence assistant. The assistant"
                      " follows the given rules no matter what."),
    "system": "ASSISTANT's RULE: ", "user": "USER: ", "assistant": "ASSISTANT: ", "stop": "\n",
}


def role_prefixed(messages: list[dict], role_mapping: dict | None = None) -> str:
    """mlx_lm.server's fallback prompt for a model without a chat template: each message as its
    role's prefix, its content and the stop string, then the assistant's prefix (right-stripped).
    Tool messages and tool calls have no prefix there: their content is kept, their calls dropped."""
    rm = role_mapping or DEFAULT_ROLE_MAPPING
    prompt = ""
    for m in messages:
        prompt += f"{rm.get(m['role'], '')}{m.get('content', '')}{rm.get('stop', '')}"
    prompt += rm.get("assistant", "")
    return prompt.rstrip()


def render_chat(lm, messages: list[dict], tools: list | None = None, template_kwargs: dict | None = None,
                role_mapping: dict | None = None) -> list[int]:
    """The prompt's token ids through the tokenizer's chat template, ready for the assistant's turn
    (`tools` and `template_kwargs` passed to the template). A model without a chat template (a
    base or code model) gets mlx_lm.server's role prefixes instead (`role_prefixed`); tools then
    are a 400, since nothing would show them to the model."""
    tok = lm.tokenizer
    if not getattr(tok, "has_chat_template", False):
        if tools:
            raise bad(f"the model `{lm.name}` has no chat template, so it cannot be given `tools`", "tools",
                      "chat_template_missing")
        return intake.tokenize(lm, role_prefixed(messages, role_mapping))
    extra = {"tools": tools} if tools else {}
    try:
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **extra,
                                      **(template_kwargs or {}))
    except Exception as e:  # the template's own checks (e.g. roles must alternate): the request is at fault
        raise bad(f"the chat template rejected the messages: {type(e).__name__}: {e}", "messages") from None
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def _blame(message: str, req: GenRequest) -> str | None:
    if message.startswith("logit_bias"):
        return "logit_bias"
    if "max_tokens" in message:
        return "max_completion_tokens" if req.kind == "chat" and req.max_tokens is None else "max_tokens"
    if "prompt" in message:
        return "messages" if req.kind == "chat" else "prompt"
    return None


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def create_app(engine, *, model_name: str | None = None, api_key: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES) -> Starlette:
    """The ASGI app serving `engine` (which the caller owns and closes). `app.state.api` holds the
    routes' state."""
    api = Api(engine, model_name=model_name, api_key=api_key, max_body_bytes=max_body_bytes)

    def endpoint(parse):
        async def handler(request: Request) -> Response:
            api.authorize(request)
            return await api.generate(request, parse(await api.read_json(request), api.model_name))
        return handler

    async def models(request: Request) -> Response:
        api.authorize(request)
        return JSONResponse({"object": "list", "data": [
            {"id": api.model_name, "object": "model", "created": api.created, "owned_by": "gmlx"}]})

    async def health(request: Request) -> Response:
        service, pc = engine.service, engine.prompt_cache
        waiting = service.queued
        body = {"status": "closing" if api.closing else "ok", "model": api.model_name, "waiting": waiting,
                "running": max(0, service.open_streams - waiting), "mlx_active_memory_bytes": mx.get_active_memory(),
                "prompt_cache_bytes": pc.nbytes if pc is not None else 0, "speculative": engine.speculative}
        return JSONResponse(body, status_code=503 if api.closing else 200)

    async def metrics(request: Request) -> Response:
        return Response(api.metrics.render(), media_type=CONTENT_TYPE)

    async def on_api_error(request: Request, exc: ApiError) -> Response:
        api.metrics.rejected_with(exc.status)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    async def on_http_error(request: Request, exc: HTTPException) -> Response:
        kind = "not_found" if exc.status_code == 404 else "method_not_allowed" if exc.status_code == 405 else None
        return await on_api_error(request, ApiError(exc.status_code, f"{request.method} {request.url.path}:"
                                                    f" {exc.detail}", code=kind, headers=dict(exc.headers or {})))

    async def on_crash(request: Request, exc: Exception) -> Response:
        message = str(exc) if isinstance(exc, GmlxError) else f"internal error: {type(exc).__name__}: {exc}"
        return await on_api_error(request, ApiError(500, message, type="server_error"))

    routes = [Route("/v1/completions", endpoint(parse_completion), methods=["POST"]),
              Route("/v1/chat/completions", endpoint(parse_chat), methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]),
              Route("/health", health, methods=["GET"]),
              Route("/metrics", metrics, methods=["GET"])]
    app = Starlette(routes=routes, exception_handlers={ApiError: on_api_error, HTTPException: on_http_error,
                                                       Exception: on_crash})
    app.state.api = api
    return app
