"""The one seam where an engine meets the other processes that run the same engine.

A step starts from its inputs: the requests it may admit and the cancellations it reaps (a
snapshot of the service's queue), and the cap decision in force. `Peers.agree` turns them into
the step's plan. Alone (`Alone`), the plan is decided from this process's inputs. In a
distributed run (gmlx/distributed/replica.py) rank 0 does the same and then sends its inputs,
its cap decision and its plan in one exchange; every other rank decides from rank 0's inputs
and checks that its plan equals rank 0's: requests are shared at intake, as mlx-lm's server
shares them (`_share_request`), and every rank runs the same schedule.

The engine calls its peers nowhere else: `accept` at submit, `step` around each step, `emitted`
as each row's tokens go out (a replica folds them into the checksum its ranks compare), and
`closed` at close. The service reads `heartbeat_s`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager, Protocol

from gmlx.row import Row
from gmlx.policy.admission import Plan
from gmlx.policy.caps import CapDecision


@dataclass(frozen=True)
class Inputs:
    """What one step starts from."""

    new: tuple[Row, ...]  # requests first seen by this step (rank 0 sends them to the other ranks)
    horizon: int  # the newest request id this step may admit (a later submit waits for the next step)
    cancelled: frozenset[int]  # ids of requests whose stream was cancelled: this step reaps them
    cap: CapDecision  # the cap decision in force this round


class Peers(Protocol):
    heartbeat_s: float | None
    """An idle engine thread still steps this often (None: it sleeps until there is work)."""

    measures_alone: bool
    """Whether the engine times its rounds at start (False: with its peers, once they all have it)."""

    def accept(self, row: Row) -> None:
        """A request arrives: raise InvalidRequest if it cannot be shared with the peers."""

    def step(self) -> ContextManager[None]:
        """Around each whole step."""

    def agree(self, take: Callable[[], Inputs], decide: Callable[[Inputs], Plan]) -> Plan:
        """This step's plan, the same on every process: `take()` reads this process's inputs,
        `decide(inputs)` reaps their cancellations and plans."""

    def emitted(self, row: Row, tokens: list[int]) -> None:
        """A row's tokens of this round, before they reach its stream."""

    def closed(self) -> None:
        """The engine was closed."""


class Alone:
    """A single process: nothing is shared, nothing is checked."""

    heartbeat_s = None
    measures_alone = True

    def accept(self, row: Row) -> None:
        pass

    def step(self) -> ContextManager[None]:
        return contextlib.nullcontext()

    def agree(self, take: Callable[[], Inputs], decide: Callable[[Inputs], Plan]) -> Plan:
        return decide(take())

    def emitted(self, row: Row, tokens: list[int]) -> None:
        pass

    def closed(self) -> None:
        pass
