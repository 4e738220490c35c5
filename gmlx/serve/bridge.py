"""Engine streams -> the event loop, without blocking either.

Three threads meet here. The engine thread decodes and hands each request's pieces to its
`Stream` (a blocking, thread-safe queue; the engine never waits on a reader). The event loop
(uvicorn's) serves HTTP and must never block: one blocking call there stalls every client. And
the reader of a Stream blocks until the engine delivers.

So each request gets one short-lived daemon *pump* thread of its own that iterates its Stream and
posts every piece, then the final record, to an `asyncio.Queue` owned by the event loop through
`loop.call_soon_threadsafe` (the one thread-safe way into a loop). The coroutine serving the
request awaits that queue and takes whatever has accumulated at once (`Pump.batches`), so a
speculative round's several tokens go out as one chunk.

Why not anyio's worker threads (`to_thread.run_sync(next, it)`): a worker blocked in `next()`
is held for the stream's whole life, and the pool's 40 default tokens would run out at 40 live
streams, stalling every other `to_thread` call (submit included) behind them. Why not an engine
listener: the pieces reach the caller only through the Stream; a listener only sees counts.

A pump thread always ends, because its stream always ends: the engine finishes the request, or
the request is cancelled (`stream.cancel()`: the row leaves at the next round boundary and the
stream gets its final record, "cancelled"), or `engine.close()` ends every stream. The HTTP side
stops a pump only through `cancel()`; it never abandons one mid-stream. If the loop is already
gone (the server stopped), the pump cancels its stream and reads it to its end.

`watch_disconnect` turns a client's disconnect (ASGI `http.disconnect`) into `stream.cancel()`,
for streaming and non-streaming requests alike; `EventStream` is the SSE response that runs it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable

import anyio

from gmlx.row import Piece
from gmlx.engine.stream import FinalRecord, Stream


class Pump:
    """One request's pieces, moved from its engine Stream onto the event loop by a thread."""

    def __init__(self, stream: Stream, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue | None = None,
                 tag: int | None = None):
        """`queue`, `tag`: post (tag, item) into a queue shared with other pumps (Pumps)."""
        self.stream = stream
        self._loop = loop
        self._q: asyncio.Queue = queue if queue is not None else asyncio.Queue()
        self._tag = tag
        self._thread = threading.Thread(target=self._run, name=f"gmlx-serve-pump-{stream.request_id}", daemon=True)
        self._thread.start()

    def _post(self, item) -> bool:
        try:
            self._loop.call_soon_threadsafe(self._q.put_nowait, item if self._tag is None else (self._tag, item))
            return True
        except RuntimeError:  # the loop is closed: nobody will read this request any more
            return False

    def _run(self) -> None:
        live = True
        for piece in self.stream:
            if live and not self._post(piece):
                live = False
                self.stream.cancel()  # and read on: the stream ends at the engine's next boundary
        if live:
            self._post(self.stream.result)

    async def batches(self) -> AsyncIterator[tuple[list[Piece], FinalRecord | None]]:
        """(pieces, None) while the request runs, then (last pieces, final record) once."""
        while True:
            items = [await self._q.get()]
            while not self._q.empty():
                items.append(self._q.get_nowait())
            record = items[-1] if isinstance(items[-1], FinalRecord) else None
            yield (items[:-1] if record is not None else items), record
            if record is not None:
                return

    async def result(self) -> FinalRecord:
        async for _, record in self.batches():
            if record is not None:
                return record
        raise AssertionError("a pump ends with its final record")


class Pumps:
    """The n streams of one request (its choices) onto one event-loop queue, a pump thread each."""

    def __init__(self, streams: list[Stream], loop: asyncio.AbstractEventLoop):
        self.streams = streams
        self._q: asyncio.Queue = asyncio.Queue()
        self.pumps = [Pump(s, loop, self._q, i) for i, s in enumerate(streams)]

    def cancel(self) -> None:
        for s in self.streams:
            s.cancel()

    async def batches(self) -> AsyncIterator[tuple[int, list[Piece], FinalRecord | None]]:
        """(choice, pieces, None) while it runs, then (choice, last pieces, final record) once per
        choice; whatever has accumulated is taken at once, grouped by choice in arrival order."""
        live = len(self.streams)
        while live:
            items = [await self._q.get()]
            while not self._q.empty():
                items.append(self._q.get_nowait())
            order: list[int] = []
            pieces: dict[int, list[Piece]] = {}
            records: dict[int, FinalRecord] = {}
            for tag, item in items:
                if tag not in pieces:
                    order.append(tag)
                    pieces[tag] = []
                if isinstance(item, FinalRecord):
                    records[tag] = item
                else:
                    pieces[tag].append(item)
            for tag in order:
                yield tag, pieces[tag], records.get(tag)
            live -= len(records)

    async def results(self) -> list[FinalRecord]:
        recs: list[FinalRecord | None] = [None] * len(self.streams)
        async for i, _, record in self.batches():
            if record is not None:
                recs[i] = record
        return recs  # type: ignore[return-value]


async def watch_disconnect(receive: Callable, on_disconnect: Callable[[], None]) -> None:
    """Call `on_disconnect` when the client goes away (run beside the response, after the body
    was read; cancelled when the response is complete)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            on_disconnect()
            return


class EventStream:
    """A `text/event-stream` response (ASGI). Each event is one `send`, so a stream ends between
    events, never inside one. A disconnect cancels the engine stream; the events are read on to
    their end (the engine ends the stream at its next round), so the pump thread finishes and
    nothing is left waiting; sends to a gone client are dropped by the server (ASGI 2.3) or raise
    OSError (ASGI 2.4), which ends the loop the same way."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], cancel: Callable[[], None]):
        self.events = events
        self.cancel = cancel

    async def __call__(self, scope, receive, send) -> None:
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                   (b"x-accel-buffering", b"no")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch_disconnect, receive, self.cancel)
            try:
                async for event in self.events:
                    await send({"type": "http.response.body", "body": event, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except OSError:
                self.cancel()
            finally:
                tg.cancel_scope.cancel()
