"""Running the app under uvicorn: in the foreground with signals (`gmlx serve`), or on a thread
(tests, the load generator).

Shutdown (SIGINT or SIGTERM, or `stop()`): uvicorn stops accepting at once and waits for the
open responses to finish; at the same moment gmlx closes the engine on a helper thread, which
ends every live and queued stream with finish reason "cancelled" at the engine's next round
boundary. Each SSE response then sends its final chunk and `data: [DONE]` and completes, so no
client sees half an event; non-streaming requests answer with what they have. Responses still
open after `graceful_s` are cut. A second SIGINT forces the exit (uvicorn's rule). The process
exits 0: uvicorn's habit of re-raising the caught signal after a graceful stop is not kept.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import sys
import threading
import time

import uvicorn

from gmlx.errors import GmlxError

GRACEFUL_S = 10.0


class ServeError(GmlxError):
    """The server could not start (e.g. the port is taken)."""


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (port 0: any free port), or a one-line error."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ServeError(f"cannot listen on {host}:{port}: {e.strerror or e}; pick another --port or --host") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class Server(uvicorn.Server):
    """uvicorn's server with gmlx's shutdown (see the module docstring)."""

    def __init__(self, app, *, log_level: str = "info", graceful_s: float = GRACEFUL_S):
        super().__init__(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=graceful_s,
                                        lifespan="off", server_header=False))
        self.app = app
        self._stopping = threading.Event()

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        if not self._stopping.is_set():  # the first signal: say what it ends (a second one forces the exit)
            live = self.app.state.api.engine.service.open_streams
            print(f"gmlx: notice: shutting down ({signal.Signals(sig).name}): {live} request"
                  f"{'' if live == 1 else 's'} cancelled", file=sys.stderr, flush=True)
        self._begin_stop()

    def _begin_stop(self) -> None:
        if self._stopping.is_set():
            return
        self._stopping.set()
        api = self.app.state.api
        api.closing = True
        # close() joins the engine thread: never on the event loop (a signal handler runs there)
        threading.Thread(target=api.engine.close, name="gmlx-serve-stop", daemon=True).start()

    @contextlib.contextmanager
    def capture_signals(self):
        """uvicorn's, without re-raising the signal afterwards: a graceful stop exits 0."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def serve_socket(self, sock: socket.socket) -> None:
        """Run in this thread until stopped."""
        self.run(sockets=[sock])

    def stop(self) -> None:
        """From any thread: begin the shutdown a signal would."""
        self.should_exit = True
        self._begin_stop()


def run(app, host: str = "127.0.0.1", port: int = 8000, *, log_level: str = "info") -> None:
    """Serve in the foreground until SIGINT / SIGTERM."""
    sock = bind(host, port)
    Server(app, log_level=log_level).serve_socket(sock)


class Background:
    """The app served on a thread of this process (tests, the load generator): `url`, `stop()`.
    Bounded waits: start within `start_s`, stop within `graceful_s` + a margin."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, *, log_level: str = "warning",
                 graceful_s: float = 5.0, start_s: float = 30.0):
        sock = bind(host, port)
        self.host, self.port = host, sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.server = Server(app, log_level=log_level, graceful_s=graceful_s)
        self._graceful_s = graceful_s
        self.thread = threading.Thread(target=self.server.serve_socket, args=(sock,), name="gmlx-serve", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + start_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise ServeError(f"the server on {self.url} did not start within {start_s} s")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.stop()
        self.thread.join(self._graceful_s + 10.0)
        if self.thread.is_alive():
            raise ServeError(f"the server on {self.url} did not stop within {self._graceful_s + 10.0} s")

    def __enter__(self) -> "Background":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
