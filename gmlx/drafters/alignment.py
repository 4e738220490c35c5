"""Where a request's output stands against its predicted output (OpenAI's `prediction`): the
prediction's tokens, the pointer to the token the output is expected to emit next, and whether the
output is in step with it; re-aligned from the output's last tokens after a departure (an edit).
gmlx/drafters/prediction.py drafts from it; its rules are described there.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from functools import lru_cache

# The most tokens a row drafts from its prediction per round. Prediction drafts cost no drafter
# work, so the limit is the verify: a wrong draft costs its column. Measured with
# benchmarks/bench_prediction.py (see its results).
K_MAX = 16
N_MAX, N_MIN = 4, 1  # suffix lengths tried when re-aligning, longest first
WINDOW_1 = 8  # a one-token suffix re-aligns only this close after the pointer


@lru_cache(maxsize=64)
def ngram_index(tokens: tuple[int, ...]) -> dict[tuple[int, ...], list[int]]:
    """Each n-gram of the prediction (N_MIN..N_MAX tokens) -> the sorted positions right after
    its occurrences (shared by requests with the same prediction: `n` choices, re-asks)."""
    out: dict[tuple[int, ...], list[int]] = {}
    for n in range(N_MIN, N_MAX + 1):
        for end in range(n, len(tokens) + 1):
            out.setdefault(tokens[end - n:end], []).append(end)
    return out


@dataclass(slots=True)
class Alignment:
    """One row's prediction and where its output stands against it."""

    tokens: tuple[int, ...]
    budget: int  # the request's max_tokens
    stats: object | None  # the row's RequestStats (counts), None for rows without them
    generated: int = 0  # output tokens verified so far (the pending bonus included)
    recent: list[int] = field(default_factory=list)  # the last N_MAX tokens of prompt + output
    pointer: int = 0  # the prediction position the next output token is expected at
    aligned: bool = True  # an empty output is aligned with the prediction's start
    drafted: int = 0  # drafts the last `draft` took from the prediction
    allowance: int = K_MAX  # the most drafts its next round takes from the prediction

    def propose(self, k_max: int) -> list[int]:
        if not self.aligned:
            return []
        n = min(k_max, self.allowance, len(self.tokens) - self.pointer, self.budget - self.generated - 1)
        return list(self.tokens[self.pointer:self.pointer + n]) if n > 0 else []

    def verified(self, accepted: int, k_max: int) -> None:
        """After a round that drafted from the prediction: a whole run accepted doubles the next
        round's allowance (up to k_max); a rejection shrinks it to what was accepted, plus one.
        A prediction that keeps failing (an output that wanders off it) then costs a column or two
        per round, and one that holds again is back at full length within a few rounds."""
        if not self.drafted:
            return
        self.allowance = min(k_max, 2 * self.allowance) if accepted >= self.drafted else accepted + 1

    def advance(self, verified, count: bool) -> None:
        """Walk a round's verified tokens: in step with the prediction while they equal its next
        token; once one departs, re-align from the output's suffix after the walk."""
        accepted = 0
        for tok in verified:
            tok = int(tok)
            self.recent.append(tok)
            self.generated += 1
            if self.aligned and self.pointer < len(self.tokens) and self.tokens[self.pointer] == tok:
                self.pointer += 1
                accepted += 1
            else:
                self.aligned = False
        del self.recent[:-N_MAX]
        if not self.aligned:
            self.realign()
        if count and self.stats is not None:
            self.stats.accepted_prediction_tokens += accepted

    def realign(self) -> None:
        index = ngram_index(self.tokens)
        for n in range(min(N_MAX, len(self.recent)), N_MIN - 1, -1):
            ends = index.get(tuple(self.recent[-n:]))
            if not ends:
                continue
            i = bisect_left(ends, self.pointer)
            if i < len(ends) and (n > 1 or ends[i] - self.pointer <= WINDOW_1):
                end = ends[i]
            elif n > 1 and i > 0:
                end = ends[i - 1]
            else:
                continue
            self.pointer, self.aligned = end, True
            return


def alignment(row, generated: list[int]) -> Alignment | None:
    """A row's alignment after `generated` output tokens (None: the row has no prediction)."""
    params = getattr(row, "params", None)
    tokens = getattr(params, "prediction", None)
    if not tokens or isinstance(tokens, str):  # text is tokenized at intake; a bare Row without it has none
        return None
    a = Alignment(tuple(tokens), params.max_tokens, getattr(row, "stats", None),
                  recent=list(row.prompt[-N_MAX:]))
    if generated:
        a.advance(generated, count=False)
    return a
