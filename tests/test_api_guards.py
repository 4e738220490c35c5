"""The engine's edges: bad input is refused at submit() before any state changes, a full queue
refuses with Overloaded without disturbing admitted requests, and close() ends everything
cleanly. Waits are bounded (WAIT) so a regression fails instead of hanging."""

import dataclasses
import math
import threading

import pytest

from engine_helpers import active_memory, drive, engine, matches_solo, P, solo
from gmlx import Engine, GmlxError, SamplingParams
from gmlx.errors import EngineBusy, EngineClosed, InvalidRequest, Overloaded
from gmlx.engine.metrics import EventKind
from gmlx.policy.admission import Mode
from numerics import same_stream

WAIT = 60
MEMORY_SLACK = 64 << 10


LM_WITHOUT_EOS = True  # budgets (and cancels) alone end these requests: see conftest.lm



def untouched(eng):
    assert not eng.service.queued and not eng.service.open_streams and eng.service.thread is None and eng.mode is Mode.IDLE


# ---- bad input ---------------------------------------------------------------------------------
BAD_PARAMS = [
    ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", 2.5), ("max_tokens", True), ("max_tokens", "8"),
    ("temperature", -0.1), ("temperature", math.nan), ("temperature", math.inf), ("temperature", "0.5"),
    ("temperature", None), ("top_p", 0.0), ("top_p", 1.5), ("top_p", math.nan), ("top_p", "x"),
    ("top_k", -1), ("top_k", 2.0), ("top_k", True), ("min_p", -0.1), ("min_p", 1.5), ("min_p", math.nan),
    ("seed", -1), ("seed", 1.5), ("seed", "7"), ("stop", ("",)), ("stop", 5), ("stop", ("ok", 3)),
    ("ignore_eos", "yes"), ("stop_fn", "not callable"), ("stop_fn", 5),
]


def test_every_invalid_sampling_field_is_refused_before_any_state_changes(lm, prompts):
    eng = Engine(lm)
    for name, value in BAD_PARAMS:
        with pytest.raises(InvalidRequest, match=name):  # InvalidRequest is a GmlxError
            eng.submit(prompts[0], SamplingParams(**{name: value}))
        untouched(eng)
    with pytest.raises(InvalidRequest, match="SamplingParams"):
        eng.submit(prompts[0], {"max_tokens": 4})
    untouched(eng)
    assert issubclass(InvalidRequest, GmlxError)
    first = eng.submit(prompts[0], P(4), start=False)
    assert first.request_id == 0  # no id was consumed by the refusals
    eng.close()


def test_bad_prompts_are_refused(lm):
    eng = Engine(lm)
    ctx, vocab = lm.context_length, lm.target.vocab_size
    cases = [("", "empty"), ([], "empty"), ([5, vocab], "outside the vocabulary"), ([-1, 5], "outside the vocabulary"),
             ([5, 1.5], "integers"), ([5, True], "integers"), (None, "string or a list"), (7, "string or a list"),
             ([5] * ctx, f"context is {ctx}")]
    for prompt, message in cases:
        with pytest.raises(InvalidRequest, match=message):
            eng.submit(prompt, P(4))
        untouched(eng)
    eng.close()


def test_max_tokens_past_the_context_is_an_error_that_names_the_largest_that_fits(lm):
    ctx = lm.context_length
    prompt = [5, 6, 7] * ((ctx - 20) // 3)
    fits = ctx - len(prompt)
    eng = engine(lm, 0)
    with pytest.raises(InvalidRequest, match=f"lower max_tokens to at most {fits}$"):
        eng.submit(prompt, P(fits + 1))
    untouched(eng)
    run = drive(eng, {0: [("edge", prompt, P(fits))]})  # exactly the context: served in full
    assert len(run.streams["edge"].wait(WAIT).tokens) == fits
    eng.close()


# ---- overload ----------------------------------------------------------------------------------
def test_a_full_queue_refuses_and_loses_nothing(lm, prompts):
    eng = engine(lm, 0, max_queued=3)
    reqs = [(prompts[1 + i], P(8 + i, i)) for i in range(3)]
    streams = [eng.submit(p, sp, start=False) for p, sp in reqs]
    with pytest.raises(Overloaded, match="max_queued=3"):
        eng.submit(prompts[4], P(4))
    assert issubclass(Overloaded, GmlxError) and eng.service.queued == 3 and eng.service.thread is None
    while eng.has_work:
        eng.step()
    for s, (p, sp) in zip(streams, reqs):
        matches_solo(lm, p, sp, s.wait(WAIT).tokens)
    assert eng.submit(prompts[4], P(4), start=False).request_id == 3  # the refusal took no id
    eng.close()


def test_overload_with_the_engine_thread(lm, prompts):
    """The engine thread is held in a listener while the queue fills: submits past the bound are
    refused (from several threads), the admitted ones are all served, equal to their solo streams."""
    eng = engine(lm, 0, max_queued=2)
    entered, release = threading.Event(), threading.Event()

    def hold(ev):
        if ev.kind is EventKind.ROUND and not entered.is_set():
            entered.set()
            release.wait(WAIT)

    eng.listeners.append(hold)
    reqs = {k: (prompts[5 + i], P(10, i, 0.8 * (i % 2))) for i, k in enumerate("abc")}
    streams = {"a": eng.submit(*reqs["a"])}
    assert entered.wait(WAIT)
    streams.update({k: eng.submit(*reqs[k]) for k in "bc"})
    refused = []

    def flood(i):
        try:
            eng.submit(prompts[10 + i], P(4, i))
        except Overloaded as e:
            refused.append(e)

    threads = [threading.Thread(target=flood, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    assert len(refused) == 4
    release.set()
    for k, (p, sp) in reqs.items():
        matches_solo(lm, p, sp, streams[k].wait(WAIT).tokens)
    assert eng.submit(prompts[9], P(4, 9)).wait(WAIT).finish_reason == "length"  # drained: accepted again
    eng.close()


# ---- close -------------------------------------------------------------------------------------

def check_closed(eng, streams, reqs):
    """Every stream ended "cancelled" with a final record whose tokens were all streamed and are a
    prefix of its solo stream; the engine holds no row; using it raises EngineClosed."""
    for label, s in streams.items():
        rec = s.wait(WAIT)
        assert rec.finish_reason == "cancelled", label
        assert [p.token for p in s if p.token >= 0] == rec.tokens  # iteration ends: the end marker is there
        prompt, sp = reqs[label]  # a stream does not depend on its budget: compare with a short solo
        short = dataclasses.replace(sp, max_tokens=max(1, len(rec.tokens)))
        same_stream(eng.lm, prompt, solo(eng.lm, prompt, short)[: len(rec.tokens)], rec.tokens, short)
    assert eng.scalar.seq is None and eng.batch.rows == [] and eng.batch.cache == [] and not eng.service.queued
    assert eng.mode is Mode.IDLE and not eng.service.open_streams
    with pytest.raises(EngineClosed):
        eng.submit([5, 6, 7], P(4))
    with pytest.raises(EngineClosed):
        eng.generate([5, 6, 7], P(4))
    with pytest.raises(EngineClosed, match="closed"):
        eng.step()
    eng.close()  # a second close is harmless


@pytest.mark.parametrize("where", ["scalar+queued", "batched", "gated"])
def test_close_ends_live_and_queued_streams_and_frees_memory(lm, prompts, where):
    reqs = {"a": (prompts[11], P(40)), "b": (prompts[12], P(40, 1, 0.8)), "c": (prompts[13], P(40, 2))}
    for r in reqs.values():
        solo(lm, *r)
    eng = engine(lm, 1 if where == "gated" else 0, preempt=where != "scalar+queued", prompt_cache_bytes=0)
    baseline = active_memory()
    streams = {"a": eng.submit(*reqs["a"], start=False)}
    if where != "scalar+queued":
        streams.update({k: eng.submit(*reqs[k], start=False) for k in "bc"})
    for _ in range(2):
        eng.step()
    streams.update({k: eng.submit(*reqs[k], start=False) for k in "bc" if k not in streams})
    for _ in range(3):
        eng.step()
    expected = {"scalar+queued": (Mode.SCALAR, 2), "batched": (Mode.BATCHED, 0), "gated": (Mode.GATED, 0)}[where]
    assert (eng.mode, eng.service.queued) == expected
    eng.close()
    check_closed(eng, streams, reqs)
    assert streams["a"].result.tokens  # it was mid-stream
    assert active_memory() - baseline <= MEMORY_SLACK


def _long_requests(prompts):
    return {k: (prompts[14 + i], P(300, i, 0.8 * (i % 2))) for i, k in enumerate("abc")}


def test_close_with_the_engine_thread_joins_it(lm, prompts):
    eng = engine(lm, 0)
    reqs = _long_requests(prompts)
    progressed, closing = threading.Event(), threading.Event()

    def hold_until_closing(ev):  # mid-stream when close() comes, however the threads are scheduled
        if ev.kind is EventKind.ROUND and eng.counters.rounds == 3:
            progressed.set()
            closing.wait(WAIT)

    eng.listeners.append(hold_until_closing)
    streams = {k: eng.submit(*r) for k, r in reqs.items()}
    assert progressed.wait(WAIT)
    closing.set()
    closer = threading.Thread(target=eng.close)
    closer.start()
    closer.join(WAIT)
    assert not closer.is_alive() and not eng.service.thread.is_alive()
    check_closed(eng, streams, reqs)


def test_close_from_a_listener_does_not_deadlock(lm, prompts):
    """close() on the engine thread (from a listener) cannot join itself: it ends the streams and
    the thread leaves after this step."""
    eng = engine(lm, 0)
    reqs = _long_requests(prompts)

    def close_after_three_rounds(ev):
        if ev.kind is EventKind.ROUND and eng.counters.rounds == 3:
            eng.close()

    eng.listeners.append(close_after_three_rounds)
    streams = {k: eng.submit(*r) for k, r in reqs.items()}
    for s in streams.values():
        s.wait(WAIT)
    eng.service.thread.join(WAIT)
    assert not eng.service.thread.is_alive()
    check_closed(eng, streams, reqs)


def test_close_drops_the_prompt_cache(lm, prompts):
    eng = engine(lm, 0)
    drive(eng, {0: [("a", prompts[17], P(6))]})
    assert len(eng.prompt_cache) == 1 and eng.prompt_cache.nbytes > 0
    eng.close()
    assert len(eng.prompt_cache) == 0 and eng.prompt_cache.nbytes == 0


def test_generate_on_the_engine_thread_is_refused(lm, prompts):
    """generate() from a listener or stop_fn would wait for the thread it blocks: refused up front
    (simulated here by calling it as the engine thread, so a regression cannot hang the suite)."""
    eng = engine(lm, 0)
    eng.service.thread = threading.current_thread()
    with pytest.raises(EngineBusy, match="wait on itself"):
        eng.generate(prompts[18], P(4))
    eng.service.thread = None
    untouched(eng)
    eng.close()
