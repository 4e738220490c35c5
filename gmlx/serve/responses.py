"""The OpenAI wire protocol, responses side: completion and chat bodies, stream chunks, usage, and
server-sent events (one `data: <json>` event per chunk, `data: [DONE]` last).

A stream carries, in order: for chat, a first chunk with the assistant role and no text (sent at
once, before any token, so a client must time its first token from the first chunk with text);
then one chunk per batch of pieces read from the engine together (a speculative round can emit
several tokens at once, so a chunk may hold several tokens: count tokens with `usage` or
`token_ids`, not chunks); then a chunk with `finish_reason` and no text; then, with
`stream_options.include_usage`, a chunk with no choices and the usage; then `data: [DONE]`.
With `return_token_ids`, each chunk carries its `token_ids` and the finish chunk the
`prompt_token_ids` (vLLM's names). With `n` > 1 the choices' chunks interleave, each with its
`index` (chat: a role chunk per choice first; a finish chunk per choice); with `echo`, a
completion's first chunk per choice is the prompt; with `logprobs`, each chunk carries its tokens'.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

from gmlx.engine.stream import FinalRecord
from gmlx.serve.prediction_wire import completion_details
from gmlx.serve.openai_wire import GenRequest

DONE = b"data: [DONE]\n\n"


def sse(obj: dict) -> bytes:
    """One server-sent event; the JSON is on one line, so an event is never split mid-object."""
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def usage(recs: list[FinalRecord]) -> dict:
    """One request's usage: its prompt once, the tokens of all its choices."""
    n_prompt, n_out = len(recs[0].prompt_tokens), sum(len(r.tokens) for r in recs)
    out = {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}
    if (details := completion_details(recs)) is not None:  # a request with a prediction
        out["completion_tokens_details"] = details
    return out


@dataclass(frozen=True)
class Reply:
    """The bodies of one request's response (they share its id, creation time and model).
    `tokenizer`: for token strings in logprobs; `echo_text`: the prompt a completion echoes."""

    req: GenRequest
    id: str
    created: int
    tokenizer: object = None
    echo_text: str | None = None

    @classmethod
    def new(cls, req: GenRequest, tokenizer=None, echo_text: str | None = None) -> "Reply":
        prefix = "chatcmpl-" if req.kind == "chat" else "cmpl-"
        return cls(req, prefix + uuid.uuid4().hex, int(time.time()), tokenizer, echo_text)

    @property
    def chat(self) -> bool:
        return self.req.kind == "chat"

    @property
    def wants_logprobs(self) -> bool:
        return self.req.logprobs is not None

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.req.model}

    # ---- logprobs, OpenAI's two shapes -------------------------------------------------------
    def _tok(self, token: int) -> str:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else str(token)

    def logprobs(self, lps: list, prompt: list | None = None, prompt_first: int | None = None,
                 offset: int = 0) -> dict | None:
        """The choice's `logprobs` object for these TokenLogprobs (None unless asked). Completions:
        {tokens, token_logprobs, top_logprobs, text_offset}, with echo's prompt entries first (the
        first prompt token has none); chat: {content: [{token, logprob, bytes, top_logprobs}]}."""
        if not self.wants_logprobs:
            return None
        if self.chat:
            def entry(tok: int, lp: float) -> dict:
                s = self._tok(tok)
                return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}
            return {"content": [{**entry(t.token, t.logprob), "top_logprobs": [entry(i, v) for i, v in t.top]}
                                for t in lps], "refusal": None}
        entries = ([(prompt_first, None)] if prompt_first is not None else []) + [(t.token, t) for t in prompt or []]
        entries += [(t.token, t) for t in lps]
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tok, t in entries:
            s = self._tok(tok)
            out["tokens"].append(s)
            out["text_offset"].append(offset)
            offset += len(s)
            out["token_logprobs"].append(None if t is None else t.logprob)
            if t is None:
                out["top_logprobs"].append(None)
            else:
                top = {self._tok(i): v for i, v in t.top}
                top.setdefault(s, t.logprob)  # as OpenAI and vLLM: the sampled token is always listed
                out["top_logprobs"].append(top)
        return out

    def _echo(self, rec: FinalRecord) -> tuple[str, list | None, int | None]:
        """Echo's text, prompt logprobs and first prompt token (completions with `echo`)."""
        if not self.req.echo:
            return "", None, None
        lps = rec.prompt_logprobs if self.wants_logprobs else None
        return self.echo_text or "", lps, rec.prompt_tokens[0] if lps is not None and rec.prompt_tokens else None

    # ---- bodies --------------------------------------------------------------------------------
    def full(self, recs: list[FinalRecord]) -> dict:
        """The non-streaming body, a choice per record."""
        body = self._head("chat.completion" if self.chat else "text_completion")
        choices = []
        for i, rec in enumerate(recs):
            lps = rec.logprobs or []
            if self.chat:
                choice = {"index": i, "message": {"role": "assistant", "content": rec.text},
                          "logprobs": self.logprobs(lps), "finish_reason": rec.finish_reason}
            else:
                echo, prompt_lps, first = self._echo(rec)
                choice = {"index": i, "text": echo + rec.text,
                          "logprobs": self.logprobs(lps, prompt_lps, first), "finish_reason": rec.finish_reason}
            if self.req.return_token_ids:
                choice["token_ids"] = list(rec.tokens)
                self._prompt_ids(body, choice, rec)
            choices.append(choice)
        body.update(choices=choices, usage=usage(recs))
        return body

    def _prompt_ids(self, body: dict, choice: dict, rec: FinalRecord) -> None:
        # vLLM's places: on the response for chat, on the choice for completions
        (body if self.chat else choice)["prompt_token_ids"] = list(rec.prompt_tokens)

    def chunk(self, text: str = "", token_ids: list[int] | None = None, *, role: bool = False,
              record: FinalRecord | None = None, index: int = 0, logprobs: list | None = None,
              offset: int = 0) -> bytes:
        """One stream event of choice `index`: text (token ids, logprobs; `offset`: the choice's
        characters sent before it), the role (chat's first chunk), or the finish."""
        finish = record.finish_reason if record is not None else None
        lp = self.logprobs(logprobs, offset=offset) if logprobs else None
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else {"content": text} if text or token_ids else {}
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        if self.req.return_token_ids and not role:
            choice["token_ids"] = list(token_ids or [])
            if record is not None:
                self._prompt_ids(body, choice, record)
        body["choices"] = [choice]
        if self.req.include_usage:
            body["usage"] = None  # OpenAI: null on every chunk but the last
        return sse(body)

    def echo_chunk(self, index: int, prompt_tokens: list[int], prompt_logprobs: list | None) -> bytes:
        """A streamed completion's echo: the prompt text (and its logprobs), before any token."""
        lp = None
        if self.wants_logprobs and prompt_logprobs is not None:
            lp = self.logprobs([], prompt_logprobs, prompt_tokens[0] if prompt_tokens else None)
        body = self._head("text_completion")
        body["choices"] = [{"index": index, "text": self.echo_text or "", "logprobs": lp, "finish_reason": None}]
        if self.req.include_usage:
            body["usage"] = None
        return sse(body)

    def usage_chunk(self, recs: list[FinalRecord]) -> bytes:
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        body.update(choices=[], usage=usage(recs))
        return sse(body)
