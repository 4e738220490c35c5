"""Chat completions on a real instruct model (SmolLM2-135M-Instruct, its GGUF converted to float32:
MLX's CPU quantized kernels make the q conversion's prefill ~10x slower here): the tokenizer's chat
template is rendered with the generation prompt, the model answers, and it stops at its own end
of turn ("stop"); streaming and not give the same answer."""

from __future__ import annotations

import pytest
from serve_helpers import serving

QUESTION = [{"role": "system", "content": "You are a helpful AI assistant named SmolLM, trained by Hugging Face"},
            {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def chat_srv(smollm2):
    with serving(smollm2.load("float32")) as s:
        yield s


def test_chat_renders_the_template_and_answers(chat_srv):
    lm = chat_srv.engine.lm
    client = chat_srv.client()
    r = client.chat.completions.create(model=chat_srv.model, messages=QUESTION, max_completion_tokens=12,
                                       temperature=0, extra_body={"return_token_ids": True})
    choice = r.choices[0]
    rendered = lm.tokenizer.decode(r.model_extra["prompt_token_ids"])
    assert rendered == lm.tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert rendered.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    assert choice.message.role == "assistant" and "Paris" in choice.message.content, choice.message.content
    assert choice.finish_reason == "stop"  # the model's own <|im_end|>, not the budget
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.usage.completion_tokens == len(choice.model_extra["token_ids"]) < 12

    chunks = list(client.chat.completions.create(model=chat_srv.model, messages=QUESTION, max_tokens=12,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    first, *body, finish, last = chunks
    assert first.choices[0].delta.role == "assistant" and not first.choices[0].delta.content
    assert "".join(c.choices[0].delta.content or "" for c in body) == choice.message.content
    assert finish.choices[0].finish_reason == "stop" and all(c.object == "chat.completion.chunk" for c in chunks)
    assert last.choices == [] and last.usage.completion_tokens == r.usage.completion_tokens
    chat_srv.wait_idle()


def test_a_conversation_and_text_parts(chat_srv):
    """Multi-turn input and content given as text parts render like plain strings."""
    convo = [{"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"}]},
             {"role": "assistant", "content": "Paris."},
             {"role": "developer", "content": "Answer in one word."}]
    r = chat_srv.post("/v1/chat/completions", json={"messages": convo, "max_tokens": 1, "temperature": 0,
                                                   "return_token_ids": True})
    assert r.status_code == 200, r.text
    text = chat_srv.engine.lm.tokenizer.decode(r.json()["prompt_token_ids"])
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in text
    assert "<|im_start|>assistant\nParis.<|im_end|>" in text
    assert "<|im_start|>system\nAnswer in one word.<|im_end|>" in text  # developer is OpenAI's newer system
    assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")


TOOLS = [{"type": "function", "function": {"name": "weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def test_tool_calls_tool_messages_and_template_kwargs(chat_srv):
    """As agents send them: an assistant turn with tool_calls and null content, the tool's answer,
    `tools` and `chat_template_kwargs` for the template (the arguments JSON string becomes an object)."""
    lm = chat_srv.engine.lm
    convo = [{"role": "user", "content": "What is the weather in Paris?"},
             {"role": "assistant", "content": None,
              "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
             {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "22 C, sunny"}]}]
    r = chat_srv.post("/v1/chat/completions", json={"messages": convo, "tools": TOOLS, "tool_choice": "auto",
                                                   "chat_template_kwargs": {"enable_thinking": False}, "max_tokens": 4,
                                                   "temperature": 0, "return_token_ids": True})
    assert r.status_code == 200, r.text
    seen = [{"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": "",
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": "22 C, sunny", "tool_call_id": "c1"}]
    want = lm.tokenizer.apply_chat_template(seen, tools=TOOLS, add_generation_prompt=True, tokenize=True)
    assert r.json()["prompt_token_ids"] == list(want)
    assert "<|im_start|>tool\n22 C, sunny<|im_end|>" in lm.tokenizer.decode(want)


def test_chat_penalties_and_logprobs_equal_solo_plain(chat_srv):
    import numpy as np

    from gmlx.config import SamplingParams
    from gmlx.engine.oracle import run_scalar
    from numerics import compare_tokens

    lm = chat_srv.engine.lm
    body = {"messages": QUESTION, "max_tokens": 16, "temperature": 0, "seed": 0, "logprobs": True, "top_logprobs": 2,
            "repetition_penalty": 1.2, "presence_penalty": 0.3, "logit_bias": {"28": 2.0}, "return_token_ids": True}
    out = chat_srv.post("/v1/chat/completions", json=body).json()
    ch = out["choices"][0]
    p = SamplingParams(max_tokens=16, seed=0, logprobs=2, repetition_penalty=1.2, presence_penalty=0.3,
                       logit_bias={28: 2.0})
    ref = run_scalar(lm, out["prompt_token_ids"], p, speculative=False)
    c = compare_tokens(lm, out["prompt_token_ids"], ref.tokens, ch["token_ids"], p)
    assert c.ok, c
    if c.equal:
        assert ch["message"]["content"] == ref.text
        np.testing.assert_allclose([e["logprob"] for e in ch["logprobs"]["content"]], [t.logprob for t in ref.logprobs],
                                   atol=1e-3)
    chat_srv.wait_idle()


SYSTEM_HELLO = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hello!"}]
# The request bodies of mlx_lm.server's own test suite (its tests/test_server.py), "model" left out
PEER_REQUESTS = [
    ("completions", {"prompt": "Once upon a time", "max_tokens": 10, "temperature": 0.5, "top_p": 0.9,
                     "repetition_penalty": 1.1, "repetition_context_size": 20, "seed": 999, "stop": "stop sequence"}),
    ("chat/completions", {"max_tokens": 10, "temperature": 0.7, "top_p": 0.85, "repetition_penalty": 1.2,
                          "messages": SYSTEM_HELLO}),
    ("chat/completions", {"max_tokens": 10, "temperature": 0.7, "top_p": 0.85, "repetition_penalty": 1.2,
                          "messages": [{"role": "system", "content": [{"type": "text", "text": "You are a helpful assistant."}]},
                                       {"role": "user", "content": [{"type": "text", "text": "Hello!"}]}]}),
    ("chat/completions", {"max_tokens": 10, "temperature": 0.7, "top_p": 0.85, "repetition_penalty": 1.2,
                          "messages": [{"role": "user", "content": "what is 2+3?"},
                                       {"role": "assistant", "content": None, "tool_calls": [
                                           {"type": "function", "id": "123",
                                            "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
                                       {"role": "tool", "content": "5", "tool_call_id": "123"}]}),
    ("completions", {"prompt": "Once upon a time", "max_tokens": 10, "temperature": 0.0, "top_p": 1.0}),
    ("chat/completions", {"max_tokens": 10, "temperature": 0.0, "messages": SYSTEM_HELLO}),
    ("chat/completions", {"max_tokens": 10, "temperature": 0.0, "stream": True, "messages": SYSTEM_HELLO}),
    ("chat/completions", {"max_tokens": 5, "temperature": 0.0, "messages": [SYSTEM_HELLO[0],
                                                                          {"role": "user", "content": "Tell me a story about"}]}),
    ("chat/completions", {"max_tokens": 5, "temperature": 0.0,
                          "messages": [SYSTEM_HELLO[0], {"role": "user", "content": "Tell me a story about dragons."}]}),
]


@pytest.mark.parametrize("endpoint,body", PEER_REQUESTS, ids=[f"{i}" for i in range(len(PEER_REQUESTS))])
def test_a_peer_servers_requests_are_served(chat_srv, endpoint, body):
    r = chat_srv.post(f"/v1/{endpoint}", json=body)
    assert r.status_code == 200, r.text
    if body.get("stream"):
        assert r.text.rstrip().endswith("data: [DONE]")
        return
    out = r.json()
    assert out["choices"] and out["usage"]["completion_tokens"] > 0
    if "seed" in body:  # seeded: the same answer twice
        assert chat_srv.post(f"/v1/{endpoint}", json=body).json()["choices"][0]["text"] == out["choices"][0]["text"]
