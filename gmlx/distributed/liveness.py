"""Know at once when another rank's process ends: one plain TCP connection between rank 0 and
each other rank, which nothing is ever sent over. When a process dies its operating system
closes the connection, and the thread blocked reading it on the other side ends this rank with
a message naming the dead rank.

Why beside MLX's own sockets: MLX's ring backend notices a dead peer ("[ring] connection to a
peer was lost") only for the collectives pending at that moment; a collective started after that
can wait forever (seen with mlx 0.32.4), and the watchdog's bound is minutes. A host that vanishes
without closing its connections is still the watchdog's (gmlx/distributed/watchdog.py).

Rank 0 listens on its own address from MLX's hostfile (the ring backend's MLX_HOSTFILE); other
launchers give none, and then only the watchdog guards. A connection proves itself with a random
token sent through the first exchange, so nothing else on the network can pose as a rank. The
end of the run closes every connection on purpose: a closed connection is fatal only if the run
has not ended within GRACE_S.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time

from gmlx.distributed.channel import fatal

GRACE_S = 3.0  # the normal end: rank 0 exits as soon as the others got its exit message
CONNECT_S = 20.0


def rank0_host() -> str | None:
    """Rank 0's address in the ring backend's hostfile, or None."""
    path = os.environ.get("MLX_HOSTFILE")
    try:
        with open(path) as f:
            first = json.load(f)[0]
        first = first[0] if isinstance(first, list) else first
        return str(first).rsplit(":", 1)[0]
    except (TypeError, OSError, ValueError, IndexError, KeyError):
        return None


class Liveness:
    def __init__(self, channel):
        self.channel = channel
        self._socks: list[socket.socket] = []

    def start(self) -> None:
        """Connect every rank to rank 0 (one exchange; best effort: without it the watchdog guards)."""
        if self.channel.leader:
            host = rank0_host()
            listener = None
            if host is not None:
                try:
                    listener = socket.create_server((host, 0), backlog=self.channel.size)
                except OSError:
                    listener = None
            token = secrets.token_hex(16)
            port = listener.getsockname()[1] if listener else 0
            self.channel.exchange({"k": "boot", "host": host, "port": port, "token": token})
            if listener is not None:
                threading.Thread(target=self._accept, args=(listener, token), daemon=True,
                                 name="gmlx-dist-accept").start()
            return
        boot = self.channel.exchange(None)
        if not boot.get("port"):
            return
        try:
            sock = socket.create_connection((boot["host"], boot["port"]), timeout=CONNECT_S)
            sock.sendall(f"{boot['token']} {self.channel.rank}\n".encode())
            sock.settimeout(None)
        except OSError:
            return
        self._watch(sock, 0)

    def _accept(self, listener: socket.socket, token: str) -> None:
        deadline = time.monotonic() + CONNECT_S
        seen: set[int] = set()
        while len(seen) < self.channel.size - 1 and time.monotonic() < deadline:
            listener.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                sock, _ = listener.accept()
                sock.settimeout(5)
                hello = sock.recv(128).decode(errors="replace").split()
                sock.settimeout(None)
            except OSError:
                continue
            if len(hello) == 2 and hello[0] == token and hello[1].isdigit():
                seen.add(int(hello[1]))
                self._watch(sock, int(hello[1]))
            else:
                sock.close()
        listener.close()

    def _watch(self, sock: socket.socket, peer: int) -> None:
        self._socks.append(sock)
        threading.Thread(target=self._read, args=(sock, peer), daemon=True, name=f"gmlx-dist-live-{peer}").start()

    def _read(self, sock: socket.socket, peer: int) -> None:
        try:
            while sock.recv(64):
                pass
        except OSError:
            pass
        if not self.channel.closed:
            self.channel.lost_peer = peer  # the engine stops delivering at once (replica.py)
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline:
            if self.channel.closed:
                return
            time.sleep(0.05)
        fatal(f"distributed: rank {self.channel.rank}: rank {peer}'s process ended (its connection closed) before the"
              " run did; its own output names why")
