"""Predicted outputs over HTTP (OpenAI's `prediction` on both endpoints): the answer equals the
request without a prediction (it only proposes drafts), the usage carries
`completion_tokens_details.accepted_prediction_tokens` / `rejected_prediction_tokens`, streamed
and not, and a malformed prediction is a 400 naming the field."""

from __future__ import annotations

import pytest
from serve_helpers import body, params, serving

LM_WITHOUT_EOS = True  # the budget ends each answer: the re-ask sees the whole previous one


@pytest.fixture(scope="module")
def srv(lm):
    with serving(lm, width_cap=0) as s:
        yield s


def test_completion_reasked_with_its_answer(srv):
    p = params(48, seed=3)
    first = srv.post("/v1/completions", json=body(p, "def parse(line):")).json()
    text, ids = first["choices"][0]["text"], first["choices"][0]["token_ids"]
    assert "completion_tokens_details" not in first["usage"]
    again = srv.post("/v1/completions", json=body(p, "def parse(line):", prediction={"type": "content",
                                                                                        "content": text})).json()
    assert again["choices"][0]["token_ids"] == ids
    details = again["usage"]["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] >= 40 and details["rejected_prediction_tokens"] <= 2, details
    # text parts; streamed, with the usage chunk last
    parts = [{"type": "text", "text": text[:10]}, {"type": "text", "text": text[10:]}]
    stream = srv.client().completions.create(model=srv.model, prompt="def parse(line):", max_tokens=48,
                                             temperature=0, seed=3, stream=True,
                                             stream_options={"include_usage": True},
                                             extra_body={"prediction": {"type": "content", "content": parts}})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens >= 40
    srv.wait_idle()


def test_chat_with_an_edited_prediction(srv):
    """The embedded model has no chat template: the role prefixes; an edited prediction realigns,
    the answer is the one without a prediction, sampled too (seeded)."""
    msgs = [{"role": "user", "content": "import os"}]
    client = srv.client()
    for t in (0.0, 0.9):
        plain = client.chat.completions.create(model=srv.model, messages=msgs, max_tokens=40, temperature=t, seed=5)
        text = plain.choices[0].message.content
        guess = text.replace("e", "a")
        pred = client.chat.completions.create(model=srv.model, messages=msgs, max_tokens=40, temperature=t, seed=5,
                                              prediction={"type": "content", "content": guess})
        assert pred.choices[0].message.content == text
        d = pred.usage.completion_tokens_details
        assert d.accepted_prediction_tokens >= 0 and d.rejected_prediction_tokens >= 0
    srv.wait_idle()


@pytest.mark.parametrize("prediction,param", [
    ("just text", "prediction"),
    ({"type": "other", "content": "x"}, "prediction"),
    ({"type": "content"}, "prediction"),
    ({"type": "content", "content": 5}, "prediction.content"),
    ({"type": "content", "content": [{"type": "image_url", "image_url": "x"}]}, "prediction.content"),
    ({"type": "content", "content": "x", "extra": 1}, "prediction.extra"),
])
def test_malformed_prediction_is_a_400(srv, prediction, param):
    r = srv.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "prediction": prediction})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
