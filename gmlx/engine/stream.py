"""A request's stream: thread-safe hand-off of emitted pieces from the engine to the caller."""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field

from gmlx.finish import FinishReason
from gmlx.row import Piece, Row


@dataclass(frozen=True)
class FinalRecord:
    """What a finished request reports (stats under vLLM's names, see RequestStats.as_dict)."""

    request_id: int
    prompt_tokens: list[int]
    tokens: list[int]
    text: str
    finish_reason: FinishReason
    seed: int
    speculative: bool
    stats: dict = field(default_factory=dict)
    error: str | None = None
    logprobs: list | None = None  # per token (gmlx.processors.TokenLogprob), when asked
    prompt_logprobs: list | None = None  # per prompt token after the first, when asked

    @classmethod
    def of(cls, row: Row, speculative: bool, error: str | None = None) -> "FinalRecord":
        return cls(request_id=row.rid, prompt_tokens=list(row.prompt), tokens=list(row.tokens), text=row.text,
                   finish_reason=row.finish_reason or FinishReason.CANCELLED, seed=row.seed, speculative=speculative,
                   stats=row.stats.as_dict(), error=error or row.error,
                   logprobs=list(row.logprobs) if row.logprobs is not None else None,
                   prompt_logprobs=row.prompt_logprobs)


_END = object()


class Stream:
    """Iterate for pieces (token id + text); then read `.result`. `cancel()` is thread-safe."""

    def __init__(self, request_id: int, seed: int, on_cancel=None):
        """`on_cancel()`: told (on the cancelling thread) so the engine reaps at its next step."""
        self.request_id = request_id
        self.seed = seed
        self._on_cancel = on_cancel
        self.delivered = 0  # pieces handed to this stream so far (engine side)
        self.prompt_logprobs: list | None = None  # echo's prompt logprobs, set before the first pieces
        self.prompt_tokens: list[int] | None = None  # set with them
        self._q: queue.Queue = queue.Queue()
        self._done = threading.Event()
        self._cancel = threading.Event()
        self._result: FinalRecord | None = None

    # engine side
    def _put(self, pieces: list[Piece]) -> None:
        if pieces:
            self.delivered += len(pieces)
            self._q.put(pieces)  # one hand-off per round, however many tokens it emitted

    def _finish(self, record: FinalRecord) -> None:
        self._result = record
        self._done.set()
        self._q.put(_END)

    # caller side
    def __iter__(self):
        while True:
            item = self._q.get()
            if item is _END:
                return
            yield from item

    def cancel(self) -> None:
        self._cancel.set()
        if self._on_cancel is not None:
            self._on_cancel()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> FinalRecord:
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
        assert self._result is not None
        return self._result

    @property
    def result(self) -> FinalRecord:
        return self.wait()
