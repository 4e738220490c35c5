"""The scalar lane's records (gmlx/decode/scalar.py): its one request's state, and a round in flight."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from gmlx.policy.adaptive import AcceptanceEstimate
from gmlx.policy.figures import Acceptance
from gmlx.row import Row
from gmlx.sampling import RowSampling


@dataclass(slots=True)
class ScalarSeq:
    """The scalar lane's state for its one request."""

    row: Row
    cache: list  # target KV, one mlx-lm KVCache per layer
    draft: object | None  # the drafter's state for this one row
    rs: RowSampling
    max_k: int = 0  # the most drafts per round for this request (0: plain)
    acceptance: Acceptance = field(default_factory=AcceptanceEstimate)  # the control gives it a decaying one
    choice: object | None = None  # the control's choice for the next round (gmlx.policy.control.Choice)
    rearm_next: bool = False  # its first token runs plain and it drafts from the next round (scalar.FIRST_TOKEN_PLAIN)

    @property
    def bonus(self) -> int:
        return self.row.tokens[-1] if self.row.tokens else self.row.prompt[-1]


@dataclass(slots=True)
class Flight:
    """A dispatched round not yet read: k drafts from position `position` and their verify."""

    k: int
    position: int
    read: mx.array  # [1, k + (k+1)]: the drafts, then the target's tokens
    hidden: mx.array  # [1, k+1, D]
    targets: mx.array  # [1, k+1]
    lps: mx.array | None = None  # [1, k+1, 1+2N] logprobs, when the request asked (gmlx.processors)
    asked: int = 0  # the drafts asked for (k: those the drafter found); the control keys the round by it
    foreign: bool = False  # drafted from the request's own context (gmlx/drafters/context_lookup.py)
