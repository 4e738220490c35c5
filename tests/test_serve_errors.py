"""Bad requests: each is answered with OpenAI's error object and the right status, and none reaches
the engine's queue; the openai client raises its typed errors for them."""

from __future__ import annotations

import httpx
import openai
import pytest
from serve_helpers import TIMEOUT, serving

LM_WITHOUT_EOS = True
OK = {"prompt": "def f(x):", "max_tokens": 2}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

# (name, endpoint, body, the `param` the error names)
BAD = [
    ("no prompt", "completions", {"max_tokens": 2}, "prompt"),
    ("empty prompt", "completions", {**OK, "prompt": ""}, "prompt"),
    ("prompt a number", "completions", {**OK, "prompt": 5}, "prompt"),
    ("prompt empty list", "completions", {**OK, "prompt": []}, "prompt"),
    ("several prompts", "completions", {**OK, "prompt": ["a", "b"]}, "prompt"),
    ("float token ids", "completions", {**OK, "prompt": [1.5, 2]}, "prompt"),
    ("token id outside the vocabulary", "completions", {**OK, "prompt": [10**9]}, "prompt"),
    ("max_tokens 0", "completions", {**OK, "max_tokens": 0}, "max_tokens"),
    ("max_tokens a string", "completions", {**OK, "max_tokens": "5"}, "max_tokens"),
    ("max_tokens past the context", "completions", {**OK, "max_tokens": 5000}, "max_tokens"),
    ("temperature < 0", "completions", {**OK, "temperature": -1}, "temperature"),
    ("temperature a string", "completions", {**OK, "temperature": "hot"}, "temperature"),
    ("temperature true", "completions", {**OK, "temperature": True}, "temperature"),
    ("top_p 0", "completions", {**OK, "top_p": 0}, "top_p"),
    ("top_p > 1", "completions", {**OK, "top_p": 1.5}, "top_p"),
    ("negative seed", "completions", {**OK, "seed": -3}, "seed"),
    ("float seed", "completions", {**OK, "seed": 1.5}, "seed"),
    ("stop a number", "completions", {**OK, "stop": 5}, "stop"),
    ("empty stop string", "completions", {**OK, "stop": [""]}, "stop"),
    ("n 0", "completions", {**OK, "n": 0}, "n"),
    ("n above the limit", "completions", {**OK, "n": 17}, "n"),
    ("stream a string", "completions", {**OK, "stream": "yes"}, "stream"),
    ("stream_options without stream", "completions", {**OK, "stream_options": {"include_usage": True}},
     "stream_options"),
    ("unknown stream option", "completions",
     {**OK, "stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options.continuous_usage_stats"),
    ("logprobs above the limit", "completions", {**OK, "logprobs": 21}, "logprobs"),
    ("logprobs true on completions", "completions", {**OK, "logprobs": True}, "logprobs"),
    ("frequency_penalty > 2", "completions", {**OK, "frequency_penalty": 2.5}, "frequency_penalty"),
    ("presence_penalty < -2", "completions", {**OK, "presence_penalty": -3}, "presence_penalty"),
    ("repetition_penalty < 0", "completions", {**OK, "repetition_penalty": -1.0}, "repetition_penalty"),
    ("repetition_penalty a string", "completions", {**OK, "repetition_penalty": "1.2"}, "repetition_penalty"),
    ("negative context size", "completions", {**OK, "repetition_context_size": -1}, "repetition_context_size"),
    ("min_tokens past max_tokens", "completions", {**OK, "min_tokens": 5}, "min_tokens"),
    ("logit_bias key not a token id", "completions", {**OK, "logit_bias": {"hello": 5}}, "logit_bias"),
    ("logit_bias key outside the vocabulary", "completions", {**OK, "logit_bias": {"999999999": 5}}, "logit_bias"),
    ("logit_bias value out of range", "completions", {**OK, "logit_bias": {"5": 500}}, "logit_bias"),
    ("logit_bias a list", "completions", {**OK, "logit_bias": [5]}, "logit_bias"),
    ("echo a string", "completions", {**OK, "echo": "yes"}, "echo"),
    ("top_logprobs above the limit", "chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ("top_logprobs without logprobs", "chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("chat_template_kwargs overriding tokenize", "chat/completions",
     {**CHAT, "chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs.tokenize"),
    ("tool_choice required", "chat/completions", {**CHAT, "tool_choice": "required"}, "tool_choice"),
    ("best_of 3", "completions", {**OK, "best_of": 3}, "best_of"),
    ("unknown field", "completions", {**OK, "foo": 1}, "foo"),
    ("top_k < 0", "completions", {**OK, "top_k": -1}, "top_k"),
    ("min_p > 1", "completions", {**OK, "min_p": 2}, "min_p"),
    ("ignore_eos a string", "completions", {**OK, "ignore_eos": "no"}, "ignore_eos"),
    ("model a number", "completions", {**OK, "model": 7}, "model"),
    ("no messages", "chat/completions", {"max_tokens": 2}, "messages"),
    ("empty messages", "chat/completions", {**CHAT, "messages": []}, "messages"),
    ("unknown role", "chat/completions", {**CHAT, "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ("tool message without its call id", "chat/completions", {**CHAT, "messages": [{"role": "tool", "content": "x"}]},
     "messages[0].tool_call_id"),
    ("image part", "chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]"),
    ("no content", "chat/completions", {**CHAT, "messages": [{"role": "user"}]}, "messages[0].content"),
    ("tool_calls", "chat/completions",
     {**CHAT, "messages": [{"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}]},
     "messages[0].tool_calls"),
    ("both budgets, different", "chat/completions", {**CHAT, "max_tokens": 5, "max_completion_tokens": 6},
     "max_tokens"),
    ("tools on a model without a template", "chat/completions",
     {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("json mode", "chat/completions", {**CHAT, "response_format": {"type": "json_object"}}, "response_format"),
]

RAW = [  # bodies that are not JSON objects
    ("not JSON", b"{"),
    ("NaN", b'{"prompt": "x", "temperature": NaN}'),
    ("a list", b"[1, 2]"),
    ("empty body", b""),
    ("not UTF-8", b'{"prompt": "\xff"}'),
]


@pytest.fixture(scope="module")
def srv(lm):
    with serving(lm) as s:
        yield s


@pytest.fixture
def queued(srv, monkeypatch):
    """Requests that reached the engine's queue during the test."""
    seen = []
    real = srv.engine.service.submit

    def spy(row, start=True):
        stream = real(row, start)
        seen.append(stream)
        return stream

    monkeypatch.setattr(srv.engine.service, "submit", spy)
    return seen


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return err


@pytest.mark.parametrize("name,endpoint,body,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_400_naming_the_field_and_queues_nothing(srv, queued, name, endpoint, body, param):
    err = error_of(srv.post(f"/v1/{endpoint}", json=body), 400)
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    assert queued == [] and srv.engine.service.queued == 0 and srv.engine.service.open_streams == 0


@pytest.mark.parametrize("name,raw", RAW, ids=[r[0] for r in RAW])
def test_a_body_that_is_not_a_json_object_is_400(srv, queued, name, raw):
    err = error_of(srv.post("/v1/completions", content=raw, headers={"content-type": "application/json"}), 400)
    assert err["type"] == "invalid_request_error" and queued == []


def test_other_errors_are_error_objects(srv, queued):
    before = srv.metric("gmlx:http_rejected_total", status="400")  # the module's other tests may run elsewhere (xdist)
    error_of(srv.post("/v1/completions", json={**OK, "max_tokens": -1}), 400)
    assert error_of(srv.post("/v1/completions", json={**OK, "model": "gpt-4"}), 404)["code"] == "model_not_found"
    assert error_of(srv.post("/v1/completions", content=b"x" * ((1 << 20) + 1)), 413)["code"] == "request_too_large"
    assert error_of(httpx.get(srv.url + "/v1/nothing", timeout=TIMEOUT), 404)["code"] == "not_found"
    assert error_of(httpx.get(srv.url + "/v1/completions", timeout=TIMEOUT), 405)["code"] == "method_not_allowed"
    assert queued == []
    assert srv.metric("gmlx:http_rejected_total", status="400") == before + 1


def test_the_openai_client_raises_typed_errors(srv, queued):
    client = srv.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=srv.model, prompt="x", max_tokens=2, n=17)
    assert e.value.param == "n" and "n" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=srv.model, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       tools=[{"type": "function", "function": {"name": "f"}}])
    assert e.value.code == "chat_template_missing" and "chat template" in e.value.message
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert queued == []
