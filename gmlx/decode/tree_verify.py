"""Tree verification in the scalar lane (issue 20): several draft paths verified in one forward.

Why "paths as rows": mlx-lm's attention applies RoPE with the cache's one offset, so a flattened
tree (siblings sharing a position) cannot run through mlx-lm's model files unforked with a tree
mask. Every path of the tree instead starts at the same position n (right after the pending
bonus), so the P paths run as P rows of ONE forward whose cache is a per-layer view
(`TreeKV`): the request's own prefix K/V broadcast to the P rows, then each row's new K/V. The
offset stays the scalar n, so RoPE, the causal mask and mlx-lm's attention are exactly those of
the chain's verify, and row p's logits at depth j are the target's given exactly path p's prefix.
The cost is a copy of the prefix K/V to P rows inside the forward (the concatenation attention
reads), per layer and round: O(P x context) memory traffic, measured in benchmarks/bench_tree.py.

Acceptance walks the tree along the target's own tokens (`walk`): at depth j the target token is
taken from the path being followed; the walk continues on any path whose drafts so far equal the
followed ones and whose draft at j equals that token (the followed path first). Every path with
that prefix has, in exact arithmetic, the same target token at j, since it is computed from the
same prefix at the same position with the same noise G(seed, n + j): the emitted tokens are the
target's samples along the accepted path, so greedy and seeded streams are exactly those of plain
decoding (docs/design.md §3), whatever the tree held.

After the walk only the accepted path survives: its bonus + a accepted drafts' K/V (written by
the same forward) are appended to the request's cache, nothing else ever enters it (no trim, no
compaction copy of the prefix); the drafter gets the accepted path's hidden states and tokens
through its `commit` (k = 1: the tree's chains ran on a copy of its state, gmlx/drafters/token_tree.py).

Which runs, tree or chain (`TreeChoice`): trees pay only where the extra rows are nearly free and
the second branch wins often; the lane measures both (tokens per round and wall time between
round reads, in alternating rounds) and runs the tree only while it is measured faster than the
chain it replaces (`always`: tests and A/B benchmarks).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from gmlx.decode.scalar import Flight, ScalarLane, ScalarSeq
from gmlx.row import RoundResult
from gmlx.drafters.token_tree import TreeProposer, supports, unwrapped
from gmlx import trace
from gmlx.sampling import RowSampling, sample


class TreeKV:
    """One layer's cache for a tree verify: the request's KVCache (read only) shared by P rows.
    mlx-lm's cache protocol: `offset` (the scalar position of every row's first input),
    `update_and_fetch`, `make_mask`."""

    def __init__(self, base: KVCache, rows: int):
        self.base, self.rows = base, rows
        self.offset = base.offset
        self.keys = self.values = None  # this forward's new K/V [P, H, L, D]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.keys, self.values = keys, values
        n = self.base.offset
        if n == 0 or self.base.keys is None:
            return keys, values
        pk = self.base.keys[:, :, :n]
        pv = self.base.values[:, :, :n]
        pk = mx.broadcast_to(pk, (keys.shape[0],) + pk.shape[1:])
        pv = mx.broadcast_to(pv, (values.shape[0],) + pv.shape[1:])
        return mx.concatenate([pk, keys], axis=2), mx.concatenate([pv, values], axis=2)

    def make_mask(self, *args, **kwargs):
        return self.base.make_mask(*args, **kwargs)

    def commit(self, row: int, n: int) -> None:
        """Append row `row`'s first n new entries to the request's cache."""
        if n:
            self.base.update_and_fetch(self.keys[row:row + 1, :, :n], self.values[row:row + 1, :, :n])
        self.keys = self.values = None


def walk(drafts: np.ndarray, targets: np.ndarray, lengths: np.ndarray) -> tuple[int, int, list[int]]:
    """The acceptance rule on a tree of paths: drafts [P, k], targets [P, k+1] (row p's target
    tokens given path p's drafts), lengths [P] real drafts per path. Returns (the accepted path,
    the accepted count a, the emitted tokens: the a accepted drafts, then the bonus)."""
    P, k = drafts.shape
    cur, a = 0, 0
    alive = np.ones(P, dtype=bool)  # paths whose drafts so far equal the followed ones
    for j in range(k):
        t = targets[cur, j]
        ok = alive & (drafts[:, j] == t) & (lengths > j)
        if not ok.any():
            break
        if not ok[cur]:
            cur = int(np.flatnonzero(ok)[0])
        alive, a = ok, a + 1
    tokens = [int(x) for x in drafts[cur, :a]] + [int(targets[cur, a])]
    return cur, a, tokens


# -- tree or chain: measured -------------------------------------------------------------------
WINDOW = 16
MIN_ROUNDS = 8  # rounds of each shape in a measuring phase
TOKENS_WINDOW = 64  # rounds of each shape in its tokens-per-round mean
EXPLORE_EVERY = 64  # rounds of one shape before the other is measured again
MARGIN = 1.03  # the tree must be measured this much faster to replace the chain
MIN_Q = 0.0  # confidence pruning of depth-1 branches (gmlx/drafters/token_tree.py); 0: never pruned


class TreeChoice:
    """Tree or chain at width 1, from measured round times. `mode`: "auto" (measured), "always",
    "never". Measuring phase: tree and chain rounds alternate for 2 x MIN_ROUNDS rounds (paired,
    so both see the same load on the machine); the tree then runs only if its rate (`rate`: a
    spike moves one round, not the median) is MARGIN above the chain's; EXPLORE_EVERY rounds later both are measured again (a bounded cost: half of
    2 x MIN_ROUNDS rounds of every 2 x MIN_ROUNDS + EXPLORE_EVERY at the slower one's speed)."""

    def __init__(self, mode: str = "auto"):
        if mode not in ("auto", "always", "never"):
            raise ValueError(f"tree mode must be 'auto', 'always' or 'never', got {mode!r}")
        self.mode = mode
        self.figures = {False: deque(maxlen=WINDOW), True: deque(maxlen=WINDOW)}  # tree? -> (tokens, s)
        self.tokens = {False: deque(maxlen=TOKENS_WINDOW), True: deque(maxlen=TOKENS_WINDOW)}  # kept across phases
        self.current = False  # tree in force (after a measuring phase)
        self.measuring = 2 * MIN_ROUNDS  # rounds left in the measuring phase
        self.run = 0  # rounds since the last decision
        self.switches = 0
        self._next = False  # the shape of the next measuring round

    def rate(self, tree: bool) -> float | None:
        """Mean tokens per round (the last TOKENS_WINDOW rounds of that shape: a round's count
        varies a lot, its mean settles slowly) over the median round time of the last measuring
        phase (the machine's load changes quickly)."""
        f = self.figures[tree]
        if len(f) < MIN_ROUNDS:
            return None
        return statistics.mean(self.tokens[tree]) / max(statistics.median(s for _, s in f), 1e-9)

    def pick(self) -> bool:
        if self.mode != "auto":
            return self.mode == "always"
        if self.measuring > 0:
            self._next = not self._next
            return self._next
        return self.current

    def observe(self, tree: bool, tokens: int, seconds: float) -> None:
        if self.mode != "auto":
            return
        self.figures[tree].append((tokens, seconds))
        self.tokens[tree].append(tokens)
        if self.measuring > 0:
            self.measuring -= 1
            if self.measuring == 0:
                chain, tree_rate = self.rate(False), self.rate(True)
                before = self.current
                self.current = chain is not None and tree_rate is not None and tree_rate >= chain * MARGIN
                self.switches += self.current != before
                self.run = 0
            return
        self.run += 1
        if self.run >= EXPLORE_EVERY:
            self.figures[False].clear()
            self.figures[True].clear()
            self.measuring = 2 * MIN_ROUNDS


@dataclass(slots=True)
class TreeFlight(Flight):
    """A dispatched tree round: `views` hold the forward's new K/V until the walk picks a path."""

    views: list | None = None
    lengths: np.ndarray | None = None
    rows: int = 1


class TreeScalarLane(ScalarLane):
    """The scalar lane with tree rounds (see the module's docstring). Anything a tree round does
    not cover runs the chain unchanged: a drafter without tree drafting, logits processors or
    logprobs, caches other than mlx-lm's KVCache (recurrent or rotating layers), rounds of 0
    drafts, and rounds the choice gives to the chain."""

    def __init__(self, *args, branches: int = 2, tree: str = "auto", min_q: float = MIN_Q, **kw):
        super().__init__(*args, **kw)
        self.branches = branches
        self.choice = TreeChoice(tree)
        self.proposer = TreeProposer(min_q)
        self.paths = 0  # paths verified by tree rounds (rows), for the figures
        self._rows_rs: tuple | None = None  # (seq, P-row RowSampling)
        self._last_read: float | None = None
        self.tree_rounds = 0

    def _treeable(self, seq: ScalarSeq) -> bool:
        return (self.branches > 1 and seq.draft is not None and supports(self.drafter)
                and unwrapped(self.drafter, seq.draft) is not None and seq.rs.proc is None and all(type(c) is KVCache for c in seq.cache))

    def _rows_sampling(self, seq: ScalarSeq) -> RowSampling:
        if self._rows_rs is None or self._rows_rs[0] is not seq:
            P = self.branches
            self._rows_rs = (seq, RowSampling.from_params([seq.row.params] * P, [seq.row.seed] * P))
        return self._rows_rs[1]

    def _dispatch(self, seq: ScalarSeq, bonus: int, n: int, remaining: int, pending: list[int] = ()) -> Flight:
        k = asked = self.round_k(seq, remaining)
        if not k or not self._treeable(seq) or not self.choice.pick():
            return super()._dispatch(seq, bonus, n, remaining, pending)
        rs_rows = self._rows_sampling(seq)
        drafts, lengths = self.proposer.propose(self.drafter, seq.draft, k, self.branches, seq.rs, rs_rows, n)
        P = drafts.shape[0]
        k = int(lengths.max())
        drafts = drafts[:, :k]
        mx.async_eval(drafts)
        inputs = mx.concatenate([mx.full((P, 1), bonus, dtype=mx.int32), drafts], axis=1)  # [P, k+1]
        # One path left (pruned, or one n-gram continuation): the chain's verify on the cache itself.
        views = [TreeKV(c, P) for c in seq.cache] if P > 1 else None
        logits, hidden = self.target(inputs, views or seq.cache)  # [P, k+1, V], [P, k+1, D]
        rs = rs_rows if P == self.branches else RowSampling.from_params([seq.row.params] * P, [seq.row.seed] * P)
        targets = sample(logits, rs, np.full(P, n))  # [P, k+1]: the same positions' noise on every row
        read = mx.concatenate([drafts, targets], axis=1)
        trace.mark("build")
        mx.async_eval(read)
        trace.mark("dispatch")
        return TreeFlight(k=k, position=n, read=read, hidden=hidden, targets=targets, views=views,
                          lengths=lengths, rows=P, asked=asked)

    def _collect(self, seq: ScalarSeq, fl: Flight) -> RoundResult:
        if not isinstance(fl, TreeFlight):
            res = super()._collect(seq, fl)
        else:
            res = self._collect_tree(seq, fl)
        now = time.perf_counter()
        if self._last_read is not None and fl.k:
            self.choice.observe(isinstance(fl, TreeFlight), len(res.tokens), now - self._last_read)
        self._last_read = now if fl.k else None
        return res

    def _collect_tree(self, seq: ScalarSeq, fl: TreeFlight) -> RoundResult:
        k = fl.k
        read = np.array(fl.read)  # sync: the round's one host read of every path's drafts and tokens
        trace.mark("wait")
        path, a, tokens = walk(read[:, :k], read[:, k:], fl.lengths)
        seq.acceptance.record(k, a)
        trace.mark("readback")
        if fl.views is None:
            if k > a:
                for c in seq.cache:
                    c.trim(k - a)
        else:
            for v in fl.views:
                v.commit(path, a + 1)  # the bonus and the accepted drafts; nothing else enters the cache
        self.paths += fl.rows
        accepted = np.array([a])
        self.drafter.commit(seq.draft, 1, accepted, fl.hidden[path:path + 1],
                            mx.maximum(fl.targets[path:path + 1], 0))  # never embed FAULT
        self.tree_rounds += 1
        trace.mark("commit")
        return RoundResult(tokens=tokens, drafted=k, accepted=a)

    def retire(self):
        if isinstance(self.flight, TreeFlight) and self.flight.views is not None:
            self.flight = None  # nothing of an unread tree round is in the cache
        return super().retire()

    def clear(self) -> None:
        super().clear()
        self._rows_rs = None
        self._last_read = None
