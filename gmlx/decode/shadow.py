"""What a lone request's drafts would have accepted while it decodes plain (its shadow rounds).

A lone request the control sends plain keeps its drafter (gmlx/decode/scalar.py, REARM_MIN) and
its plain steps' hidden states. Every SHADOW_EVERY plain steps the lane hands those steps to the
drafter (the commit a re-arm makes: a `commit` with k = 0 of several) and asks it to replay them
(`Drafter.replay`): one teacher-forced head forward over the steps gives the first draft the
drafter would have proposed at each — a round's first draft exactly, coupled with the same
position-keyed noise — and each becomes a K = 1 round's record in the request's own acceptance
(drafted 1, accepted 1 when it equals the token plain decoding emitted there). The control then
decides each plain round on what the request's drafts accept now, not on what they accepted when
it went plain: a SmolLM2 chat answer's EAGLE-3 drafts agree 0.12 of the time over its first
rounds and ~0.3 later, and sent plain on the first, the request came back only by exploration
(16 or 64 plain rounds on) with the old estimate — 1.04x where K = 1 every round ran 1.10-1.16x.

Only the request's own estimate takes these records (its tokens per round are that estimate's:
gmlx/policy/width_control.py `_seen`): the width's pooled acceptance and tokens per round stay
those of rounds that drafted. A proposal for a position a verify already
checked (the pending entries from before the request went plain) is not counted twice.

Cost: per SHADOW_EVERY plain steps, one head forward over as many entries (a re-arm runs it
anyway) and their draft logits (~2 ms for SmolLM2's EAGLE-3 head here, per 8 steps of ~68 ms;
measured per plain step with and without: within this machine's noise). The proposals are read one plain round after they are
dispatched: the device ran them before that round's step, so the read never waits on the step.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from gmlx.decode.plain import PlainDecoder
from gmlx.drafters.base import Drafter
from gmlx.policy.figures import Acceptance
from gmlx.row import Row
from gmlx.sampling import RowSampling

SHADOW_EVERY = 8  # plain steps per replay: a fresh estimate within ~8 tokens, at ~1 % of them


class Shadow:
    """One plain stretch's shadow rounds (a new one each time the request goes plain)."""

    def __init__(self, start: int):
        self.start = start  # the stretch's first token position: drafts before it were verified for real
        self.proposals: dict[int, int] = {}  # position -> draft proposed there, read, its token not yet emitted
        self.flight: tuple[mx.array, int] | None = None  # (proposals [1, P] dispatched, the last one's position)

    def due(self, plain: PlainDecoder) -> bool:
        return plain.keep is not None and len(plain.keep) >= SHADOW_EVERY and self.flight is None

    def dispatch(self, drafter: Drafter, state: object, plain: PlainDecoder, rs: RowSampling) -> None:
        """Hand the kept steps to the drafter and start its replay of them (a graph: no sync)."""
        plain.hand_to(drafter, state)
        out = drafter.replay(state, rs, plain.pos)
        if out is not None:
            mx.async_eval(out)
            self.flight = (out, plain.pos)

    def read(self, row: Row, acceptance: Acceptance) -> None:
        """Take the replay dispatched last (if any) and record each proposal whose token has been
        emitted since: K = 1 rounds in the request's acceptance."""
        if self.flight is not None:
            out, last = self.flight
            self.flight = None
            picks = np.array(out)[0].tolist()  # sync: dispatched a plain round ago, computed before its step
            first = last - len(picks) + 1
            self.proposals.update((first + i, t) for i, t in enumerate(picks) if first + i >= self.start)
        for drafted, accepted in settled(self.proposals, row):
            acceptance.record(drafted, accepted)


def settled(proposals: dict[int, int], row: Row) -> list[tuple[int, int]]:
    """The proposals (position -> draft) whose token `row` has emitted, taken out in order: each a
    K = 1 round's record, (1, 1) where the draft is the emitted token, else (1, 0)."""
    done = sorted(q for q in proposals if q < row.next_position)
    return [(1, int(proposals.pop(q) == row.tokens[q - len(row.prompt)])) for q in done]
