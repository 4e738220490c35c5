"""How a request ended. The values are the wire strings (OpenAI's `finish_reason`, the bench
tables' column): a FinishReason is a str, so JSON, CSV and metric labels carry it unchanged."""

from __future__ import annotations

from enum import StrEnum


class FinishReason(StrEnum):
    STOP = "stop"  # EOS, a stop string, or stop_fn said so
    LENGTH = "length"  # max_tokens reached
    CANCELLED = "cancelled"  # the caller cancelled it, or the engine closed
    ERROR = "error"  # this request's fault (non-finite logits, a raising stop_fn or detokenizer), or the engine's
    REJECTED = "rejected"  # bench --url only: the server refused the request (HTTP 429); never the engine's


# Ended on its own terms: its tokens are the whole answer (what a stream is checked against whole).
COMPLETE = frozenset({FinishReason.STOP, FinishReason.LENGTH})
