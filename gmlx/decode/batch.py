"""The batch loop: several requests decode together on ragged KV, speculating or plain.

Rows are `Row` records aligned with the ragged caches' slots (one list to filter). Each row's
KV start is 0 and its end is the cache's per-row length; its budget, emitted count, finished
flag and bonus token are on the Row. Pending-bonus invariant at a round boundary, per row:
the cache holds x_0..x_{n-2}, the bonus x_{n-1} is emitted but not cached (except while a
gated plain lookahead is in flight, which has appended x_{n-1} already).

Armed round (greedy drafts, per-row acceptance and rollback):
    drafts D [B, k]   = the drafter (gmlx.drafters), greedy for every row
    T [B, k+1]        = sample(target([bonus_b, D_b]))      one forward of (B, k+1)
    a_b               = leading matches of D_b and T_b       (accept iff equal)
    emit T_b[:a_b+1]; trim row b of the target KV by k - a_b; the drafter rolls its own state
    back per row (`commit`) from the accepted counts and the verify's hidden states.
Gated round: one plain step per row, double-buffered (step n+1 dispatched before n is read).
Capture round: one-position verify of every pending bonus with hidden capture; emits one token
per row at plain cost and cold-starts the drafter from the captured hidden states (a KV-sharing
drafter also finds the bonus's K/V in the target cache, written by the same forward) — or, after
a gated stretch with shadow rounds, continues the drafter state they kept (gmlx/decode/batch_shadow.py).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from gmlx.decode import plain
from gmlx.decode.batch_shadow import BatchShadow
from gmlx.decode.prefill import Prefilled
from gmlx.decode.verify import verified
from gmlx.row import RoundResult
from gmlx.drafters.base import DraftPick, Drafter
from gmlx import trace
from gmlx.kv import RaggedKVCache
from gmlx.model_cache import extend_rows, filter_rows, trim_rows
from gmlx.row import Row
from gmlx.models.adapter import Target
from gmlx.processors import attach, processed, scored
from gmlx.sampling import RowSampling, sample


class BatchLoop:
    def __init__(self, target: Target, drafter: Drafter | None):
        self.target = target
        self.drafter = drafter
        self.rows: list[Row] = []
        self.cache: list[RaggedKVCache] = []
        self.draft: object | None = None  # the drafter's state for every row; armed iff set
        self.lookahead: mx.array | None = None  # [B, 1] in-flight plain tokens
        self.lookahead_lps: mx.array | None = None  # their logprobs, when some row asked (gmlx.processors)
        self.rs: RowSampling | None = None
        self.shadow: BatchShadow | None = None  # gated: the drafter's state kept by shadow rounds
        self.shadow_wanted = False  # gated without one: the next plain step starts shadow rounds

    @property
    def width(self) -> int:
        return len(self.rows)

    @property
    def armed(self) -> bool:
        return self.draft is not None

    def _bonus(self) -> mx.array:
        return mx.array([[r.tokens[-1] if r.tokens else r.prompt[-1]] for r in self.rows], dtype=mx.int32)

    def _first_positions(self, shift: int = 0) -> np.ndarray:
        """Each row's absolute position of the next token (+ shift): the round's noise keys."""
        return np.array([r.next_position + shift for r in self.rows])

    # ---- membership ------------------------------------------------------------------
    def add(self, rows: list[Row], new: list[RaggedKVCache], pres: list[Prefilled], arm: bool,
            shadow: bool = False) -> None:
        """Join prefilled rows: `new` is their per-layer ragged cache (up to each bonus), `pres`
        their drafter inputs. `arm`: they join the drafter, teacher-forced on their prompts'
        hidden states (the batch must be armed). `shadow` (not armed): they join the gated batch's
        shadow rounds (those of a batch formed with them; their `pres` carry hidden states)."""
        assert self.lookahead is None, "admission while a plain lookahead is in flight"
        if self.cache:
            extend_rows(self.cache, new)
        else:
            self.cache = new
        if arm:
            assert self.drafter is not None and (self.draft is not None or not self.rows)
            new_state = self.drafter.start(rows, pres)
            self.draft = new_state if self.draft is None else self.drafter.merge(self.draft, new_state)
        elif not shadow:  # rows without the drafter's state: the gated stretch has no shadow rounds
            self.shadow = None
        elif self.shadow is not None:
            self.shadow.add(rows, pres)
        elif not self.rows:
            self.shadow = BatchShadow(self.drafter, self.drafter.start(rows, pres), rows)
        self.rows.extend(rows)
        self._resample()

    def filter(self, keep: list[int]) -> None:
        """Keep these rows (finished or cancelled rows leave; their KV and drafter state go)."""
        if len(keep) == len(self.rows):
            return
        if self.shadow is not None and keep:
            self.shadow.filter(self.rows, keep)
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.cache, self.draft, self.lookahead, self.rs, self.shadow = [], None, None, None, None
            self.shadow_wanted = False
            return
        filter_rows(self.cache, keep)
        idx = mx.array(keep, dtype=mx.int32)
        if self.draft is not None:
            self.draft = self.drafter.filter(self.draft, keep)
        if self.lookahead is not None:
            self.lookahead = self.lookahead[idx]
            if self.lookahead_lps is not None:
                self.lookahead_lps = self.lookahead_lps[idx]
        self._resample()

    def disarm(self, keep: bool = False) -> None:
        """Gate: drop the drafter's state for every row (rebuilt by a capture round), or `keep` it
        for the gated stretch's shadow rounds."""
        self.shadow = BatchShadow(self.drafter, self.draft, self.rows) if keep and self.draft is not None else None
        self.draft = None

    def drop_shadow(self) -> None:
        """End the gated stretch's shadow rounds (a resume then rebuilds the drafter's state with
        a capture round, as after a gate that kept nothing)."""
        self.shadow = None

    def shadow_again(self) -> None:
        """Start shadow rounds in this gated stretch from the next plain step: its hidden states
        arm the drafter as a capture round's do (a cold start: no history before that step)."""
        self.shadow_wanted = self.drafter is not None

    def _resample(self) -> None:
        self.rs = RowSampling.from_params([r.params for r in self.rows], [r.seed for r in self.rows])

    # ---- rounds ------------------------------------------------------------------------
    def speculative_round(self, k: int) -> list[RoundResult]:
        assert self.draft is not None and self.lookahead is None
        pick = DraftPick(None, np.array([r.next_position for r in self.rows]))  # greedy across rows
        drafts = self.drafter.draft(self.draft, k, pick, self.cache)  # [B, k]
        lengths = self.drafter.draft_lengths(self.draft)  # host: rows that drafted fewer than k
        if lengths is not None:
            k = int(lengths.max())  # verify no column that no row drafted
            drafts = drafts[:, :k]
        mx.async_eval(drafts)  # the draft chain starts computing while the verify graph is built
        inputs = mx.concatenate([self._bonus(), drafts], axis=1)  # [B, k+1]
        logits, hidden = self.target(inputs, self.cache)  # [B, k+1, V], [B, k+1, D]
        # processors (if any): position j of row b sees its committed tokens and drafts[b, :j]
        logits = processed(logits, self.rs, self.rows, self._first_positions(), drafts)
        targets = sample(logits, self.rs, self._first_positions())  # [B, k+1]
        lps = scored(logits, targets, self.rs)  # None unless some row asked for logprobs
        both = mx.concatenate([drafts, targets], axis=1)
        trace.mark("build")
        if lps is not None:
            mx.eval(both, lps)  # sync: the round's one evaluation, tokens and logprobs together
        read = np.array(both)  # sync: the round's one host read
        trace.mark("wait")
        accepted, results = verified(read[:, :k], read[:, k:], lengths)
        attach(results, lps, self.rs)
        trace.mark("readback")
        trim_rows(self.cache, k - accepted)
        # A FAULT (-1) target ends its row at emission; the drafter must still never embed it.
        self.drafter.commit(self.draft, k, accepted, hidden, mx.maximum(targets, 0))
        trace.mark("commit")
        return results

    def plain_round(self, successor: bool) -> list[RoundResult]:
        """One plain step per row; dispatch the next step before reading this one (if asked)."""
        assert self.draft is None
        if self.lookahead is not None:
            cur, cur_lps = self.lookahead, self.lookahead_lps
        else:
            cur, cur_lps = self._plain_step(self._bonus(), 0)
        self.lookahead = self.lookahead_lps = None
        first = plain.FIRST_TOKEN_OUT and any(not r.tokens for r in self.rows)  # a row's first token leaves now
        if successor and not first and any(r.remaining > 1 for r in self.rows):
            # a FAULT row is finished; feed it a real id
            self.lookahead, self.lookahead_lps = self._plain_step(mx.maximum(cur, 0), 1)
            trace.mark("build")
            mx.async_eval(self.lookahead) if self.lookahead_lps is None else mx.async_eval(self.lookahead,
                                                                                          self.lookahead_lps)
            trace.mark("dispatch")
        toks = cur.tolist()  # sync: read this step's tokens while the next step computes
        trace.mark("wait")
        results = [RoundResult(tokens=row_toks, drafted=0, accepted=0) for row_toks in toks]
        attach(results, cur_lps, self.rs)
        return results

    def _plain_step(self, y: mx.array, shift: int) -> tuple[mx.array, mx.array | None]:
        """Each row's next token (and logprobs, None unless asked); shift 1: `y` is the previous
        step's tokens, still on the device (processors see them there)."""
        if self.shadow is None and not self.shadow_wanted:
            logits = self.target.logits(y, self.cache)[:, -1:]  # [B, 1, V]
        else:  # the hidden-capturing forward, as a verify's: the shadow's entries
            logits, hidden = self.target(y, self.cache)
            logits = logits[:, -1:]
        logits = processed(logits, self.rs, self.rows, self._first_positions(shift), y if shift else None, shift)
        tok = sample(logits, self.rs, self._first_positions(shift))  # [B, 1]
        if self.shadow is not None:
            self.shadow.commit(hidden[:, -1:], tok, self._first_positions(shift))
        elif self.shadow_wanted:  # (FAULT: see speculative_round's commit)
            state = self.drafter.capture(self.rows, hidden[:, -1:], mx.maximum(tok, 0))
            self.shadow, self.shadow_wanted = BatchShadow(self.drafter, state, self.rows), False
        return tok, scored(logits, tok, self.rs)

    def capture_round(self) -> list[RoundResult]:
        """Verify every pending bonus alone, capturing hidden states; arm the drafter from them."""
        assert self.lookahead is None and self.drafter is not None
        logits, hidden = self.target(self._bonus(), self.cache)  # [B, 1, V], [B, 1, D]
        logits = processed(logits, self.rs, self.rows, self._first_positions())
        targets = sample(logits, self.rs, self._first_positions())  # [B, 1]
        lps = scored(logits, targets, self.rs)
        mx.eval(targets) if lps is None else mx.eval(targets, lps)  # sync: the round's one host read
        toks = targets.tolist()  # sync: evaluated above
        self.shadow_wanted = False
        if self.shadow is not None:  # the state the shadow rounds kept: the drafter's whole history
            self.drafter.commit(self.shadow.state, 0, np.zeros(self.width, dtype=np.int64), hidden,
                                mx.maximum(targets, 0))
            self.draft, self.shadow = self.shadow.state, None
        else:
            self.draft = self.drafter.capture(self.rows, hidden, mx.maximum(targets, 0))  # FAULT: see commit
        results = [RoundResult(tokens=t, drafted=0, accepted=0) for t in toks]
        attach(results, lps, self.rs)
        return results

