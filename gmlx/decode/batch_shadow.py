"""What a gated batch's drafts would accept while it decodes plain (its shadow rounds): the batch
counterpart of the lone request's (gmlx/decode/shadow.py).

Why: the control decides a batch width on the acceptance its rounds there measured. Sent plain, a
width measured nothing more: on SmolLM2 a chat answer's drafts agree ~0.12 of the time over its
first rounds and ~0.3 later, so a width sent plain on the first stayed plain on that figure — in
the simulated engine (benchmarks/sim_control.py) chat at c = 2 / 4 ran 0.99x of plain where K = 1
every round ran 1.04x / 1.07x.

How: a batch the control gates keeps the drafter's state (`BatchLoop.disarm(keep=True)`); each
plain step runs the hidden-capturing forward (the one speculative rounds run) and commits its
hidden states and tokens to that state as a verify of k = 0 does (`commit`), one pending entry per
row. Every SHADOW_EVERY plain steps the drafter replays the entries (`Drafter.replay_rows`: one
teacher-forced head forward, the first draft each entry would propose, greedy as batch drafts
are), and each proposal becomes a K = 1 round's record at the batch's width once the row has
emitted its position (drafted 1, accepted 1 when it equals the token plain decoding emitted). The
proposals are read one plain round after they are dispatched (the device ran them before that
round's step). A resume arms the drafter with this state (the capture round commits to it): its
drafts keep the whole history instead of a cold start.

Entries the state held before the gate (a verify's kept positions) were verified for real: their
proposals are not counted; neither are a newly admitted row's prompt entries.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from gmlx.decode.shadow import SHADOW_EVERY, settled
from gmlx.drafters.base import Drafter
from gmlx.row import Row

# Shadow rounds for a gated batch within the cap (tests turn them off to compare both ways).
SHADOWS = True


class BatchShadow:
    """One gated stretch's shadow rounds: the drafter's state for every row, kept current."""

    def __init__(self, drafter: Drafter, state: object, rows: list[Row]):
        self.drafter, self.state = drafter, state
        # per row (batch order): the position each committed entry not yet replayed proposes for
        self.positions: list[list[int]] = [[] for _ in rows]
        self.proposals: dict[int, dict[int, int]] = {r.rid: {} for r in rows}  # rid -> position -> draft
        self.flight: tuple[mx.array, np.ndarray, list[tuple[int, list[int]]]] | None = None

    def commit(self, hidden: mx.array, tokens: mx.array, positions: np.ndarray) -> None:
        """A plain step's hidden states [B, 1, D] and tokens [B, 1] (sampled at `positions`): each
        row's entry, whose first draft proposes the position after (a graph: no sync)."""
        self.drafter.commit(self.state, 0, np.zeros(len(positions), dtype=np.int64), hidden, mx.maximum(tokens, 0))
        for pos, p in zip(self.positions, positions):
            pos.append(int(p) + 1)

    def add(self, rows: list[Row], pres: list) -> None:
        """Rows admitted to the gated batch join the shadow (their prompts' entries, not counted)."""
        self.state = self.drafter.merge(self.state, self.drafter.start(rows, pres))
        self.positions += [[] for _ in rows]
        self.proposals.update((r.rid, {}) for r in rows)

    def filter(self, rows: list[Row], keep: list[int]) -> None:
        """Keep these rows (`rows`: the batch's before the filter)."""
        self.state = self.drafter.filter(self.state, keep)
        self.positions = [self.positions[i] for i in keep]
        for i in set(range(len(rows))) - set(keep):
            self.proposals.pop(rows[i].rid, None)

    def dispatch(self, rows: list[Row]) -> None:
        """Every SHADOW_EVERY steps, start the replay of the committed entries (a graph: no sync)."""
        if self.flight is not None or not self.positions or min(map(len, self.positions)) < SHADOW_EVERY:
            return
        out = self.drafter.replay_rows(self.state)
        if out is None:
            return
        picks, lengths = out
        mx.async_eval(picks)
        self.flight = (picks, lengths, [(r.rid, pos) for r, pos in zip(rows, self.positions)])
        self.positions = [[] for _ in rows]

    def read(self, rows: list[Row]) -> list[tuple[int, int]]:
        """Take the replay dispatched last (if any); the (drafted, accepted) records of every
        proposal whose token the rows have emitted since — K = 1 rounds, one per row and step."""
        if self.flight is not None:
            picks, lengths, owned = self.flight
            self.flight = None
            read = np.array(picks)  # sync: dispatched a plain round ago, computed before its step
            for (rid, pos), row_picks, n in zip(owned, read, lengths):
                # the row's last len(pos) entries are this shadow's own (those before were verified)
                own = [int(t) for t in row_picks[int(n) - len(pos): int(n)]]
                if rid in self.proposals:
                    self.proposals[rid].update(zip(pos, own))
        return [rec for row in rows for rec in settled(self.proposals.get(row.rid, {}), row)]
