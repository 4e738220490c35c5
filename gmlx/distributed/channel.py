"""One collective per engine step: rank 0's message to every rank, and every rank's position.

Every exchange is one `all_sum` of an int32 buffer laid out as
`[payload length, (1, session, step, checksum) per rank, payload words...]`: rank 0 writes the
length and the payload (a JSON message, 4 bytes a word), every rank writes a 1 (its presence)
and its position, the others contribute zeros; the sum is exact in int32, so after it every rank holds rank
0's message and every rank's position. Why all_sum: it is the one collective every MLX backend
(ring, MPI, JACCL, NCCL) provides, and the ring backend cannot send between arbitrary ranks.
A message longer than the buffer (new prompts) takes a second all_sum of the rest, its size now
known to every rank; a step without new requests costs one small all_sum.

A missing presence means that rank's part never arrived: after a peer dies, MLX's ring backend
(0.32.4) can end a pending all_sum with this rank's own input instead of an error.

A position is what a rank has done so far: (engine session, steps run, a rolling checksum of
every token it emitted and every plan it applied). Each rank compares all positions after each
exchange, so a rank that emitted other tokens is caught at the next step, by every rank.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from gmlx.errors import ReplicaDivergence

WORDS = 512  # payload words in the first all_sum: 2 KiB, enough for every step without prompts
_P = 2_147_483_647  # checksums stay below 2^31: exact in int32


def fold(h: int, *values: int) -> int:
    """Mix integers into a rolling checksum (order-sensitive; stays in [0, 2^31 - 1))."""
    for v in values:
        h = (h * 1_000_003 + (int(v) & 0xFFFFFFFF) + 1) % _P
    return h


class PeerLost(RuntimeError):
    """Another rank's part of a collective never arrived (its process or its host went away)."""


def fatal(message: str, code: int = 1) -> None:
    """A distributed failure ends this rank at once: one line on stderr, exit `code`. Why not an
    exception: the engine thread would serve on with state the other ranks no longer share, and
    MLX's exit-time synchronisation could wait forever on a collective nobody will complete."""
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    print(f"gmlx: error: {' '.join(message.split())}", file=sys.stderr, flush=True)
    os._exit(code)


@dataclass
class CommStats:
    """Time spent in this rank's exchanges (waiting for the slowest rank included)."""

    exchanges: int = 0
    all_sums: int = 0
    seconds: float = 0.0
    payload_bytes: int = 0
    samples: list[float] = field(default_factory=list)  # per exchange, for medians

    def as_dict(self) -> dict:
        s = sorted(self.samples)
        return {"exchanges": self.exchanges, "all_sums": self.all_sums, "seconds": self.seconds,
                "payload_bytes": self.payload_bytes,
                "median_ms": 1000 * s[len(s) // 2] if s else None,
                "mean_ms": 1000 * self.seconds / self.exchanges if self.exchanges else None}


class Channel:
    """Rank 0 speaks, every rank hears, every rank reports its position. Not thread-safe: one
    thread at a time exchanges (the engine thread, or the main thread around it)."""

    def __init__(self, group):
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        self.position = (0, 0, 0)  # (session, step, checksum) as of the last completed step
        self.stats = CommStats()
        self.closed = False  # after the exit message nothing more may be exchanged
        self.lost_peer: int | None = None  # a rank whose liveness connection closed (gmlx/distributed/liveness.py)
        self._head = 1 + 4 * self.size

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def exchange(self, message: dict | None = None) -> dict:
        """Rank 0 passes its message, the others None; every rank returns rank 0's message,
        after checking that every rank reports the same position."""
        if self.closed:
            raise ReplicaDivergence("the distributed run has ended; nothing more can be exchanged")
        t0 = time.perf_counter()
        data = json.dumps(message, separators=(",", ":")).encode() if self.leader else b""
        buf = np.zeros(self._head + WORDS, dtype=np.int32)
        buf[1 + 4 * self.rank: 5 + 4 * self.rank] = (1, *self.position)
        if self.leader:
            buf[0] = len(data)
            first = _words(data[: 4 * WORDS])
            buf[self._head: self._head + len(first)] = first
        out = self._all_sum(buf)
        slots = out[1: self._head].reshape(self.size, 4)
        missing = [r for r in range(self.size) if slots[r, 0] != 1]
        if missing:
            raise PeerLost(f"the part of rank {missing[0]} never arrived in the exchange")
        length = int(out[0])
        payload = out[self._head:].tobytes()[: min(length, 4 * WORDS)]
        if length > 4 * WORDS:
            rest = np.zeros(-(-(length - 4 * WORDS) // 4), dtype=np.int32)
            if self.leader:
                rest[:] = _words(data[4 * WORDS:])
            payload += self._all_sum(rest).tobytes()[: length - 4 * WORDS]
        self._check_positions(slots[:, 1:])
        dt = time.perf_counter() - t0
        self.stats.exchanges += 1
        self.stats.seconds += dt
        self.stats.payload_bytes += length
        self.stats.samples.append(dt)
        return json.loads(payload)

    def _all_sum(self, buf: np.ndarray) -> np.ndarray:
        self.stats.all_sums += 1
        out = mx.distributed.all_sum(mx.array(buf), group=self.group)
        return np.array(out)  # sync: the message is read on the host at once

    def _check_positions(self, pos: np.ndarray) -> None:
        if (pos == pos[0]).all():
            return
        bad = next(r for r in range(self.size) if (pos[r] != pos[0]).any())
        (s0, n0, c0), (s1, n1, c1) = map(int, pos[0]), map(int, pos[bad])
        if (s0, n0) != (s1, n1):
            what = f"rank 0 is at session {s0} step {n0}, rank {bad} at session {s1} step {n1}"
        else:
            what = (f"after step {n0} of session {s0} the checksums of emitted tokens and applied plans differ"
                    f" (rank 0: {c0}, rank {bad}: {c1})")
        raise ReplicaDivergence(f"ranks 0 and {bad} no longer agree: {what}; every rank must emit the same"
                                " tokens (position-keyed sampling), so this is a bug: please report it")


def _words(data: bytes) -> np.ndarray:
    return np.frombuffer(data + b"\0" * (-len(data) % 4), dtype=np.int32)
