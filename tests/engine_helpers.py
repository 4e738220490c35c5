"""Helpers for the engine tests: drive `Engine.step()` deterministically on a schedule, record
the per-round events in order, and compare every stream with its solo plain reference."""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import Callable

from gmlx import Engine, EngineConfig, SamplingParams
from gmlx.config import Switches
from gmlx.engine.metrics import Event, EventKind
from gmlx.engine.oracle import run_scalar
from numerics import compare_tokens, same_stream

import mlx.core as mx  # after gmlx: it loads OpenBLAS first

_SOLO: dict = {}


def P(n, seed=0, t=0.0, **kw) -> SamplingParams:
    """Sampling params for engine tests: n tokens, a concrete seed, greedy or T = t with top-p 0.95."""
    return SamplingParams(max_tokens=n, temperature=t, top_p=0.95 if t else 1.0, seed=seed, **kw)


def active_memory() -> int:
    """MLX's active memory after freeing what Python and MLX's cache still hold."""
    gc.collect()
    mx.clear_cache()
    return mx.get_active_memory()


def solo(lm, prompt, params: SamplingParams) -> list[int]:
    """The solo plain stream (the oracle), cached by (prompt, params) for the whole session."""
    assert params.seed is not None, "give every request a concrete seed so the reference is reproducible"
    key = (tuple(prompt), params, frozenset(lm.eos_ids))
    if key not in _SOLO:
        _SOLO[key] = run_scalar(lm, list(prompt), params, speculative=False).tokens
    return _SOLO[key]


def matches_solo(lm, prompt, params: SamplingParams, got: list[int]):
    """Assert `got` is the solo plain stream, tie-aware (see tests/numerics.py)."""
    return same_stream(lm, prompt, solo(lm, prompt, params), got, params)


def with_eos(lm, eos_ids):
    """The same loaded model with other end-of-sequence ids (to stop streams at chosen tokens)."""
    import copy

    out = copy.copy(lm)
    out.__class__ = type("EosModel", (type(lm),), {"eos_ids": property(lambda self: set(eos_ids))})
    return out


def speculates(lm) -> bool:
    """Whether an engine on this model speculates by default (the engine's own drafter choice)."""
    from gmlx.drafters.select import choose

    return choose(lm, EngineConfig()).drafter is not None


def waiting(eng: Engine, rid: int) -> bool:
    """Whether request `rid` waits in the queue between steps: its stream is open and no lane
    holds it."""
    return eng.service.stream(rid) is not None and all(r.rid != rid for r in eng.live_rows())


def engine(lm, cap: int | None, *, preempt: bool = True, resume: bool = True, peers=None, **config) -> Engine:
    return Engine(lm, EngineConfig(width_cap=cap, **config), switches=Switches(preempt=preempt, resume=resume),
                  peers=peers)


@dataclass
class Req:
    prompt: list[int]
    params: SamplingParams


@dataclass
class Run:
    eng: Engine
    streams: dict = field(default_factory=dict)  # label -> Stream
    reqs: dict = field(default_factory=dict)  # label -> Req
    steps: list = field(default_factory=list)  # per step: list[Event]
    step_no: int = 0

    def submit(self, label, prompt, params):
        self.reqs[label] = Req(list(prompt), params)
        self.streams[label] = self.eng.submit(list(prompt), params, start=False)
        return self.streams[label]

    def rid(self, label) -> int:
        return self.streams[label].request_id

    def step(self) -> list[Event]:
        evs = self.eng.step()
        self.steps.append(evs)
        self.step_no += 1
        return evs

    # ---- views over the recorded events ----------------------------------------------
    def events(self):
        """(step index, event) in emission order."""
        return [(i, e) for i, evs in enumerate(self.steps) for e in evs]

    def rounds(self):
        return [(i, e) for i, e in self.events() if e.kind is EventKind.ROUND]

    def transitions(self) -> list[str]:
        return [e.transition for _, e in self.events() if e.kind is EventKind.TRANSITION]

    def emissions(self):
        """Global order of emissions: (round ordinal, step, rid, emitted, round kind)."""
        out = []
        for n, (i, e) in enumerate(self.rounds()):
            for rid, _drafted, _accepted, emitted in e.rows:
                if emitted:
                    out.append((n, i, rid, emitted, e.round))
        return out

    def rounds_of(self, label):
        """(round ordinal, step, round kind, width, drafted, emitted) of every round the request ran in."""
        rid = self.rid(label)
        out = []
        for n, (i, e) in enumerate(self.rounds()):
            for r, drafted, _accepted, emitted in e.rows:
                if r == rid:
                    out.append((n, i, e.round, e.width, drafted, emitted))
        return out

    def first_emission(self, label) -> int:
        return min(n for n, _, r, _, _ in self.emissions() if r == self.rid(label))

    def last_emission(self, label) -> int:
        return max(n for n, _, r, _, _ in self.emissions() if r == self.rid(label))

    def finish_step(self, label) -> int:
        rid = self.rid(label)
        return next(i for i, e in self.events() if e.kind is EventKind.FINISH and e.rid == rid)


def drive(eng: Engine, arrivals: dict[int, list[tuple]], *, before_step: Callable | None = None,
          max_steps: int = 3000) -> Run:
    """Submit arrivals[step] = [(label, prompt, params), ...] before that step, then step until idle."""
    run = Run(eng)
    last_arrival = max(arrivals, default=0)
    while run.step_no < max_steps:
        for label, prompt, params in arrivals.get(run.step_no, []):
            run.submit(label, prompt, params)
        if before_step is not None:
            before_step(run)
        if run.step_no > last_arrival and not eng.has_work:
            break
        run.step()
    else:
        raise AssertionError(f"the engine still had work after {max_steps} steps")
    assert not eng.has_work
    return run


def check_solo(lm, run: Run, labels=None, *, cancelled_prefix: bool = False) -> int:
    """Every finished request equals its solo plain stream (tie-aware). Returns the tie count."""
    ties = 0
    for label in labels if labels is not None else run.streams:
        stream = run.streams[label]
        assert stream.done, f"request {label!r} never finished (lost by the engine?)"
        req, rec = run.reqs[label], stream.result
        ref = solo(lm, req.prompt, req.params)
        got = rec.tokens
        if rec.finish_reason == "cancelled" and cancelled_prefix:
            ref = ref[: len(got)]
        else:
            assert rec.finish_reason in ("length", "stop"), (label, rec.finish_reason, rec.error)
        c = compare_tokens(lm, req.prompt, ref, got, req.params)
        assert c.ok, f"request {label!r} diverged from its solo stream: {c}\nsolo {ref}\ngot  {got}"
        if c.tie:
            ties += 1
            continue
        assert len(got) <= req.params.max_tokens
    return ties


def total_emitted(run: Run, label) -> int:
    return sum(n for _, _, r, n, _ in run.emissions() if r == run.rid(label))
