"""Drafts from the lone request's own context, beside the model's drafter: where the request's last
N_MIN..N_MAX tokens occurred earlier in its prompt or output, its round drafts the K tokens that
followed them (prompt lookup) instead of the drafter's; everywhere else the drafter drafts as
always. Arctic Inference runs its suffix decoding beside its learned speculator the same way.

Why: a small model's answers repeat their question and themselves (names, phrases, code lines),
and there its learned head is weakest. Replayed greedy answers of SmolLM2 float32 (12 code and 12
chat questions none of its training saw, 128 tokens; benchmarks/replay_context_lookup.py,
bench_results/20261206T190417Z_context_lookup.json): a suffix of >= 3 tokens recurs at 20-22 % of
answer positions; there the token that followed it is the target's next token 73-76 % of the time
(right where the head's first draft is wrong at 8 % of all positions, wrong where it is right at
2 %), and the copy runs on for 3.6-4.4 tokens, where the EAGLE-3 head's first draft agrees at 53 %
(code) and 38 % (chat) of all positions. A 2-token suffix drafts more often and is right less
(64-66 %). Simulated on those answers (plain-step multiples of a forward measured here), the head's
K = 1 every round gives 1.36x / 1.23x of plain (code / chat), with lookup rounds of 3 drafts where a
3-token suffix recurs 1.44x / 1.30x (2-token suffixes 1.42x / 1.30x; 1 or 7 drafts less). K = 3: on
this CPU a 4-token verify costs what a 3-token one does (the small-M kernel's tiles; 1.43 plain
steps against 1.08 for 2 tokens), and on a GPU or Metal both cost about a step.

Exactness: drafts are proposals; the verify keeps only what the target itself samples at each
position (the acceptance rule takes any draft source: gmlx/decode/verify.py).

Where: the lone request's rounds (the scalar lane asks with `DraftPick.context`), with a drafter
whose state does not depend on its own draft values (`Drafter.drafts_replaceable`: the round is
then a `commit` with k = 0 for it, as a predicted output's rounds are), and not with an explicit
K (the user asked for that drafter's K drafts every round) nor with GMLX_CONTEXT_LOOKUP=0. Not the
batch: a row's longer drafts widen every row's verify, and on this CPU a batch's speculation does
not pay as it is. The control learns nothing from a lookup round (`RoundResult.foreign`): its
figures are the drafter's, which decides whether, and how many, drafts the request's other
rounds take.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gmlx.drafters.ngram import RowIndex, lookup

N_MIN, N_MAX = 3, 4  # the suffix lengths that count, longest first (see the module docstring)
K = 3  # drafts a lookup round takes (fewer where the request's K ceiling is lower)


@dataclass(slots=True)
class Context:
    """The lone request's context, kept as prompt lookup keeps a row's (gmlx/drafters/ngram.py): its
    sequence (prompt, verified tokens, the pending bonus last) grows by each round's verified tokens
    (`commit`), and while it decodes plain by its emitted tokens (`recurs`), which the re-arm's commit
    then brings again (skipped: `ahead`)."""

    index: RowIndex
    prompt: int  # its prompt's length
    limit: int  # the longest sequence its budget allows
    ahead: int = 0  # tokens read from its emitted output that its commits have not brought yet


class ContextLookup:
    def start(self, row) -> Context:
        budget = getattr(getattr(row, "params", None), "max_tokens", None)
        n = len(row.prompt)
        return Context(RowIndex(list(row.prompt) + list(row.tokens)), n, n + budget if budget is not None else 1 << 62)

    def commit(self, st: Context, accepted: np.ndarray, targets) -> None:
        """The verified tokens (the accepted drafts, then the bonus), less those read ahead."""
        new = np.array(targets)[0, : int(accepted[0]) + 1].tolist()  # sync: none, the round's tokens were read already
        skip = min(st.ahead, len(new))
        st.ahead -= skip
        st.index.seq.extend(new[skip:])

    def propose(self, st: Context, most: int) -> list[int]:
        """Drafts from the context ([] when its suffix never occurred): up to K, never more than
        `most` (the request's K ceiling: the most drafts a round of it runs, whoever drafts them)
        nor than its budget can use (a round of k drafts emits up to k + 1 tokens)."""
        seq = st.index.sync(N_MIN, N_MAX)
        n = min(K, most, st.limit - len(seq) - 1)
        return lookup(seq, st.index.after, n, N_MIN, N_MAX) if n > 0 else []

    def recurs(self, st: Context, emitted: list[int] | None = None) -> bool:
        """Whether the request would draft from its context now: whether its last N_MIN..N_MAX
        tokens occurred earlier in it. `emitted`: its output tokens so far (a request the control
        has plain: gmlx/decode/scalar.py re-arms it for such a round), read into the sequence where
        they run past it; None: the sequence as committed."""
        if emitted is not None and (new := emitted[len(st.index.seq) - st.prompt:]):
            st.index.seq.extend(new)
            st.ahead += len(new)
        seq = st.index.sync(N_MIN, N_MAX)
        return any(tuple(seq[-n:]) in st.index.after for n in range(min(N_MAX, len(seq)), N_MIN - 1, -1))
