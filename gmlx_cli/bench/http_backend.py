"""`gmlx bench --url`: the bench workloads driven into any OpenAI-compatible server over HTTP.

Why a driver of its own and not a `Backend`: `drive()` steps an in-process engine round by round
from the caller's thread; a server runs its rounds by itself, so here every request is a task on
one asyncio loop (the official `openai` AsyncOpenAI client, streaming /v1/completions) and the
loop only decides when each request is sent: in arrival order, while fewer than `concurrency` are
in flight; a join-late waiter is sent only once some request has received tokens (the long
request is running, as `drive()` waits for its first round).

What is timed, on the client, as a user of the server sees it (the same quantities as in-process,
so the same tables come out):
- TTFT: from sending the request to the first chunk that carries text or token ids (a chat-style
  role chunk or an SSE keep-alive comment does not count);
- a chunk's tokens: exact when the server returns token ids per chunk (`return_token_ids`, vLLM's
  extension: gmlx serve and vLLM); otherwise the total from the final `usage` (asked for with
  `stream_options.include_usage`; it counts whatever the server counts, e.g. mlx_lm.server counts
  the EOS token that ended a request) is spread evenly over the chunks that carried text, since a
  chunk may hold several tokens (a speculative round) and a token may carry no text of its own;
- ITL: the gaps between successive token-carrying chunks (per chunk, as the in-process bench and
  vLLM define it: a client waits for a chunk, not for each token in it); req tok/s is
  (tokens - 1) / (last chunk - first chunk) per request, whatever the chunking, which is the figure
  to compare decode speed across servers that chunk differently;
- the end (`end_s`): when the stream closed, or the refusal or failure arrived. Every request has
  one (an answer with no token at all included), so a run's span covers them all. HTTP 429 (the
  server's queue is full) is a refusal, finish reason "rejected", counted apart from failures.

Acceptance is not visible per request through OpenAI's API: `spec_counters`
(gmlx_cli/bench/target.py) reads vLLM's speculative-decoding counters from the server's /metrics
(gmlx serve and vLLM expose them), and bench --url takes their difference across each cell.

Prompts are sent as text: every OpenAI-compatible server accepts it, and mlx_lm.server accepts
nothing else (its completions endpoint calls `tokenizer.encode(prompt)`). Two servers with the
same tokenizer therefore see the same prompt ids; `usage.prompt_tokens` is recorded per request so
that can be checked. `seed` is sent only when the temperature is > 0: a greedy request does not
need one, and mlx_lm.server serves a request with a seed alone (outside its batch).
`--ignore-eos` sends vLLM's `ignore_eos` extension (gmlx serve honours it; mlx_lm.server ignores
fields it does not know, so its requests still end at EOS and are counted as generated).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from gmlx.engine.metrics import Event, EventKind
from gmlx.finish import FinishReason
from gmlx_cli.bench.driver import Outcome
from gmlx_cli.bench.target import Target, error_message
from gmlx_cli.bench.workload import Request

REQUEST_TIMEOUT_S = 600.0  # one request, end to end: a stalled server cannot hang a run


@dataclass
class HttpOutcome(Outcome):
    """An Outcome as a client sees it: token ids only when the server returns them, counts from usage."""

    text: str = ""
    generated: int | None = None  # completion tokens (usage, or the ids' count); None: unknown
    prompt_count: int | None = None  # usage.prompt_tokens
    error: str | None = None
    rejected: str | None = None  # refused with HTTP 429 (finish reason "rejected"): what the server said

    @property
    def num_generated(self) -> int:
        return self.generated if self.generated is not None else len(self.tokens)

    @property
    def num_prompt_tokens(self) -> int:
        return self.prompt_count if self.prompt_count is not None else len(self.prompt_tokens)


def spread(total: int, k: int) -> list[int]:
    """`total` tokens over `k` chunks as evenly as integers allow (floor or ceil each, sum exact)."""
    return [(i + 1) * total // k - i * total // k for i in range(k)] if k else []


def _body(req: Request, ignore_eos: bool) -> tuple[dict, dict]:
    """The completion arguments for one request, and the extensions beside OpenAI's fields."""
    p = req.params
    args = {"prompt": req.prompt, "max_tokens": p.max_tokens, "temperature": p.temperature, "top_p": p.top_p}
    if p.temperature > 0 and p.seed is not None:
        args["seed"] = p.seed
    extra = {"return_token_ids": True} | ({"ignore_eos": True} if ignore_eos else {})
    if isinstance(p.prediction, str):  # a prompts file's predicted output (OpenAI's field)
        extra["prediction"] = {"type": "content", "content": p.prediction}
    return args, extra


async def _stream_one(client, target: Target, req: Request, out: HttpOutcome, clock, t0: float,
                      ignore_eos: bool, on_tokens: Callable[[float, int | None], None]) -> None:
    """One streamed request into `out`: chunk times, ids or text, finish reason, usage."""
    args, extra = _body(req, ignore_eos)
    stream = await client.completions.create(model=target.model, stream=True,
                                             stream_options={"include_usage": True}, extra_body=extra, **args)
    exact = False
    async with stream:
        async for chunk in stream:
            t = clock() - t0
            if chunk.usage is not None:
                out.generated, out.prompt_count = chunk.usage.completion_tokens, chunk.usage.prompt_tokens
            for ch in chunk.choices:
                extras = ch.model_extra or {}
                ids = extras.get("token_ids") or []
                exact = exact or "token_ids" in extras
                out.tokens += ids
                out.text += ch.text or ""
                if ids or ch.text:
                    out.chunks.append((t, len(ids) if exact else 0))
                    on_tokens(t, len(ids) if exact else None)
                if ch.finish_reason:
                    out.finish_reason = ch.finish_reason
                    out.prompt_tokens = list(extras.get("prompt_token_ids") or [])
    if exact:
        out.generated = len(out.tokens)
    elif out.chunks:  # text only: spread the usage count (or one per chunk) over the chunks
        n = out.generated if out.generated is not None else len(out.chunks)
        out.chunks = [(t, c) for (t, _), c in zip(out.chunks, spread(n, len(out.chunks)))]
        out.generated = n


def _error_text(e: Exception) -> str:
    import openai

    if isinstance(e, openai.APIStatusError):
        return f"HTTP {e.status_code}: {error_message(e.response)}"
    if isinstance(e, asyncio.TimeoutError):
        return f"no end within {REQUEST_TIMEOUT_S:.0f} s"
    return f"{type(e).__name__}: {e}"


async def drive_http(target: Target, requests: list[Request], concurrency: int, *, ignore_eos: bool = False,
                     on_event: Callable[[Event], None] | None = None,
                     on_submit: Callable[[int, float], None] | None = None, done: list | None = None,
                     clock=time.perf_counter, request_timeout_s: float = REQUEST_TIMEOUT_S) -> list[HttpOutcome]:
    """Run the workload against the server to the end (see the module docstring). Finished outcomes
    are appended to `done` as they finish; a request that failed has finish reason "error" and its
    `error`; on cancellation (Ctrl-C) the in-flight ones are kept with "cancelled"."""
    import openai

    done = [] if done is None else done
    pending = sorted(requests, key=lambda r: (r.arrival_s, r.request_id))
    slots, started = asyncio.Semaphore(concurrency), asyncio.Event()
    live: dict[int, HttpOutcome] = {}
    emit = on_event or (lambda ev: None)
    t0 = clock()

    async def one(req: Request) -> None:
        rid = req.request_id
        out = live[rid] = HttpOutcome(req, [], submit_s=clock() - t0)
        if on_submit:
            on_submit(rid, out.submit_s)

        def on_tokens(t: float, n: int | None) -> None:
            started.set()
            emit(Event(EventKind.ROUND, "http", len(live), rows=((rid, 0, 0, 1 if n is None else n),),
                       round="streaming"))
        try:
            await asyncio.wait_for(_stream_one(client, target, req, out, clock, t0, ignore_eos, on_tokens),
                                   request_timeout_s)
            out.finish_reason = out.finish_reason or FinishReason.ERROR
            if out.finish_reason == FinishReason.ERROR:
                out.error = out.error or "the stream ended without a finish reason"
        except asyncio.CancelledError:
            out.finish_reason = FinishReason.CANCELLED
            raise
        except openai.APIStatusError as e:
            if e.status_code == 429:  # the server's queue is full: a measured refusal, not a failure
                out.finish_reason, out.rejected = FinishReason.REJECTED, _error_text(e)
            else:
                out.finish_reason, out.error = FinishReason.ERROR, _error_text(e)
        except (openai.OpenAIError, asyncio.TimeoutError, httpx.HTTPError) as e:
            out.finish_reason, out.error = FinishReason.ERROR, _error_text(e)
        finally:
            out.end_s = clock() - t0  # every request ends: answered, refused, failed or cut off
            started.set()  # waiters must not wait forever on a request that failed before its first token
            slots.release()
            done.append(live.pop(rid))
            emit(Event(EventKind.FINISH, "http", len(live), rid=rid, reason=out.finish_reason))

    tasks: list[asyncio.Task] = []
    async with openai.AsyncOpenAI(base_url=target.base_url + "/v1", api_key=target.api_key or "none",
                                  max_retries=0, timeout=request_timeout_s) as client:
        try:
            for req in pending:
                wait = req.arrival_s - (clock() - t0)
                if wait > 0:
                    await asyncio.sleep(wait)
                if req.after_start:
                    await started.wait()
                await slots.acquire()
                tasks.append(asyncio.create_task(one(req)))
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return done
