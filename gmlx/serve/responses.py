"""The OpenAI wire protocol, responses side: completion and chat bodies, stream chunks, usage, and
server-sent events (one `data: <json>` event per chunk, `data: [DONE]` last).

A stream carries, in order: for chat, a first chunk with the assistant role and no text (sent at
once, before any token, so a client must time its first token from the first chunk with text);
then one chunk per batch of pieces read from the engine together (a speculative round can emit
several tokens at once, so a chunk may hold several tokens: count tokens with `usage` or
`token_ids`, not chunks); then a chunk with `finish_reason` and no text; then, with
`stream_options.include_usage`, a chunk with no choices and the usage; then `data: [DONE]`.
With `return_token_ids`, each chunk carries its `token_ids` and the finish chunk the
`prompt_token_ids` (vLLM's names).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

from gmlx.engine.stream import FinalRecord
from gmlx.serve.protocol import GenRequest

DONE = b"data: [DONE]\n\n"


def sse(obj: dict) -> bytes:
    """One server-sent event; the JSON is on one line, so an event is never split mid-object."""
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def usage(rec: FinalRecord) -> dict:
    n_prompt, n_out = len(rec.prompt_tokens), len(rec.tokens)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}


@dataclass(frozen=True)
class Reply:
    """The bodies of one request's response (they share its id, creation time and model)."""

    req: GenRequest
    id: str
    created: int

    @classmethod
    def new(cls, req: GenRequest) -> "Reply":
        prefix = "chatcmpl-" if req.kind == "chat" else "cmpl-"
        return cls(req, prefix + uuid.uuid4().hex, int(time.time()))

    @property
    def chat(self) -> bool:
        return self.req.kind == "chat"

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.req.model}

    def full(self, rec: FinalRecord) -> dict:
        """The non-streaming body."""
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": rec.text}, "logprobs": None,
                      "finish_reason": rec.finish_reason}
        else:
            choice = {"index": 0, "text": rec.text, "logprobs": None, "finish_reason": rec.finish_reason}
        body = self._head("chat.completion" if self.chat else "text_completion")
        if self.req.return_token_ids:
            choice["token_ids"] = list(rec.tokens)
            self._prompt_ids(body, choice, rec)
        body.update(choices=[choice], usage=usage(rec))
        return body

    def _prompt_ids(self, body: dict, choice: dict, rec: FinalRecord) -> None:
        # vLLM's places: on the response for chat, on the choice for completions
        (body if self.chat else choice)["prompt_token_ids"] = list(rec.prompt_tokens)

    def chunk(self, text: str = "", token_ids: list[int] | None = None, *, role: bool = False,
              record: FinalRecord | None = None) -> bytes:
        """One stream event: text (and token ids), the role (chat's first chunk), or the finish."""
        finish = record.finish_reason if record is not None else None
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else {"content": text} if text or token_ids else {}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        if self.req.return_token_ids and not role:
            choice["token_ids"] = list(token_ids or [])
            if record is not None:
                self._prompt_ids(body, choice, record)
        body["choices"] = [choice]
        if self.req.include_usage:
            body["usage"] = None  # OpenAI: null on every chunk but the last
        return sse(body)

    def usage_chunk(self, rec: FinalRecord) -> bytes:
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        body.update(choices=[], usage=usage(rec))
        return sse(body)
