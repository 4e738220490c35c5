"""Soak (issue 5 item 6): many requests through one engine thread with random arrivals, lengths,
seeds, temperatures and cancellations while the width cap is flipped live (workload in
`soak_workload`); afterwards every stream is checked against the same request decoded alone
without speculation, and MLX active memory at the end is compared with the start.

The oracle: a finished stream must equal its reference (tie-aware, `gmlx.engine.oracle.compare_streams`:
a divergence is forgiven only where the target's top-2 margin is below 1e-3), with the same
finish reason and text; a cancelled stream must be a prefix of it. Any mismatch is an engine
bug, reported with everything needed to replay the request alone.

Kept in tests/ so that `benchmarks/soak.py` (the full run and its report, with tests/ on its
path) and `tests/test_soak.py` (a shortened run) drive exactly the same code.
"""

from __future__ import annotations

import collections
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import gmlx  # noqa: F401  (OpenBLAS before mlx: benchmarks import this module too)
import mlx.core as mx
import numpy as np

from gmlx.policy import user_config
from gmlx.config import EngineConfig, SamplingParams, Switches
from gmlx.data import load_prompts
from gmlx.engine import Engine
from gmlx.engine.memory import memory_now
from gmlx.engine.metrics import Event, EventKind
from gmlx.finish import FinishReason
from gmlx.models.loading import LoadedModel, default_model_path
from gmlx.switches import CONFIG, WIDTH_CAP
from soak_workload import (FULL, QUICK, Outcome, Profile, make_schedule, run, set_cap,
                                use_private_config)
from gmlx.policy.admission import allows
from gmlx.engine.oracle import compare_streams, run_scalar

__all__ = ["FULL", "QUICK", "Profile", "soak", "check"]


@dataclass
class Watch:
    """The engine's own account of the run, collected by a listener in the engine thread."""

    rounds: collections.Counter = field(default_factory=collections.Counter)  # by round kind
    transitions: collections.Counter = field(default_factory=collections.Counter)
    rounds_by_cap: collections.Counter = field(default_factory=collections.Counter)  # cap in force
    cap_violations: list = field(default_factory=list)  # speculative rounds wider than the cap
    active_peak: int = 0  # sampled after every step

    def listener(self, eng: Engine):
        def on(ev: Event) -> None:
            # Runs in the engine thread inside step(), so the cap in force is this round's decision.
            self.active_peak = max(self.active_peak, mx.get_active_memory())
            if ev.kind is EventKind.ROUND:
                self.rounds[ev.round] += 1
                cap = eng.cap_in_force.cap
                self.rounds_by_cap["off" if cap is None else str(cap)] += 1
                if ev.round == "speculative" and not allows(cap, ev.width):
                    self.cap_violations.append({"cap": cap, "width": ev.width})
            elif ev.kind is EventKind.TRANSITION:
                self.transitions[ev.transition] += 1
        return on


def _describe(o: Outcome, kind: str, **extra) -> dict:
    it, rec = o.item, o.record
    return {"kind": kind, "index": it.index, "request_id": rec.request_id if rec else None,
            "prompt": it.prompt, "prompt_tokens": rec.prompt_tokens if rec else None,
            "params": asdict(it.params), "cancel": it.cancel, "cancel_at": it.cancel_at,
            "finish_reason": rec.finish_reason if rec else None, "got": rec.tokens if rec else None,
            "error": (rec.error if rec else None) or o.client_error, **extra}


def check(lm: LoadedModel, outcomes: list[Outcome]) -> dict:
    """Counts (completed, cancelled, errored, client errors), mismatches with their requests,
    and the forgiven ties."""
    counts: collections.Counter = collections.Counter()
    mismatches, ties = [], []
    refs: dict = {}
    for o in outcomes:
        rec = o.record
        if rec is None:
            counts["client_error"] += 1
            mismatches.append(_describe(o, "no final record"))
            continue
        if rec.finish_reason == FinishReason.ERROR or rec.error:
            counts["errored"] += 1
            mismatches.append(_describe(o, "engine error"))
            continue
        cancelled = rec.finish_reason == FinishReason.CANCELLED
        counts["cancelled" if cancelled else "completed"] += 1
        counts["cancel_sent"] += o.cancel_sent
        if o.tokens != rec.tokens:
            mismatches.append(_describe(o, "streamed tokens differ from the final record", streamed=o.tokens))
            continue
        if cancelled and not o.cancel_sent:
            mismatches.append(_describe(o, "cancelled without a cancel"))
            continue
        got = rec.tokens
        if cancelled and not got:
            counts["cancelled_before_first_token"] += 1
            continue  # the empty stream is a prefix of any reference
        # A cancelled stream is checked against the reference cut to its length: the noise is
        # keyed by position, so a shorter budget decodes the same prefix.
        params = replace(o.item.params, max_tokens=len(got)) if cancelled else o.item.params
        key = (tuple(rec.prompt_tokens), params)
        if key not in refs:
            refs[key] = run_scalar(lm, rec.prompt_tokens, params, speculative=False)
        ref = refs[key]
        counts["compared"] += 1  # streams checked token by token (the denominator of the tie rate)
        counts["compared_tokens"] += len(got)
        c = compare_streams(lm, rec.prompt_tokens, ref.tokens, got, params)
        if c.tie:
            ties.append({"index": o.item.index, "position": c.position, "margin": c.margin})
        elif not c.equal:
            mismatches.append(_describe(o, "tokens", reference=ref.tokens, position=c.position, margin=c.margin))
        elif not cancelled and rec.finish_reason != ref.finish_reason:
            mismatches.append(_describe(o, "finish reason", reference_finish=ref.finish_reason))
        elif not cancelled and (rec.text != ref.text or o.text != rec.text):
            mismatches.append(_describe(o, "text", text=rec.text, streamed_text=o.text, reference_text=ref.text))
        elif cancelled and not rec.text.startswith(o.text):
            mismatches.append(_describe(o, "streamed text not a prefix", text=rec.text, streamed_text=o.text))
    return {"counts": dict(counts), "mismatches": mismatches, "ties": ties, "references": len(refs)}


def soak(lm: LoadedModel, profile: Profile, seed: int, config_path: str | Path, *, mem_tolerance: float = 0.05) -> dict:
    """The whole soak: a private user config, an engine on its own thread, a warm-up, memory at
    start, the run, memory at the end, then the oracle. GMLX_CONFIG and GMLX_MTP_WIDTH_CAP are
    restored afterwards. Returns the report (its "failures" is empty when the soak passed)."""
    saved = [(s, s.raw()) for s in (CONFIG, WIDTH_CAP)]
    sched_rng, flip_rng = np.random.default_rng(seed).spawn(2)
    texts = load_prompts()
    tokens = [list(lm.tokenizer.encode(t)) for t in texts]
    try:
        use_private_config(config_path, user_config.model_key(None if lm.path == default_model_path() else lm.path))
        set_cap("4")  # the model's default, to start from
        eng = Engine(lm, EngineConfig(width_cap=None), switches=Switches(preempt=True, resume=True))
        try:
            # Warm-up: one request alone and a small batch, so allocator pools and lazily built
            # state exist before the start measurement.
            eng.generate(tokens[0], SamplingParams(max_tokens=8, seed=0))
            for s in [eng.submit(t, SamplingParams(max_tokens=8, seed=1)) for t in tokens[1:4]]:
                s.wait(120)
            mem_start = memory_now(eng)
            mx.reset_peak_memory()
            before = eng.counters.snapshot()
            watch = Watch()
            eng.listeners.append(watch.listener(eng))
            items = make_schedule(texts, tokens, profile, sched_rng)
            res = run(eng, items, profile, flip_rng)
            mem_end = memory_now(eng) if res["hung"] is None else None
            peak = mx.get_peak_memory()
            after = eng.counters.snapshot()
        finally:
            eng.close()
    finally:
        for s, v in saved:
            s.put(v)
    t0 = time.perf_counter()
    verdict = check(lm, res["outcomes"])
    counters = {k: after[k] - before[k] for k in after}
    memory = {"start": mem_start, "end": mem_end, "peak": peak, "peak_sampled_active": watch.active_peak,
              "end_over_start": mem_end["active"] / mem_start["active"] if mem_end else None}
    failures = [f"{len(verdict['mismatches'])} mismatches"] if verdict["mismatches"] else []
    failures += [f"hung: {res['hung']}"] if res["hung"] else []
    failures += [f"{len(watch.cap_violations)} speculative rounds over the cap"] if watch.cap_violations else []
    counted = {k[len("transition_"):]: v for k, v in counters.items() if k.startswith("transition_")}
    if any(watch.transitions.get(k, 0) != v for k, v in counted.items()):
        # A counter bumped without its event reaching the listeners: a step raised half-way.
        failures.append(f"transition counters {counted} disagree with the events {dict(watch.transitions)}")
    if mem_end and mem_end["active"] > mem_start["active"] * (1 + mem_tolerance):
        failures.append(f"end active memory {mem_end['active']} > start {mem_start['active']} * {1 + mem_tolerance}")
    return {"seed": seed, "profile": asdict(profile), "requests": len(items), **verdict["counts"],
            "mismatches": len(verdict["mismatches"]), "ties": len(verdict["ties"]),
            "ties_per_compared_stream": len(verdict["ties"]) / max(1, verdict["counts"].get("compared", 0)),
            "references": verdict["references"], "cap_flips": res["flips"], "flip_values": res["flip_values"],
            "transitions": {"counters": counted, "events": dict(watch.transitions)},
            "rounds": dict(watch.rounds), "rounds_by_cap": dict(watch.rounds_by_cap),
            "cap_violations": watch.cap_violations, "tokens": counters["tokens"], "drafted": counters["drafted"],
            "accepted": counters["accepted"], "wall_s": res["wall_s"],
            "tokens_per_s": counters["tokens"] / res["wall_s"],
            "check_s": time.perf_counter() - t0, "memory": memory, "mem_tolerance": mem_tolerance,
            "failures": failures, "mismatch_details": verdict["mismatches"], "tie_details": verdict["ties"]}
