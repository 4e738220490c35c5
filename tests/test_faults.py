"""Fault isolation: an exception or a non-finite value while serving one request finishes that
request with finish reason "error" and a message; every other stream equals its solo plain
stream; the engine keeps serving (submit and generate after the fault work), in the caller's
thread and in the engine thread (bounded waits: nothing here can hang).

Non-finite logits come from `tests/doubles.py's PoisonedTarget` (NaN logits at every position whose
input token is the poison), so a request whose prompt ends with the poison faults at its first
decode step; the poison is picked so that no other request's stream or prompt contains it.
"""

import dataclasses
import threading

import pytest

from engine_helpers import check_solo, drive, engine, matches_solo, P, solo
from gmlx.engine.metrics import EventKind
from doubles import poisoned
from numerics import same_stream

WAIT = 60  # seconds; a bound, never a timing assertion


LM_WITHOUT_EOS = True  # budgets (and cancels) alone end these requests: see conftest.lm



def pick_poison(lm, healthy) -> int:
    """The highest token id in no healthy request's prompt or solo stream."""
    used = set()
    for prompt, sp in healthy:
        used |= set(prompt) | set(solo(lm, prompt, sp))
    return max(set(range(lm.target.vocab_size)) - used)


def check_fault(rec, position):
    assert rec.finish_reason == "error" and rec.tokens == []
    assert rec.error == f"non-finite logits at position {position}"


# ---- the sampler's FAULT ------------------------------------------------------------------------
@pytest.mark.parametrize("t", [0.0, 0.8])
def test_sample_marks_unusable_positions_only(t):
    """NaN, +inf or all -inf logits at a position give FAULT there; -inf entries alone are masked
    tokens, not a fault; every other position and row samples as before."""
    import mlx.core as mx
    import numpy as np

    from gmlx.sampling import FAULT, RowSampling, sample

    v = 8
    clean = np.tile(np.linspace(1.0, -1.0, v, dtype=np.float32), (2, 5, 1))  # [B=2, L=5, V]
    bad = clean.copy()
    bad[0, 1, 3] = np.nan
    bad[0, 2, 5] = np.inf
    bad[0, 3, :] = -np.inf
    bad[1, 4, :4] = -np.inf  # masked entries: still usable
    rs = RowSampling.from_params([P(4, 1, t).validated(), P(4, 2, t).validated()], [1, 2])
    pos = mx.array(np.arange(5, dtype=np.int32)[None].repeat(2, 0))
    ref = np.array(sample(mx.array(clean), rs, pos))
    got = np.array(sample(mx.array(bad), rs, pos))
    faults = np.zeros((2, 5), dtype=bool)
    faults[0, 1:4] = True
    assert (got == FAULT).tolist() == faults.tolist()
    assert (got[~faults] >= 0).all() and got[0, 0] == ref[0, 0] and (got[1, :4] == ref[1, :4]).all()
    assert got[1, 4] >= 4  # sampled among the unmasked tokens


# ---- non-finite logits: scalar loop (speculative and plain), armed batch, gated batch ----------
@pytest.mark.parametrize("where", ["scalar", "scalar-plain", "armed", "gated"])
def test_nan_logits_end_only_their_request(lm, prompts, where):
    healthy = {"b": (prompts[1], P(14, 1, 0.8)), "c": (prompts[2], P(12, 2))}
    poison = pick_poison(lm, healthy.values())
    bad = prompts[0] + [poison]
    plm = poisoned(lm, poison)
    if where.startswith("scalar"):  # the faulted request runs alone; the others wait behind it
        eng = engine(plm, 0, preempt=False, speculative=where == "scalar")
        arrivals = {0: [("x", bad, P(16, 3))], 1: [(k, *v) for k, v in healthy.items()]}
    else:
        eng = engine(plm, 0 if where == "armed" else 1)
        arrivals = {0: [("b", *healthy["b"]), ("x", bad, P(16, 3)), ("c", *healthy["c"])]}
    run = drive(eng, arrivals)
    check_fault(run.streams["x"].wait(WAIT), len(bad))
    check_solo(lm, run, ["b", "c"])
    kinds = {kind for _, _, kind, *_ in run.rounds_of("x")}
    assert kinds == {"scalar" if where.startswith("scalar") else ("speculative" if where == "armed" else "plain")}
    matches_solo(lm, prompts[3], P(6, 4), eng.generate(prompts[3], P(6, 4)).tokens)  # still serving
    eng.close()


def test_nan_logits_with_the_engine_thread(lm, prompts):
    healthy = {"b": (prompts[4], P(12, 1)), "c": (prompts[5], P(10, 2, 0.8))}
    poison = pick_poison(lm, healthy.values())
    bad = prompts[6] + [poison]
    eng = engine(poisoned(lm, poison), 0)
    streams = {k: eng.submit(p, sp) for k, (p, sp) in healthy.items()}
    x = eng.submit(bad, P(12, 3))
    check_fault(x.wait(WAIT), len(bad))
    for k, (p, sp) in healthy.items():
        matches_solo(lm, p, sp, streams[k].wait(WAIT).tokens)
    again = eng.submit(prompts[7], P(6, 4))
    matches_solo(lm, prompts[7], P(6, 4), again.wait(WAIT).tokens)
    eng.close()
    assert not eng.service.thread.is_alive()


def test_a_poisoned_draft_never_reaches_the_stream(lm, prompts):
    """A rejected draft equal to the poison makes the target's logits NaN at the position after
    it: a FAULT past the row's acceptance (in its drafter padding), which the stream never sees."""
    reqs = {"a": (prompts[19], P(24, 1)), "b": (prompts[20], P(24, 2, 0.8))}

    def run_recording_drafts(model):
        # The MTP head: it drafts tokens these streams never emit; the default assistant head
        # agrees so often that on some BLAS kernels none of its batched drafts is rejected.
        eng = engine(model, 0, drafter="mtp")
        drafter = getattr(eng.batch.drafter, "inner", eng.batch.drafter)  # under the predicted-output wrapper
        drafted, real = [], drafter.draft

        def recording(st, k, pick, target_cache):
            d = real(st, k, pick, target_cache)
            if eng.mode.value == "batched":
                drafted.extend(t for row in d.tolist() for t in row)  # sync: test-only read of the drafts
            return d
        drafter.draft = recording
        run = drive(eng, {0: [(k, *v) for k, v in reqs.items()]})
        eng.close()
        return run, drafted

    _, clean = run_recording_drafts(lm)
    used = {t for p, sp in reqs.values() for t in solo(lm, p, sp)} | {p[-1] for p, _ in reqs.values()}
    rejected = [t for t in clean if t not in used]
    assert rejected, "fixture: every draft was a token of the streams; pick other prompts"
    poison = max(set(rejected), key=rejected.count)
    run, drafted = run_recording_drafts(poisoned(lm, poison))
    assert poison in drafted  # the same drafts: the poison did reach the verify forward
    check_solo(lm, run)


# ---- a stop callback ---------------------------------------------------------------------------
def stop_at_five(tokens, text):
    return len(tokens) >= 5


def explode_at_four(tokens, text):
    if len(tokens) >= 4:
        raise RuntimeError("boom")
    return False


@pytest.mark.parametrize("cap", [0, 1])
def test_stop_fn_stops_and_a_raising_stop_fn_fails_only_its_request(lm, prompts, cap):
    assert hash(P(8, stop_fn=stop_at_five)) == hash(P(8, stop_fn=stop_at_five))  # references are cached by params
    eng = engine(lm, cap)
    run = drive(eng, {0: [("s", prompts[10], P(16, 1, stop_fn=stop_at_five)),
                          ("e", prompts[11], P(16, 2, 0.8, stop_fn=explode_at_four)),
                          ("b", prompts[12], P(12, 3))]})
    plain = {k: solo(lm, run.reqs[k].prompt, dataclasses.replace(run.reqs[k].params, stop_fn=None)) for k in "se"}
    s, e = run.streams["s"].wait(WAIT), run.streams["e"].wait(WAIT)
    assert s.finish_reason == "stop" and len(s.tokens) == 5 and s.error is None
    assert e.finish_reason == "error" and e.error == "stop_fn raised RuntimeError: boom"
    assert len(e.tokens) == 4  # the token it was called on stays emitted
    for k, rec in (("s", s), ("e", e)):
        same_stream(lm, run.reqs[k].prompt, plain[k][: len(rec.tokens)], rec.tokens, run.reqs[k].params)
    assert [p.token for p in run.streams["e"] if p.token >= 0] == e.tokens  # and was streamed
    check_solo(lm, run, ["b"])
    assert eng.generate(prompts[13], P(5, 4)).finish_reason == "length"
    eng.close()


# ---- listeners ---------------------------------------------------------------------------------
def test_a_raising_listener_is_removed_and_never_fails_a_request(lm, prompts):
    eng = engine(lm, 0)
    seen = []

    def bad(ev):
        if ev.kind is EventKind.ROUND:
            raise ValueError("listener bug")

    eng.listeners += [bad, seen.append]
    with pytest.warns(RuntimeWarning, match="listener bug"):
        run = drive(eng, {0: [("a", prompts[14], P(12)), ("b", prompts[15], P(10, 1, 0.8))]})
    check_solo(lm, run)
    assert eng.counters.listener_errors == 1 and eng.listeners == [seen.append]
    assert sum(e.kind is EventKind.FINISH for e in seen) == 2  # the healthy listener saw everything
    eng.close()


# ---- the last resort: an exception escapes a step in the engine thread -------------------------
@pytest.mark.parametrize("where", ["round", "prefill"])
def test_an_escaping_fault_fails_the_served_rows_and_the_engine_goes_on(lm, prompts, where):
    """Every row being served ends with an error, rows popped for admission included (before
    the fix they were lost and their streams waited forever); queued requests are served next."""
    eng = engine(lm, 0)
    target = (eng.batch, "speculative_round") if where == "round" else (eng.prefiller, "prefill_many")
    real, fired = getattr(*target), threading.Event()

    def broken(*args, **kwargs):
        if not fired.is_set():
            fired.set()
            raise RuntimeError("device fault")
        return real(*args, **kwargs)

    setattr(*target, broken)
    a = eng.submit(prompts[16], P(10), start=False)
    b = eng.submit(prompts[17], P(10, 1), start=False)
    eng.service.start()  # both are queued: they form a batch together
    for s in (a, b):
        rec = s.wait(WAIT)
        assert rec.finish_reason == "error" and rec.error == "RuntimeError: device fault"
    c = eng.submit(prompts[18], P(8, 2))
    matches_solo(lm, prompts[18], P(8, 2), c.wait(WAIT).tokens)
    eng.close()


def test_a_submit_racing_the_scalar_prefill_is_served(lm, prompts):
    """A request that arrives while the scalar loop prefills its first request (a submit from
    another thread) waits in the queue and is then served; before the fix start_scalar popped it
    into the batch loop while the engine was scalar, and it was lost (then failed)."""
    eng = engine(lm, 0)
    real, late = eng.prefiller.prefill, {}

    def prefill(row, want_hidden):
        if not late:
            late["s"] = eng.submit(prompts[21], P(8, 1), start=False)
        return real(row, want_hidden)

    eng.prefiller.prefill = prefill
    run = drive(eng, {0: [("a", prompts[22], P(8))]})
    check_solo(lm, run)
    matches_solo(lm, prompts[21], P(8, 1), late["s"].wait(WAIT).tokens)
    assert run.transitions()[:2] == ["start_scalar", "preempt"]  # it waited, then preempted the incumbent
    eng.close()
