"""The engine as a service: the request queue, the streams, the engine thread and shutdown.

`Engine` (gmlx/engine.py) adds what a step does. The service relies on four of its members:
`lm` and `config` (validation and the queue bound), `speculative` (final records),
`step()`, `_live_rows()` and `_reset_loops()` (what close() and a fault end), and `mode`.
"""

from __future__ import annotations

import atexit
import collections
import itertools
import threading
import time
import weakref

import mlx.core as mx

from gmlx.config import SamplingParams
from gmlx.errors import EngineBusy, EngineClosed, Overloaded
from gmlx.engine.intake import make_row
from gmlx.engine.row import Row, RowState, transition
from gmlx.policy.admission import Mode
from gmlx.engine.stream import FinalRecord, Stream

_LIVE: "weakref.WeakSet[EngineService]" = weakref.WeakSet()


@atexit.register
def _close_live_engines() -> None:
    """Join engine threads before the interpreter finalises (MLX aborts on live streams)."""
    for engine in list(_LIVE):
        engine.close()


class EngineService:
    def _init_service(self) -> None:
        self._streams: dict[int, Stream] = {}
        self._ids = itertools.count()
        self._queue: collections.deque[Row] = collections.deque()
        self._in_transit: list[Row] = []  # popped this step, maybe not in a loop yet (see _fail_live)
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        _LIVE.add(self)

    # ---- caller side -------------------------------------------------------------------
    def submit(self, prompt: str | list[int], params: SamplingParams | None = None, *, start: bool = True) -> Stream:
        """Queue a request (thread-safe); returns its stream. Raises GmlxError on bad input."""
        row = make_row(self.lm, prompt, params)
        with self._lock:
            if self._closed:
                raise EngineClosed("the engine is closed; create a new Engine")
            if len(self._queue) >= self.config.max_queued:
                raise Overloaded(f"{len(self._queue)} requests are queued (max_queued={self.config.max_queued});"
                                 " retry later or raise EngineConfig.max_queued")
            row.rid = next(self._ids)
            stream = Stream(row.rid, row.seed)
            self._streams[row.rid] = stream
            self._queue.append(row)
            self._lock.notify_all()
        if start:
            self._ensure_thread()
        return stream

    def generate(self, prompt: str | list[int], params: SamplingParams | None = None) -> FinalRecord:
        if self._thread is not None and threading.current_thread() is self._thread:
            raise EngineBusy("generate() from the engine thread (a listener or stop_fn) would wait on itself;"
                             " use submit() and read the stream elsewhere")
        stream = self.submit(prompt, params)
        for _ in stream:
            pass
        return stream.result

    def close(self) -> None:
        """End live and queued streams (finish reason "cancelled"), join the engine thread, drop
        every cache. Idempotent; from a listener (the engine thread) it returns without joining and
        the thread ends after this step."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        now = time.perf_counter()
        for row in self._live_rows() + list(self._queue):
            row.finish("cancelled", now)
            self._deliver_final(row)
        self._queue.clear()
        self._reset_loops(drop_caches=True)

    # ---- engine thread -----------------------------------------------------------------
    def _ensure_thread(self) -> None:
        with self._lock:
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name="gmlx-engine", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    while not self._closed and not self._queue and self.mode is Mode.IDLE:
                        self._lock.wait()
                    if self._closed:
                        return
                try:
                    self.step()
                except EngineClosed:  # closed between the check above and the step: close() ends the rows
                    return
                except Exception as e:  # a fault ends the requests being served, never the engine
                    self._fail_live(e)
        finally:
            # MLX requires each thread to destroy its streams before it ends, or the process may
            # abort at exit ("terminate called without an active exception"; mlx#3126, #4327).
            mx.synchronize()
            mx.clear_streams()

    def _fail_live(self, exc: Exception) -> None:
        """The last resort: end every row being served (and any popped this step but not yet in a
        loop, so no stream is left waiting); queued requests are served afterwards."""
        now = time.perf_counter()
        for row in self._live_rows() + self._in_transit:
            row.finish("error", now)
            self._deliver_final(row, error=f"{type(exc).__name__}: {exc}")
        self._reset_loops()

    def _pop(self, n: int) -> list[Row]:
        with self._lock:
            rows = [self._queue.popleft() for _ in range(min(n, len(self._queue)))]
        self._in_transit += rows
        return rows

    def _deliver_final(self, row: Row, error: str | None = None) -> None:
        if row.state is not RowState.DONE:
            transition(row, RowState.DONE)
        stream = self._streams.pop(row.rid, None)
        if stream is None:
            return
        stream._finish(FinalRecord.of(row, self.speculative, error))
