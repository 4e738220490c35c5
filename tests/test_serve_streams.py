"""Concurrent clients over HTTP while the engine moves between its loops, and clients that go away.

With the cap at 2, a lone streaming request runs in the scalar loop; three waiters arriving while
it decodes preempt it into the batch loop, which is wider than the cap and gates; when the short
waiters finish, the long request is alone again and the batch resumes through a capture round.
Every stream, greedy or seeded, must equal its solo plain decode (tie-aware), and the transitions
are read from /metrics, as an operator would."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from engine_helpers import solo
from serve_helpers import TIMEOUT, params, prompt_ids, serving

from gmlx.engine.oracle import compare_streams

LM_WITHOUT_EOS = True
LONG = "import os\nimport sys\n\n\ndef main():\n"
WAITERS = ["def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n", "for i in range(10):\n"]
TRANSITIONS = ("preempt", "gate", "resume", "capture")


@pytest.fixture(scope="module")
def srv(lm):
    with serving(lm, width_cap=2) as s:
        yield s


def transitions(srv) -> dict[str, float]:
    return {t: srv.metric("gmlx:transitions_total", transition=t) for t in TRANSITIONS}


def args(prompt, p) -> dict:
    return dict(model="gmlx-default", prompt=prompt, max_tokens=p.max_tokens, temperature=p.temperature,
                top_p=p.top_p, seed=p.seed, extra_body={"return_token_ids": True})


async def stream_ids(client, prompt, p, first: asyncio.Event | None = None) -> tuple[list[int], str]:
    ids, finish = [], None
    async for c in await client.completions.create(stream=True, **args(prompt, p)):
        ids += c.choices[0].model_extra["token_ids"]
        finish = c.choices[0].finish_reason or finish
        if first is not None and ids:
            first.set()
    return ids, finish


async def plain_ids(client, prompt, p) -> tuple[list[int], str]:
    r = await client.completions.create(**args(prompt, p))
    return r.choices[0].model_extra["token_ids"], r.choices[0].finish_reason


def test_concurrent_streams_equal_solo_through_preempt_gate_and_resume(srv, lm):
    before = transitions(srv)
    long_p = params(128)
    waiter_ps = [params(8), params(12, 0.8, seed=5, top_p=0.95), params(16, 1.0, seed=9)]

    async def main():
        async with srv.aclient() as client:
            first = asyncio.Event()
            long_task = asyncio.create_task(stream_ids(client, LONG, long_p, first))
            await asyncio.wait_for(first.wait(), TIMEOUT)  # the long request is decoding alone: scalar
            waiters = [stream_ids(client, WAITERS[0], waiter_ps[0]), plain_ids(client, WAITERS[1], waiter_ps[1]),
                       stream_ids(client, WAITERS[2], waiter_ps[2])]
            return await asyncio.gather(long_task, *waiters)

    results = asyncio.run(asyncio.wait_for(main(), 2 * TIMEOUT))
    srv.wait_idle()
    after = transitions(srv)
    for t in TRANSITIONS:
        assert after[t] > before[t], f"no {t} transition: before {before}, after {after}"
    for prompt, p, (got, finish) in zip([LONG, *WAITERS], [long_p, *waiter_ps], results):
        assert finish == "length" and len(got) == p.max_tokens
        ids = prompt_ids(lm, prompt)
        ref = solo(lm, ids, p)
        c = compare_streams(lm, ids, ref, got, p)
        assert c.ok, f"{prompt!r} {p}: diverged from its solo plain stream: {c}\nsolo {ref}\ngot  {got}"


def test_a_client_that_disconnects_mid_stream_frees_its_row(srv):
    eng = srv.engine
    srv.wait_idle()
    cancelled = srv.metric("gmlx:request_success_total", finished_reason="cancelled")
    tokens = eng.counters.tokens
    stream = srv.client().completions.create(model=srv.model, prompt=LONG, max_tokens=800, temperature=0,
                                             stream=True)
    it = iter(stream)
    next(it), next(it)
    assert srv.metric("gmlx:num_requests_running") == 1 and len(eng.live_rows()) == 1
    stream.close()
    wait_for(lambda: srv.metric("gmlx:num_requests_running") == 0 and not eng.live_rows())
    assert srv.metric("gmlx:request_success_total", finished_reason="cancelled") == cancelled + 1
    assert eng.counters.tokens - tokens < 800, "the row ran to its budget after the client left"
    assert eng.service.open_streams == 0


def test_a_client_that_gives_up_on_a_plain_request_frees_its_row(srv):
    """Non-streaming: the server notices the closed connection while it waits for the result."""
    eng = srv.engine
    srv.wait_idle()
    cancelled = srv.metric("gmlx:request_success_total", finished_reason="cancelled")
    tokens = eng.counters.tokens
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url + "/v1/completions", json={"prompt": LONG, "max_tokens": 800, "temperature": 0},
                   timeout=httpx.Timeout(TIMEOUT, read=0.3))
    wait_for(lambda: srv.metric("gmlx:num_requests_running") == 0 and not eng.live_rows())
    assert srv.metric("gmlx:request_success_total", finished_reason="cancelled") == cancelled + 1
    assert eng.counters.tokens - tokens < 800


def wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"not within {timeout} s"
        time.sleep(0.02)
