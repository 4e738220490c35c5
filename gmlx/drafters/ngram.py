"""Prompt-lookup drafter (`--drafter ngram`): n-gram lookup decoding as vLLM's `ngram` method and
llama.cpp's lookup decoding. Each row drafts by copying what followed the most recent earlier
occurrence of its own last n tokens, in its prompt or its output. No model and no device work, so
it serves any target with any tokenizer; it pays where the output repeats its context (quoting,
editing code, lists, structured data).

Matching, per row and round: for n from n_max down to n_min, the first n whose suffix occurred
earlier wins (longest first), at its most recent occurrence; the drafts are the k tokens that
followed it, the span repeated where the history ends sooner (a loop: `lookup`). A row whose
suffix never occurred drafts nothing that round (`draft_lengths`: 0 for that row; the lanes
verify only the columns some row drafted and accept at most each row's own count).

State per row: its sequence (the prompt and every verified token; the last is the pending bonus,
the drafts follow it) and an index from each n-gram to the position of the token after its most
recent occurrence. The sequence grows at `commit` by the round's verified tokens (the accepted
drafts and the bonus): a lane dispatches the next round before the engine emits this one, so the
row's own token list may lag a round behind. A draft first brings the index up to date with the
tokens added since the last one, so it costs O(new tokens x n range + n_max + k) per row whatever
the sequence's length; the first draft of a row indexes its whole history once (O(length) on the
host, built in C: a few ms per thousand tokens, far below the prefill). Rejected drafts never
enter a sequence, so there is nothing to roll back; `capture` (re-arming after a gate) starts
fresh sequences from the rows and the capture round's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from gmlx.drafters.base import DraftPick, Drafter
from gmlx.errors import InvalidRequest

# Suffix lengths tried, longest first: 4 down to 2 (4 as in vLLM's documented ngram example).
# Replaying greedy streams of SmolLM2 and the embedded model (code and chat, k = 3), allowing
# 1-token matches drafted ~60% more but cut acceptance from 0.64 to 0.49 (0.63 to 0.47), and with a
# verified column costing ~0.15-0.25 of a decode step on this CPU the modelled speed was no better
# overall and worse on the streams that repeat least; 4 matched exactly where 3 did (a miss costs
# one more dict probe).
N_MAX = 4
N_MIN = 2


@dataclass(slots=True)
class RowIndex:
    """One row's sequence (prompt and verified tokens) and its n-gram index."""

    seq: list[int]
    after: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> position after its latest occurrence
    indexed: int = 0  # positions i < indexed are in `after` (as the token that follows an n-gram)

    def sync(self, n_min: int, n_max: int) -> list[int]:
        """Index every n-gram that gained a following token since the last call (the sequence's
        own suffix has none yet, so it never matches itself)."""
        seq = self.seq
        end = len(seq)
        for n in range(n_min, n_max + 1):
            lo = max(self.indexed, n)  # i in [lo, end): the n-gram seq[i-n:i] and its next token seq[i]
            if end - lo > 8:  # a prompt or a capture: zip builds the tuples in C (~1 ms per 1k tokens)
                self.after.update(zip(zip(*(seq[lo - n + m:end - n + m] for m in range(n))), range(lo, end)))
            else:  # a round's few tokens: cheaper without zip's setup
                for i in range(lo, end):
                    self.after[tuple(seq[i - n:i])] = i
        self.indexed = end
        return seq


def lookup(seq: list[int], after: dict, k: int, n_min: int, n_max: int) -> list[int]:
    """The k tokens that followed the most recent earlier occurrence of the longest suffix of
    `seq` (n_max down to n_min tokens) found in `after`; [] when none occurred.

    An occurrence p < k tokens back (the output repeats a span of p tokens: a loop, a
    run of one token) has fewer than k tokens after it; the drafts then go on copying past the
    sequence's end into themselves — seq + drafts read from i, i.e. the span repeated — which is
    what looking up again with each draft appended finds (llama.cpp's lookup drafts that way,
    token by token). Before, such a row drafted p tokens a round whatever K the control chose:
    the micro model (a one-token loop) ran K=3 rounds of 1 draft, predicted 3.5x for ~1.1x."""
    end = len(seq)
    for n in range(min(n_max, end - 1), n_min - 1, -1):
        i = after.get(tuple(seq[end - n:]))
        if i is not None:
            span = seq[i:min(i + k, end)]
            return span if len(span) == k else [span[j % len(span)] for j in range(k)]
    return []


@dataclass(slots=True)
class NGramRows:
    rows: list[RowIndex]
    lengths: np.ndarray  # [B] drafts each row proposed in the last draft (host data)


class NGramDrafter(Drafter):
    kind = "ngram"
    needs_hidden = False
    step_cost = 0.0  # host only: ~10-20 us per row and round measured (loaded 2-core CPU), vs ms per target step
    drafts_replaceable = True  # commit: the verified tokens (and hidden states) only

    def __init__(self, n_min: int = N_MIN, n_max: int = N_MAX):
        if not 1 <= n_min <= n_max:
            raise InvalidRequest(f"ngram drafter: need 1 <= n_min <= n_max, got n_min={n_min}, n_max={n_max}")
        self.n_min, self.n_max = n_min, n_max

    def _state(self, seqs: list[list[int]]) -> NGramRows:
        return NGramRows([RowIndex(s) for s in seqs], np.zeros(len(seqs), dtype=np.int64))

    def start(self, rows, pres) -> NGramRows:
        return self._state([list(r.prompt) + list(r.tokens) for r in rows])

    def merge(self, a: NGramRows, b: NGramRows) -> NGramRows:
        return NGramRows(a.rows + b.rows, np.concatenate([a.lengths, b.lengths]))

    def filter(self, st: NGramRows, keep: list[int]) -> NGramRows:
        return NGramRows([st.rows[i] for i in keep], st.lengths[keep])

    def width(self, st: NGramRows) -> int:
        return len(st.rows)

    def draft(self, st: NGramRows, k: int, pick: DraftPick, target_cache: list) -> mx.array:
        """Drafts [B, k] int32 from host data (a row's unused columns are 0: padding)."""
        out = np.zeros((len(st.rows), k), dtype=np.int32)
        lengths = np.zeros(len(st.rows), dtype=np.int64)
        for b, ix in enumerate(st.rows):
            seq = ix.sync(self.n_min, self.n_max)
            d = lookup(seq, ix.after, k, self.n_min, self.n_max)
            out[b, :len(d)] = d
            lengths[b] = len(d)
        st.lengths = lengths
        return mx.array(out)

    def draft_lengths(self, st: NGramRows) -> np.ndarray:
        return st.lengths

    def commit(self, st: NGramRows, k: int, accepted: np.ndarray, hidden, targets) -> None:
        """Append each row's verified tokens: its accepted drafts, then the bonus."""
        verified = np.array(targets)  # sync: none in practice, the round's tokens were read already
        for ix, t, a in zip(st.rows, verified, accepted):
            ix.seq.extend(t[: int(a) + 1].tolist())  # sync: none, numpy data

    def capture(self, rows, hidden, targets) -> NGramRows:
        verified = np.array(targets)  # sync: none in practice, the capture round's tokens were read already
        return self._state([list(r.prompt) + list(r.tokens) + [int(t[0])] for r, t in zip(rows, verified)])
