"""One request's record (the row) and how tokens are emitted into it.

Emission is the single place that decides budgets and stops, for every loop: tokens are taken
one by one from a round's output; EOS ends the request without being emitted (as mlx-lm's
`stream_generate`), `max_tokens` is never exceeded, and a stop string ends the request at the
token that completes it, with the string cut from the text; then `stop_fn` may end it. Text
that might be the start of a stop string is held back until it is known not to be.

Emission is also where one request's fault ends that request only: a FAULT token (its logits at
that position were not finite, see `sampling.sample`) or a raising `stop_fn` finishes it with
"error" and a message in `error`; the round's other rows are not affected.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from gmlx.config import SamplingParams
from gmlx.finish import FinishReason
from gmlx.request_stats import RequestStats


@dataclass(slots=True)
class RoundResult:
    """What a round hands back to emission, per row (gmlx/decode/verify.py decides it)."""

    tokens: list[int]  # candidates to emit, in order
    drafted: int
    accepted: int
    logprobs: list | None = None  # per candidate token, when the request asked (gmlx.processors)
    foreign: bool = False  # drafted from the row's own context, not the drafter's model (the control skips it)


class RowState(Enum):
    QUEUED = "queued"
    SCALAR = "scalar"
    BATCHED = "batched"
    GATED = "gated"
    DONE = "done"


ALLOWED: dict[RowState, frozenset[RowState]] = {
    RowState.QUEUED: frozenset({RowState.SCALAR, RowState.BATCHED, RowState.GATED, RowState.DONE}),
    RowState.SCALAR: frozenset({RowState.BATCHED, RowState.GATED, RowState.DONE}),
    RowState.BATCHED: frozenset({RowState.GATED, RowState.DONE}),
    RowState.GATED: frozenset({RowState.BATCHED, RowState.DONE}),
    RowState.DONE: frozenset(),
}


def transition(row: "Row", dst: RowState) -> None:
    """The only place a row's state changes; illegal moves are bugs."""
    if dst is row.state:
        return
    assert dst in ALLOWED[row.state], f"row {row.rid}: {row.state.value} -> {dst.value} is not allowed"
    row.state = dst


@dataclass(frozen=True, slots=True)
class Piece:
    """One emitted token and the text it completes (may be empty while bytes are pending)."""

    token: int
    text: str
    logprob: object = None  # gmlx.processors.TokenLogprob, when the request asked for logprobs


@dataclass(slots=True)
class Row:
    rid: int
    prompt: list[int]
    params: SamplingParams  # validated: seed is concrete
    eos_ids: frozenset[int]
    detokenizer: object
    tokens: list[int] = field(default_factory=list)
    state: RowState = RowState.QUEUED
    finish_reason: FinishReason | None = None
    text: str = ""
    sent_chars: int = 0
    preempted: bool = False  # moved from the scalar loop: batch semantics to the end, no retirement
    error: str | None = None
    stats: RequestStats = field(default_factory=RequestStats)
    logprobs: list | None = None  # per emitted token (TokenLogprob), when params.logprobs is set
    prompt_logprobs: list | None = None  # per prompt token after the first, when params.prompt_logprobs is set

    @property
    def seed(self) -> int:
        return self.params.seed  # type: ignore[return-value]

    @property
    def next_position(self) -> int:
        """Absolute position of the next token to sample (its noise key)."""
        return len(self.prompt) + len(self.tokens)

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - len(self.tokens)

    @property
    def is_done(self) -> bool:
        return self.finish_reason is not None

    def stops_at(self, candidates: list[int]) -> bool:
        """Whether emitting these ends the request at an EOS or a FAULT: known before emission,
        so a lane does not dispatch a round nobody will read (a stop string or stop_fn shows
        only at emission)."""
        return any(t < 0 or t in self.eos_ids for t in candidates)

    def take(self, res: "RoundResult", now: float) -> list[Piece]:
        """Book one round for this row, the one place every lane's results go through: its draft
        statistics, then emission. A detokenizer or stop-check fault ends this request only."""
        self.stats.record_round(res.drafted, res.accepted)
        try:
            pieces = self.emit(res.tokens, now)
        except Exception as e:
            self.finish(FinishReason.ERROR, now)
            self.error = f"{type(e).__name__}: {e}"
            return []
        return pieces if res.logprobs is None else self._with_logprobs(pieces, res.logprobs)

    def _with_logprobs(self, pieces: list[Piece], logprobs: list) -> list[Piece]:
        """The emitted pieces (the round's first candidates, in order) with their logprobs."""
        if self.logprobs is None:
            self.logprobs = []
        out, i = [], 0
        for p in pieces:
            if p.token >= 0:
                self.logprobs.append(logprobs[i])
                p = Piece(p.token, p.text, logprobs[i])
                i += 1
            out.append(p)
        return out

    def emit(self, candidates: list[int], now: float) -> list[Piece]:
        """Take a round's tokens in order until the request finishes; return what was emitted."""
        out: list[Piece] = []
        for tok in candidates:
            if self.is_done:
                break
            if tok < 0:  # sampling.FAULT: this position's logits were unusable; the others' are not
                self.finish_reason = FinishReason.ERROR
                self.error = f"non-finite logits at position {self.next_position}"
                break
            if tok in self.eos_ids:
                self.finish_reason = FinishReason.STOP
                break
            self.tokens.append(tok)
            self.detokenizer.add_token(tok)
            self.text = self.detokenizer.text
            if self.stats.t_first_token is None:
                self.stats.t_first_token = now
            if self._cut_at_stop_string():
                self.finish_reason = FinishReason.STOP
            elif (reason := self._stop_fn_reason()) is not None:
                self.finish_reason = reason
            elif len(self.tokens) >= self.params.max_tokens:
                self.finish_reason = FinishReason.LENGTH
            out.append(Piece(tok, self._release_text()))
        self.stats.num_generated = len(self.tokens)
        if self.is_done:
            self.stats.t_end = now
            if out:
                out[-1] = Piece(out[-1].token, out[-1].text + self._flush_text())
            else:
                tail = self._flush_text()
                if tail:
                    out.append(Piece(-1, tail))
        return out

    def _cut_at_stop_string(self) -> bool:
        if not self.params.stop:
            return False
        longest = max(len(s) for s in self.params.stop)
        start = max(0, self.sent_chars - longest)
        hits = [i for s in self.params.stop if (i := self.text.find(s, start)) >= 0]
        if not hits:
            return False
        self.text = self.text[: min(hits)]
        return True

    def _stop_fn_reason(self) -> FinishReason | None:
        """Ask the user's stop callback (on a copy of the tokens): "stop", or None to go on. A
        raising callback is this request's fault: "error" with the message; the token stays."""
        fn = self.params.stop_fn
        if fn is None:
            return None
        try:
            stop = bool(fn(list(self.tokens), self.text))
        except Exception as e:
            self.error = f"stop_fn raised {type(e).__name__}: {e}"
            return FinishReason.ERROR
        return FinishReason.STOP if stop else None

    def _release_text(self) -> str:
        """Text safe to show now: all of it, except a tail that could still begin a stop string."""
        hold = 0
        if self.params.stop and not self.is_done:
            hold = max(len(s) for s in self.params.stop) - 1
        end = max(self.sent_chars, len(self.text) - hold)
        piece = self.text[self.sent_chars : end]
        self.sent_chars = end
        return piece

    def _flush_text(self) -> str:
        if not (self.finish_reason is FinishReason.STOP and self.params.stop):
            self.detokenizer.finalize()
            if self.detokenizer.text.startswith(self.text):
                self.text = self.detokenizer.text
        piece = self.text[self.sent_chars :]
        self.sent_chars = len(self.text)
        return piece

    def finish(self, reason: FinishReason, now: float) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason
            self.stats.t_end = now
