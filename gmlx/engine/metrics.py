"""The engine's events and monotone counters (per-request statistics: gmlx/request_stats.py).

Nothing here touches the device: every figure is counted on the host from values the loops
already synced for their own work, so metrics cost no extra device sync.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

from gmlx.policy.admission import Mode, Round, Transition


class EventKind(Enum):
    ROUND = "round"
    TRANSITION = "transition"
    FINISH = "finish"
    DECISION = "decision"  # the online control switched a width between plain and speculative (reason)


@dataclass(frozen=True, slots=True)
class Event:
    kind: EventKind
    mode: Mode  # the engine's mode when the event was made
    width: int
    duration_s: float = 0.0
    rows: tuple = ()  # per row: (rid, drafted, accepted, emitted)
    round: Round | None = None  # round events: which kind of round ran
    transition: Transition | None = None
    reason: str | None = None
    rid: int | None = None
    stats: dict | None = None
    time: float = field(default_factory=time.perf_counter)  # when the engine made the event


@dataclass
class Counters:
    """Monotone engine-wide counters."""

    rounds: int = 0
    speculative_rounds: int = 0  # rounds that checked drafts (the rest decoded plain)
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    syncs: int = 0
    listener_errors: int = 0  # listeners that raised (each was removed)
    control_switches: int = 0  # the online control's plain <-> speculative switches (gmlx/policy/control.py)
    transitions: dict[Transition, int] = field(default_factory=lambda: dict.fromkeys(Transition, 0))

    def count_round(self, drafted: bool) -> None:
        """A round ran (one sync); `drafted`: it checked drafts."""
        self.rounds += 1
        self.speculative_rounds += drafted
        self.syncs += 1

    def snapshot(self) -> dict:
        return {"rounds": self.rounds, "speculative_rounds": self.speculative_rounds, "tokens": self.tokens,
                "drafted": self.drafted, "accepted": self.accepted, "syncs": self.syncs, "listener_errors": self.listener_errors,
                "control_switches": self.control_switches,
                **{f"transition_{k.value}": v for k, v in self.transitions.items()}}


def notify(listeners: list[Callable[[Event], None]], events: list[Event], counters: Counters) -> None:
    """Hand each event to every listener, in order. A listener that raises is counted, removed and
    warned about: an observer must never end the requests it observes (the engine's last-resort
    handler would fail every live row)."""
    for ev in events:
        for fn in list(listeners):
            try:
                fn(ev)
            except Exception as e:
                counters.listener_errors += 1
                if fn in listeners:
                    listeners.remove(fn)
                warnings.warn(f"gmlx: engine listener {fn!r} raised {type(e).__name__}: {e}; it was removed"
                              " (fix the listener and add it again)", RuntimeWarning, stacklevel=2)
