"""Bound every wait on the other ranks: a rank that dies closes its sockets and MLX raises at
once, but a rank that hangs, or a host that drops off the network, leaves the collectives
waiting forever. The watchdog ends this rank with a clear message when one armed stretch (an
engine step, or a follower's wait for rank 0's next message) outlasts the timeout.

Rank 0 beats while idle (its engine thread runs an empty step every HEARTBEAT_S), so a follower's
wait is bounded too. MLX's ring backend polls its sockets while a collective waits, so a follower
waiting for rank 0 keeps a core busy; once rank 0 has been idle IDLE_NAP_AFTER_S, its heartbeats
tell the followers to sleep IDLE_NAP_S before the next exchange (an idle server then costs the
followers' hosts little, and its next request waits at most IDLE_NAP_S longer for them). The timeout is `GMLX_DIST_TIMEOUT` seconds (default 300: a long prefill of a
large model over a slow link must fit in one step).
"""

from __future__ import annotations

import threading
import time

from gmlx.distributed.channel import fatal

HEARTBEAT_S = 1.0
IDLE_NAP_AFTER_S = 5.0
IDLE_NAP_S = 0.9


class Watchdog:
    def __init__(self, rank: int, timeout_s: float, on_fire=fatal):
        self.rank, self.timeout_s, self._on_fire = rank, timeout_s, on_fire
        self._deadline: float | None = None
        self._what = ""
        self._thread = threading.Thread(target=self._watch, name="gmlx-dist-watchdog", daemon=True)
        self._thread.start()

    def arm(self, what: str) -> None:
        """From now on, `what` must end within the timeout."""
        self._what = what
        self._deadline = time.monotonic() + self.timeout_s

    def disarm(self) -> None:
        self._deadline = None

    def _watch(self) -> None:
        tick = min(0.5, self.timeout_s / 4)
        while True:
            time.sleep(tick)
            deadline = self._deadline
            if deadline is not None and time.monotonic() > deadline:
                self._on_fire(f"distributed: rank {self.rank}: no progress for {self.timeout_s:g} s {self._what};"
                              " another rank hung or its host went away (GMLX_DIST_TIMEOUT sets the bound)")
                return
