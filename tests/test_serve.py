"""`gmlx serve` through the official openai client, sync and async, streaming and not, against a
real uvicorn server on a loopback port: every answer equals the same request decoded alone
without speculation (tie-aware, docs/design.md §3); usage, finish reasons, stop strings, the key,
overload, /v1/models, /health and /metrics."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import httpx
import openai
import pytest
from engine_helpers import solo
from prometheus_client.parser import text_string_to_metric_families
from serve_helpers import TIMEOUT, params, prompt_ids, serving

from gmlx.engine.oracle import compare_streams, run_scalar
from doubles import visible_window

LM_WITHOUT_EOS = True  # budgets alone end requests: the lengths below hold whatever the model emits
PROMPT = "def fibonacci(n):\n"


@pytest.fixture(scope="module")
def srv(lm):
    with serving(lm) as s:
        yield s


def kw(p, **extra) -> dict:
    """openai-client arguments for these params."""
    return dict(prompt=PROMPT, max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, seed=p.seed,
                extra_body={"return_token_ids": True}, **extra)


def check_equal_solo(lm, p, got: list[int]) -> bool:
    """Asserts tie-aware equality; True when exactly equal (then texts must match too)."""
    ids = prompt_ids(lm, PROMPT)
    ref = solo(lm, ids, p)
    c = compare_streams(lm, ids, ref, got, p)
    assert c.ok, f"diverged from the solo plain stream: {c}\nsolo {ref}\ngot  {got}"
    return c.equal


def test_web_framework_only_in_gmlx_serve():
    root = Path(__file__).resolve().parents[1]
    pattern = re.compile(r"^\s*(import|from)\s+(starlette|fastapi|uvicorn|prometheus_client)\b", re.M)
    for f in [*root.joinpath("gmlx").rglob("*.py"), *root.joinpath("gmlx_cli").rglob("*.py")]:
        if pattern.search(f.read_text()):
            assert f.relative_to(root).parts[:2] == ("gmlx", "serve"), f


@pytest.mark.parametrize("p", [params(12), params(12, 0.8, seed=7, top_p=0.95)], ids=["greedy", "seeded"])
def test_sync_client_equals_solo_plain_streaming_or_not(srv, lm, p):
    client = srv.client()
    r = client.completions.create(model=srv.model, **kw(p))
    choice = r.choices[0]
    got = choice.model_extra["token_ids"]
    assert choice.finish_reason == "length" and len(got) == p.max_tokens
    assert choice.model_extra["prompt_token_ids"] == prompt_ids(lm, PROMPT)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt_ids(lm, PROMPT)), p.max_tokens)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    if check_equal_solo(lm, p, got):
        assert choice.text == run_scalar(lm, prompt_ids(lm, PROMPT), p, speculative=False).text

    chunks = list(client.completions.create(model=srv.model, stream=True, stream_options={"include_usage": True},
                                            **kw(p)))
    *body, finish, last = chunks
    assert "".join(c.choices[0].text for c in body) == choice.text
    assert [t for c in body for t in c.choices[0].model_extra["token_ids"]] == got
    assert finish.choices[0].finish_reason == "length" and finish.choices[0].text == ""
    assert all(c.choices[0].finish_reason is None and c.usage is None for c in body)
    assert last.choices == [] and last.usage.completion_tokens == p.max_tokens


def test_async_client_concurrent_requests_equal_solo(srv, lm):
    ps = [params(10), params(14, 1.0, seed=3), params(8, 0.5, seed=11, top_p=0.9)]

    async def one(client, p, stream):
        if not stream:
            r = await client.completions.create(model=srv.model, **kw(p))
            return r.choices[0].model_extra["token_ids"], r.choices[0].finish_reason
        ids, finish = [], None
        async for c in await client.completions.create(model=srv.model, stream=True, **kw(p)):
            ids += c.choices[0].model_extra["token_ids"]
            finish = c.choices[0].finish_reason or finish
        return ids, finish

    async def main():
        async with srv.aclient() as client:
            return await asyncio.gather(*(one(client, p, s) for p in ps for s in (False, True)))

    results = asyncio.run(asyncio.wait_for(main(), TIMEOUT))
    for (got, finish), p in zip(results, [p for p in ps for _ in (0, 1)]):
        assert finish == "length"
        check_equal_solo(lm, p, got)


def test_stop_string_ends_with_stop_and_cuts_the_text(srv, lm):
    ids = prompt_ids(lm, PROMPT)
    free = run_scalar(lm, ids, params(24), speculative=False)
    p = params(24, stop=(visible_window(free.text, 8),))
    ref = run_scalar(lm, ids, p, speculative=False)
    assert ref.finish_reason == "stop"
    client = srv.client()
    r = client.completions.create(model=srv.model, stop=list(p.stop), **kw(p))
    assert (r.choices[0].finish_reason, r.choices[0].text) == ("stop", ref.text)
    chunks = list(client.completions.create(model=srv.model, stop=p.stop[0], stream=True, **kw(p)))
    assert "".join(c.choices[0].text for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_noop_fields_are_accepted(srv):
    r = srv.post("/v1/completions", json={"model": srv.model, "prompt": PROMPT, "max_tokens": 2, "n": 1, "user": "u",
                                          "frequency_penalty": 0, "presence_penalty": 0.0, "logprobs": None,
                                          "echo": False, "best_of": 1, "logit_bias": {}, "suffix": None})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_models_health_and_metrics(srv):
    assert [m.id for m in srv.client().models.list()] == [srv.model]
    h = httpx.get(srv.url + "/health", timeout=TIMEOUT)
    assert h.status_code == 200 and h.json()["status"] == "ok" and h.json()["mlx_active_memory_bytes"] > 0
    srv.client().completions.create(model=srv.model, prompt=PROMPT, max_tokens=4, temperature=0)
    text = httpx.get(srv.url + "/metrics", timeout=TIMEOUT).text
    names = {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
    for n in ("gmlx:num_requests_running", "gmlx:num_requests_waiting", "gmlx:request_success_total",
              "gmlx:time_to_first_token_seconds_bucket", "gmlx:inter_token_latency_seconds_bucket",
              "gmlx:spec_decode_num_draft_tokens_total", "gmlx:spec_decode_num_accepted_tokens_total",
              "gmlx:spec_decode_num_drafts_total", "gmlx:transitions_total", "gmlx:speculative_width_cap"):
        assert n in names, n
    assert "_created" not in text  # prometheus_client's creation-time series are left out
    m = srv.metrics()
    assert m[("gmlx:request_success_total", (("finished_reason", "length"),))] >= 1
    assert m[("gmlx:spec_decode_num_accepted_tokens_total", ())] <= m[("gmlx:spec_decode_num_draft_tokens_total", ())]
    assert {lbl[0][1] for (name, lbl) in m if name == "gmlx:transitions_total"} >= {"preempt", "gate", "resume",
                                                                                   "capture"}


def test_api_key(lm):
    with serving(lm, api_key="sekret") as s:
        with pytest.raises(openai.AuthenticationError) as e:
            s.client(api_key="wrong").completions.create(model=s.model, prompt=PROMPT, max_tokens=2)
        assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
        r = httpx.post(s.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=TIMEOUT)
        assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_request_error"
        assert httpx.get(s.url + "/v1/models", timeout=TIMEOUT).status_code == 401
        ok = s.client().completions.create(model=s.model, prompt=PROMPT, max_tokens=2)
        assert ok.choices[0].finish_reason == "length"
        for path in ("/health", "/metrics"):
            assert httpx.get(s.url + path, timeout=TIMEOUT).status_code == 200
        assert s.engine.service.open_streams == 0


def test_queue_full_is_429_with_retry_after(lm):
    """PREEMPT off: a waiter waits in the queue while a scalar request runs, so with max_queued=1
    the third request finds the queue full."""
    with serving(lm, max_queued=1, preempt=False) as s:
        client = s.client()
        long = client.completions.create(model=s.model, prompt=PROMPT, max_tokens=600, temperature=0, stream=True)
        next(iter(long))  # it is decoding
        waiter = client.completions.create(model=s.model, prompt=PROMPT, max_tokens=3, temperature=0, stream=True)
        assert s.engine.service.queued == 1
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model=s.model, prompt=PROMPT, max_tokens=3)
        assert e.value.status_code == 429 and e.value.response.headers["retry-after"] == "1"
        assert e.value.code == "rate_limit_exceeded"
        long.close()  # the client goes away: its row leaves and the waiter is served
        assert [c.choices[0].finish_reason for c in waiter][-1] == "length"
        s.wait_idle()
        assert s.metric("gmlx:http_rejected_total", status="429") == 1
        assert s.metric("gmlx:request_success_total", finished_reason="cancelled") == 1
