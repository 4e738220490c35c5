"""The engine: owns the model, the decode loops, the request queue and the streams.

All MLX work happens in one engine thread (or in the caller's thread when it drives `step()`
itself, as tests do). `submit()` validates a request completely before touching any state,
then queues it; the engine admits queued requests between rounds.
"""

from __future__ import annotations

import atexit
import collections
import itertools
import threading
import time
import weakref
from pathlib import Path

import mlx.core as mx

from gmlx.config import EngineConfig, SamplingParams, Switches
from gmlx.errors import EngineClosed, InvalidRequest, NoDrafterError, Overloaded
from gmlx.metrics import Counters, Event, EventKind
from gmlx.models.loading import LoadedModel, load
from gmlx.request import Row, RowState
from gmlx.sampling import RowSampling
from gmlx.spec.drafter import MTPDrafter
from gmlx.spec.speculative import PlainDecoder, ScalarLoop, ScalarSeq
from gmlx.stream import FinalRecord, Stream


_LIVE: "weakref.WeakSet[Engine]" = weakref.WeakSet()


@atexit.register
def _close_live_engines() -> None:
    """Join engine threads before the interpreter finalises (MLX aborts on live streams)."""
    for engine in list(_LIVE):
        engine.close()


class Engine:
    def __init__(self, model: LoadedModel | str | Path | None = None, config: EngineConfig | None = None,
                 *, switches: Switches | None = None):
        self.config = (config or EngineConfig()).validated()
        self.switches = switches if switches is not None else Switches.from_env()
        self.lm = model if isinstance(model, LoadedModel) else load(model)
        if self.config.speculative and not self.lm.has_drafter:
            raise NoDrafterError(
                f"{self.lm.name} has no MTP head (no mtp_config.json / mtp_head.safetensors); run without"
                " speculation (--no-speculative)"
            )
        self.speculative = self.lm.has_drafter if self.config.speculative is None else self.config.speculative
        self.k = self.config.num_draft_tokens or self.lm.default_k
        drafter = MTPDrafter(self.lm.head, self.lm.target) if self.speculative else None
        self.scalar = ScalarLoop(self.lm.target, drafter, self.k, self.config.prefill_step_size)
        self.counters = Counters()
        self._ids = itertools.count()
        self._queue: collections.deque[tuple[Row, Stream]] = collections.deque()
        self._lock = threading.Condition()
        self._active: tuple[ScalarSeq, Stream, PlainDecoder | None] | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        _LIVE.add(self)

    # ---- caller side -------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if prompt == "":
                raise InvalidRequest("the prompt is empty")
            return list(self.lm.tokenizer.encode(prompt, add_special_tokens=True))
        ids = [int(t) for t in prompt]
        if not ids:
            raise InvalidRequest("the prompt is empty")
        vocab = self.lm.target.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        return ids

    def make_row(self, prompt: str | list[int], params: SamplingParams | None = None) -> Row:
        """Validate a request completely; no engine state changes."""
        params = (params or SamplingParams()).validated()
        ids = self.tokenize(prompt)
        ctx = self.lm.context_length
        if ctx is not None and len(ids) >= ctx:
            raise InvalidRequest(f"the prompt has {len(ids)} tokens; the model's context is {ctx} tokens")
        if ctx is not None and len(ids) + params.max_tokens > ctx:
            raise InvalidRequest(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the model's context of"
                f" {ctx} tokens; lower max_tokens to at most {ctx - len(ids)}"
            )
        return Row(rid=-1, prompt=ids, params=params, eos_ids=frozenset(self.lm.eos_ids),
                   detokenizer=self.lm.tokenizer.detokenizer)

    def submit(self, prompt: str | list[int], params: SamplingParams | None = None, *, start: bool = True) -> Stream:
        """Queue a request (thread-safe); returns its stream. Raises GmlxError on bad input."""
        row = self.make_row(prompt, params)
        with self._lock:
            if self._closed:
                raise EngineClosed("the engine is closed; create a new Engine")
            if len(self._queue) >= self.config.max_queued:
                raise Overloaded(f"{len(self._queue)} requests are queued (max_queued={self.config.max_queued})")
            row.rid = next(self._ids)
            stream = Stream(row.rid, row.seed)
            self._queue.append((row, stream))
            self._lock.notify_all()
        if start:
            self._ensure_thread()
        return stream

    def generate(self, prompt: str | list[int], params: SamplingParams | None = None) -> FinalRecord:
        stream = self.submit(prompt, params)
        for _ in stream:
            pass
        return stream.result

    def close(self) -> None:
        """End live streams (finish reason "cancelled"), join the engine thread. Idempotent."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join()
        for row, stream in list(self._queue):
            row.finish("cancelled", time.perf_counter())
            self._finish(row, stream)
        self._queue.clear()
        if self._active is not None:
            seq, stream, _ = self._active
            seq.row.finish("cancelled", time.perf_counter())
            self._finish(seq.row, stream)
            self._active = None

    # ---- engine side -------------------------------------------------------------------
    def _ensure_thread(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="gmlx-engine", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    while not self._closed and not self._queue and self._active is None:
                        self._lock.wait()
                    if self._closed:
                        return
                try:
                    self.step()
                except Exception as e:  # a fault ends the request being served, never the engine
                    self._fail_active(e)
        finally:
            # MLX requires each thread to destroy its streams before it ends, or the process may
            # abort at exit ("terminate called without an active exception"; mlx#3126, #4327).
            mx.synchronize()
            mx.clear_streams()

    def _fail_active(self, exc: Exception) -> None:
        if self._active is None:
            raise exc
        seq, stream, _ = self._active
        self._active = None
        seq.row.finish("error", time.perf_counter())
        self._finish(seq.row, stream, error=f"{type(exc).__name__}: {exc}")

    @property
    def has_work(self) -> bool:
        return self._active is not None or bool(self._queue)

    def step(self) -> list[Event]:
        """One round: admit a request when idle, run one round, deliver, finish."""
        if self._active is None and not self._admit():
            return []
        seq, stream, plain = self._active
        if stream.cancelled:
            seq.row.finish("cancelled", time.perf_counter())
            return self._complete()
        t0 = time.perf_counter()
        res = plain.round() if plain is not None else self.scalar.round(seq)
        now = time.perf_counter()
        seq.row.stats.record_round(res.drafted, res.accepted)
        pieces = seq.row.emit(res.tokens, now)
        stream._put(pieces)
        self.counters.rounds += 1
        self.counters.syncs += 1
        self.counters.tokens += sum(p.token >= 0 for p in pieces)
        self.counters.drafted += res.drafted
        self.counters.accepted += res.accepted
        mode = "plain" if plain is not None else "scalar"
        events = [Event(EventKind.ROUND, mode, 1, now - t0, ((seq.row.rid, res.drafted, res.accepted, len(pieces)),))]
        if seq.row.is_done:
            events += self._complete()
        return events

    def _admit(self) -> bool:
        with self._lock:
            if not self._queue:
                return False
            row, stream = self._queue.popleft()
        if stream.cancelled:
            row.finish("cancelled", time.perf_counter())
            self._finish(row, stream)
            return False
        row.state = RowState.SCALAR
        row.stats.prompt_tokens = len(row.prompt)
        rs = RowSampling.from_params([row.params], [row.seed])
        seq = self.scalar.start(row, rs)
        plain = None if self.speculative else PlainDecoder(self.lm.target, seq)
        self._active = (seq, stream, plain)
        return True

    def _complete(self) -> list[Event]:
        seq, stream, _ = self._active
        self._active = None
        self._finish(seq.row, stream)
        return [Event(EventKind.FINISH, "scalar", 1, rid=seq.row.rid, stats=seq.row.stats.as_dict())]

    def _finish(self, row: Row, stream: Stream, error: str | None = None) -> None:
        row.state = RowState.DONE
        stream._finish(FinalRecord(
            request_id=row.rid, prompt_tokens=list(row.prompt), tokens=list(row.tokens), text=row.text,
            finish_reason=row.finish_reason or "cancelled", seed=row.seed, speculative=self.speculative,
            stats=row.stats.as_dict(), error=error,
        ))
