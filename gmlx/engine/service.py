"""The engine as a service: the request queue, the streams, the engine thread and shutdown.

The service runs a `Core` (the engine: gmlx/engine/engine.py) through three members and knows
nothing else of it; the engine uses the service's public methods (snapshot, pop, deliver,
finish, ...). Each step reads the queue through one snapshot (`snapshot`): it admits only the
requests queued when the step began and reaps only the cancellations seen then, so what every
rank of a distributed run does in a step is fixed at its start (gmlx/engine/peers.py).
All MLX work happens in the engine thread, or in the caller's thread when it drives `step()`
itself, as tests do.
"""

from __future__ import annotations

import atexit
import collections
import itertools
import threading
import time
import weakref
from typing import Protocol

import mlx.core as mx

from gmlx.row import Piece, Row, RowState, transition
from gmlx.engine.stream import FinalRecord, Stream
from gmlx.errors import EngineBusy, EngineClosed, Overloaded
from gmlx.finish import FinishReason

_LIVE: "weakref.WeakSet[Service]" = weakref.WeakSet()


@atexit.register
def _close_live_services() -> None:
    """Join engine threads before the interpreter finalises (MLX aborts on live streams)."""
    for service in list(_LIVE):
        service.close()


class Core(Protocol):
    """What the service needs of the engine it runs."""

    @property
    def busy(self) -> bool:
        """Rows are being served (a loop is not idle)."""

    def advance(self) -> None:
        """One round, run by the engine thread."""

    def end_live(self, reason: FinishReason, error: str | None = None, drop_caches: bool = False) -> None:
        """End every row being served with this finish reason; reset the loops."""


class Service:
    def __init__(self, core: Core, max_queued: int, speculative: bool, heartbeat_s: float | None = None):
        """`heartbeat_s`: an idle engine thread still steps this often (a distributed rank 0's
        empty steps tell the other ranks it is alive); None: it sleeps until there is work."""
        self.core = core
        self.max_queued = max_queued
        self.speculative = speculative  # reported in final records
        self.heartbeat_s = heartbeat_s
        self._streams: dict[int, Stream] = {}
        self._ids = itertools.count()
        self._queue: collections.deque[Row] = collections.deque()
        self._in_transit: list[Row] = []  # popped this step, maybe not in a loop yet (see _fail)
        self._cancels = 0  # how many cancel() calls streams have seen (read without the lock)
        self._cancels_seen = 0
        self._horizon = -1  # the newest request id a snapshot has seen
        self._lock = threading.Condition()
        self.thread: threading.Thread | None = None  # the engine thread, once a submit() started it
        self._closed = False
        _LIVE.add(self)

    # ---- caller side -------------------------------------------------------------------
    def submit(self, row: Row, start: bool = True) -> Stream:
        """Queue a validated row (thread-safe); returns its stream."""
        with self._lock:
            if self._closed:
                raise EngineClosed("the engine is closed; create a new Engine")
            if len(self._queue) >= self.max_queued:
                raise Overloaded(f"{len(self._queue)} requests are queued (max_queued={self.max_queued});"
                                 " retry later or raise EngineConfig.max_queued")
            row.rid = next(self._ids)
            stream = self._queued(row)
        if start:
            self.start()
        return stream

    def enqueue(self, row: Row) -> Stream:
        """Queue a row numbered elsewhere (a distributed rank's copy of rank 0's request: the same
        id, no queue limit, since rank 0 admitted it); returns its stream. No thread starts."""
        with self._lock:
            return self._queued(row)

    def _queued(self, row: Row) -> Stream:
        stream = Stream(row.rid, row.seed, on_cancel=self._note_cancel)
        self._streams[row.rid] = stream
        self._queue.append(row)
        self._lock.notify_all()
        return stream

    def check_not_engine_thread(self, what: str) -> None:
        if self.thread is not None and threading.current_thread() is self.thread:
            raise EngineBusy(f"{what} from the engine thread (a listener or stop_fn) would wait on itself;"
                             " use submit() and read the stream elsewhere")

    def close(self) -> None:
        """End live and queued streams (finish reason "cancelled"), join the engine thread, drop
        every cache. Idempotent; from a listener (the engine thread) it returns without joining and
        the thread ends after this step."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join()
        self.core.end_live(FinishReason.CANCELLED, drop_caches=True)
        now = time.perf_counter()
        with self._lock:
            queued = list(self._queue)
            self._queue.clear()
        for row in queued:
            row.finish(FinishReason.CANCELLED, now)
            self.finish(row)

    # ---- engine side -------------------------------------------------------------------
    def begin_step(self) -> None:
        """Called by the step itself: refuse a closed engine or a foreign driver."""
        if self._closed:
            raise EngineClosed("the engine is closed; create a new Engine")
        if self.thread is not None and threading.current_thread() is not self.thread:
            raise EngineBusy("the engine thread drives this engine (a submit() started it); do not call step()")
        self._in_transit = []

    def snapshot(self) -> tuple[tuple[Row, ...], int, frozenset[int]]:
        """This step's view of the queue: the requests queued since the last snapshot, the newest
        request id (the step admits none newer), and the requests whose stream was cancelled
        (looked for only when a cancel() came since the last snapshot)."""
        with self._lock:
            new = self._newer_than(self._horizon)
            if new:
                self._horizon = new[-1].rid
            scan = self._cancels != self._cancels_seen
            self._cancels_seen = self._cancels
            cancelled = frozenset(rid for rid, s in self._streams.items() if s.cancelled) if scan else frozenset()
        return new, self._horizon, cancelled

    @property
    def queued(self) -> int:
        with self._lock:
            return len(self._queue)

    def queued_through(self, horizon: int) -> int:
        """How many queued requests a step may admit: those numbered up to `horizon`."""
        with self._lock:
            return len(self._queue) - len(self._newer_than(horizon))

    def _newer_than(self, rid: int) -> tuple[Row, ...]:
        """The queued rows numbered after `rid`: the queue's tail (rows join in id order, and
        leave from the front or by cancellation), so a step reads only what arrived since the
        last, not the whole queue. Call with the lock held."""
        tail = []
        for r in reversed(self._queue):
            if r.rid <= rid:
                break
            tail.append(r)
        return tuple(reversed(tail))

    @property
    def has_queued(self) -> bool:
        return bool(self._queue)

    def stream(self, rid: int) -> Stream | None:
        """The open stream of a request (None once its final record went out)."""
        return self._streams.get(rid)

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    def pop(self, n: int) -> list[Row]:
        with self._lock:
            rows = [self._queue.popleft() for _ in range(min(n, len(self._queue)))]
        self._in_transit += rows
        return rows

    def _note_cancel(self) -> None:
        with self._lock:
            self._cancels += 1

    def pop_cancelled(self, rids: frozenset[int]) -> list[Row]:
        """The queued requests of these ids, taken out of the queue."""
        with self._lock:
            gone = [r for r in self._queue if r.rid in rids]
            for r in gone:
                self._queue.remove(r)
        return gone

    def deliver(self, row: Row, pieces: list[Piece]) -> None:
        stream = self._streams[row.rid]
        if row.prompt_logprobs is not None and stream.prompt_logprobs is None:
            stream.prompt_tokens = list(row.prompt)  # with them, before the first pieces reach the reader
            stream.prompt_logprobs = row.prompt_logprobs
        stream._put(pieces)

    def finish(self, row: Row, error: str | None = None) -> None:
        """The row's final record ends its stream (once; later calls do nothing)."""
        if row.state is not RowState.DONE:
            transition(row, RowState.DONE)
        stream = self._streams.pop(row.rid, None)
        if stream is not None:
            stream._finish(FinalRecord.of(row, self.speculative, error))

    # ---- engine thread -----------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread (once; submit() does it unless asked not to)."""
        with self._lock:
            if self.thread is None and not self._closed:
                self.thread = threading.Thread(target=self._run, name="gmlx-engine", daemon=True)
                self.thread.start()

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    while not self._closed and not self._queue and not self.core.busy:
                        if not self._lock.wait(self.heartbeat_s):  # timed out: an idle engine's beat
                            break
                    if self._closed:
                        return
                try:
                    self.core.advance()
                except EngineClosed:  # closed between the check above and the step: close() ends the rows
                    return
                except Exception as e:  # a fault ends the requests being served, never the engine
                    self._fail(e)
        finally:
            # MLX requires each thread to destroy its streams before it ends, or the process may
            # abort at exit ("terminate called without an active exception"; mlx#3126, #4327).
            mx.synchronize()
            mx.clear_streams()

    def _fail(self, exc: Exception) -> None:
        """The last resort: end every row being served, and any popped this step but not yet in a
        loop, so no stream is left waiting; queued requests are served afterwards."""
        error = f"{type(exc).__name__}: {exc}"
        self.core.end_live(FinishReason.ERROR, error)
        now = time.perf_counter()
        for row in self._in_transit:
            row.finish(FinishReason.ERROR, now)
            self.finish(row, error)
