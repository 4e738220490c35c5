"""Simulated concurrent request streams, driven into an in-process backend (the gmlx engine or an
mlx-lm baseline) by one loop in the caller's thread.

Why the caller's thread and `step()` rather than the engine thread: the loop then decides, between
two rounds, exactly which requests have arrived and whether a slot is free, so a run is
reproducible (join-late waiters always meet a running request) and Ctrl-C lands in our code, not
in a thread we would have to unwind. Rounds and admission are the engine's own, as in serving.

Timing is taken where a streaming client would see it: when a round's pieces are handed over
(the end of `step()`). TTFT = first piece - submit; ITL = gaps between successive piece arrivals
that carried tokens (vLLM's per-chunk definition: a speculative round delivers several tokens at
once, and a client waits for the chunk, not for each token). Every request also has an end: the
round that finished it (one that ended at EOS before any token included), or the interrupt; a
run's aggregate throughput is its tokens / (last end - first submit), `aggregate_tokens_per_s`.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from gmlx.config import SamplingParams
from gmlx.engine.metrics import Event, EventKind
from gmlx.finish import FinishReason
from gmlx_cli.bench.workload import Request


@dataclass
class Outcome:
    """What one request did in one run (times relative to the run's start)."""

    request: Request
    prompt_tokens: list[int]
    submit_s: float
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival time, tokens in it)
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # a FinishReason; from a server, whatever it sent
    stats: dict = field(default_factory=dict)
    end_s: float | None = None  # when it ended, whatever the reason (EOS first, cancelled, rejected included)

    @property
    def num_generated(self) -> int:
        return len(self.tokens)

    @property
    def ended_s(self) -> float:
        """Its end time: `end_s` as the driver recorded it; for an outcome built without one, its
        last chunk (else its submit time)."""
        if self.end_s is not None:
            return self.end_s
        return self.chunks[-1][0] if self.chunks else self.submit_s

    @property
    def ttft_s(self) -> float | None:
        return self.chunks[0][0] - self.submit_s if self.chunks else None

    @property
    def itl_s(self) -> list[float]:
        return [b[0] - a[0] for a, b in zip(self.chunks, self.chunks[1:])]

    @property
    def tokens_per_s(self) -> float:
        """Decode rate after the first token, as RequestStats: (n - 1) / (last - first); NaN where
        it is undefined (one token, or every chunk read at the same instant: a short request whose
        SSE events the client read in one go), so medians skip it instead of counting 0."""
        n = sum(c for _, c in self.chunks)
        dt = self.chunks[-1][0] - self.chunks[0][0] if self.chunks else 0.0
        return (n - 1) / dt if n > 1 and dt > 0 else math.nan


def aggregate_tokens_per_s(tokens: Iterable[int], submit_s: Iterable[float], end_s: Iterable[float]) -> float:
    """A run's aggregate throughput, the one figure the live line, the summary, the JSON, the CSV and
    the PNG show: all its tokens / (its last end - its first submit). Every request counts, however
    it ended (at EOS before a token, cancelled, rejected): each has an end, and the span covers it.
    NaN for a run with no requests or no time."""
    tokens, submit_s, end_s = list(tokens), list(submit_s), list(end_s)
    if not submit_s or not end_s:
        return math.nan
    span = max(end_s) - min(submit_s)
    return sum(tokens) / span if span > 0 else math.nan


def run_aggregate(outcomes: Iterable[Outcome]) -> tuple[int, float]:
    """(tokens, aggregate tok/s) of one run's outcomes (`aggregate_tokens_per_s`)."""
    outs = list(outcomes)
    tokens = [o.num_generated for o in outs]
    return sum(tokens), aggregate_tokens_per_s(tokens, [o.submit_s for o in outs], [o.ended_s for o in outs])


class Backend:
    """What the driver needs: submit ids, run one round (returning engine-style Events), and the
    final tokens of a finished request. Engine and mlx-lm baselines implement it alike."""

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> int: ...
    def step(self) -> list[Event]: ...
    def result(self, rid: int) -> tuple[list[int], str, dict]: ...
    @property
    def has_work(self) -> bool: ...
    def close(self) -> None: ...

    def transitions(self) -> dict[str, int]:
        return {}  # only the engine has loops to move between


class EngineBackend(Backend):
    def __init__(self, engine):
        self.engine = engine
        self._streams = {}

    def submit(self, prompt_ids, params):
        stream = self.engine.submit(prompt_ids, params, start=False)  # we drive step() ourselves
        self._streams[stream.request_id] = stream
        return stream.request_id

    def step(self):
        return self.engine.step()

    def result(self, rid):
        rec = self._streams.pop(rid).wait(0)
        return list(rec.tokens), rec.finish_reason, dict(rec.stats)

    @property
    def has_work(self):
        return self.engine.has_work

    def transitions(self):  # and the online control's switches, counted like a transition
        return {**self.engine.counters.transitions, "control_switches": self.engine.counters.control_switches}

    def close(self):
        self.engine.close()  # in-flight requests end "cancelled"


def drive(backend: Backend, requests: list[Request], prompt_ids: dict[int, list[int]], concurrency: int,
          on_event: Callable[[Event], None] | None = None, on_submit: Callable[[int, float], None] | None = None,
          done: list[Outcome] | None = None, clock=time.perf_counter, sleep=time.sleep) -> list[Outcome]:
    """Run the workload to the end: submit in arrival order while fewer than `concurrency` are in
    flight, one round per iteration. Finished outcomes are appended to `done` as they finish, so a
    Ctrl-C leaves the caller everything measured so far (the in-flight ones are then cancelled)."""
    done = [] if done is None else done
    pending = deque(sorted(requests, key=lambda r: (r.arrival_s, r.request_id)))
    live: dict[int, Outcome] = {}
    stepped = False  # join-late: a waiter arrives only after the long request has run a round
    t0 = clock()
    ok = False
    try:
        while pending or live:
            now = clock() - t0
            while pending and len(live) < concurrency and pending[0].arrival_s <= now \
                    and (stepped or not pending[0].after_start):
                req = pending.popleft()
                ids = prompt_ids[req.request_id]
                rid = backend.submit(ids, req.params)
                live[rid] = Outcome(req, ids, submit_s=clock() - t0)
                if on_submit:
                    on_submit(rid, live[rid].submit_s)
            if not backend.has_work:  # idle until the next arrival
                if live:  # a backend that dropped a request would otherwise spin here forever
                    raise RuntimeError(f"the backend has no work but requests {sorted(live)} never finished")
                if pending:
                    sleep(min(0.05, max(0.0, pending[0].arrival_s - (clock() - t0))))
                continue
            events = backend.step()
            stepped = True
            t = clock() - t0
            for ev in events:
                if ev.kind is EventKind.ROUND:
                    for rid, _, _, n in ev.rows:
                        if n and rid in live:
                            live[rid].chunks.append((t, n))
                elif ev.kind is EventKind.FINISH and ev.rid in live:
                    out = live.pop(ev.rid)
                    out.tokens, out.finish_reason, out.stats = backend.result(ev.rid)
                    out.end_s = t
                    done.append(out)
                if on_event:
                    on_event(ev)
        ok = True
    finally:
        try:
            backend.close()
        except Exception:
            if ok:  # after an interrupt, a failing close must not mask the interrupt
                raise
        cut = clock() - t0
        for rid, out in live.items():  # interrupted: keep what they produced
            out.end_s = cut
            reason = None
            try:  # the engine's record says "cancelled", or how it ended if that was this very round
                out.tokens, reason, out.stats = backend.result(rid)
            except Exception:  # noqa: BLE001 - a baseline keeps no record of a cut-off request
                pass
            out.finish_reason = reason or FinishReason.CANCELLED
            done.append(out)
    return done

