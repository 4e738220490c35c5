"""What real clients send, answered exactly: penalties, logit_bias, logprobs (completions and
chat), echo with prompt logprobs, n > 1, streaming with logprobs; each equal (tokens tie-aware,
logprobs within 1e-3) to the same request decoded alone without speculation."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
from serve_helpers import TIMEOUT, params, prompt_ids, serving

from gmlx.engine.oracle import run_scalar
from numerics import compare_tokens

LM_WITHOUT_EOS = True
PROMPT = "def parse_args(argv):"
PENALTIES = {"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.3, "logit_bias": {"10": 4.0}}


@pytest.fixture(scope="module")
def srv(lm):
    with serving(lm, num_draft_tokens=3) as s:  # an explicit K: every lone request speculates
        yield s


def gmlx_params(extra: dict, n: int, t: float, seed: int, logprobs: int | None):
    kw = {k: v for k, v in extra.items() if k != "logit_bias"}
    if "logit_bias" in extra:
        kw["logit_bias"] = {int(k): v for k, v in extra["logit_bias"].items()}
    return params(n, t, seed, logprobs=logprobs, **kw)


def check_choice(lm, ids, p, token_ids, token_lps):
    ref = run_scalar(lm, ids, p, speculative=False)
    c = compare_tokens(lm, ids, ref.tokens, token_ids, p)
    assert c.ok, c
    if c.equal:
        np.testing.assert_allclose(token_lps, [t.logprob for t in ref.logprobs], atol=1e-3)
    return ref, c


@pytest.mark.parametrize("t", [0.0, 0.8])
def test_completion_penalties_and_logprobs_equal_solo_plain(srv, lm, t):
    ids = prompt_ids(lm, PROMPT)
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": t, "seed": 5, "logprobs": 3, "return_token_ids": True,
            **PENALTIES}
    r = srv.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    lp = ch["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ch["token_ids"]) == 24
    ref, c = check_choice(lm, ids, gmlx_params(PENALTIES, 24, t, 5, 3), ch["token_ids"], lp["token_logprobs"])
    if c.equal:
        assert ch["text"] == ref.text
        assert "".join(lp["tokens"]) == lm.tokenizer.decode(ch["token_ids"])
        assert all(3 <= len(top) <= 4 for top in lp["top_logprobs"])  # the top 3, and the sampled token
        assert lp["text_offset"][0] == 0
        if t == 0:  # greedy: the sampled token is the best one
            assert all(abs(max(top.values()) - v) < 1e-6 for top, v in zip(lp["top_logprobs"], lp["token_logprobs"]))
    # speculation ran for it
    assert srv.metric("gmlx:spec_decode_num_draft_tokens_total") > 0


def test_chat_logprobs_and_top_logprobs_on_the_role_prefix_fallback(srv, lm):
    """The embedded model has no chat template: mlx_lm.server's role prefixes render the prompt."""
    from gmlx.serve.app import role_prefixed

    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Write"}, {"type": "text", "text": "a loop"}]}]
    body = {"messages": msgs, "max_tokens": 12, "temperature": 0, "seed": 1, "logprobs": True, "top_logprobs": 2,
            "return_token_ids": True, **PENALTIES}
    r = srv.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    rendered = role_prefixed([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write\na loop"}])
    assert out["prompt_token_ids"] == prompt_ids(lm, rendered)
    assert rendered == "ASSISTANT's RULE: Be brief.\nUSER: Write\na loop\nASSISTANT:"  # as mlx_lm.server's convert_chat
    ch = out["choices"][0]
    content = ch["logprobs"]["content"]
    assert len(content) == len(ch["token_ids"]) and all(len(e["top_logprobs"]) == 2 for e in content)
    assert all(set(e) == {"token", "logprob", "bytes", "top_logprobs"} for e in content)
    check_choice(lm, out["prompt_token_ids"], gmlx_params(PENALTIES, 12, 0.0, 1, 2), ch["token_ids"],
                 [e["logprob"] for e in content])


def test_streamed_logprobs_equal_the_full_answer(srv):
    body = {"prompt": PROMPT, "max_tokens": 20, "temperature": 0.7, "seed": 3, "logprobs": 1, **PENALTIES}
    full = srv.post("/v1/completions", json=body).json()["choices"][0]
    with httpx.stream("POST", srv.url + "/v1/completions", json={**body, "stream": True}, timeout=TIMEOUT) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    got = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for e in events:
        lp = e["choices"][0]["logprobs"]
        if lp:
            for k in got:
                got[k] += lp[k]
    assert "".join(e["choices"][0]["text"] for e in events) == full["text"]
    assert got["tokens"] == full["logprobs"]["tokens"] and got["text_offset"] == full["logprobs"]["text_offset"]
    np.testing.assert_allclose(got["token_logprobs"], full["logprobs"]["token_logprobs"], atol=1e-3)


def test_echo_scores_the_prompt_as_decoding_would(srv, lm):
    """echo + logprobs: the prompt's logprobs at the positions of a greedy continuation equal the
    logprobs that continuation was generated with (the same distribution, another forward)."""
    ids = prompt_ids(lm, PROMPT)
    gen = srv.post("/v1/completions", json={"prompt": ids, "max_tokens": 10, "temperature": 0, "logprobs": 2,
                                            "return_token_ids": True, **PENALTIES}).json()["choices"][0]
    whole = ids + gen["token_ids"]
    r = srv.post("/v1/completions", json={"prompt": whole, "max_tokens": 1, "temperature": 0, "echo": True,
                                          "logprobs": 2, **PENALTIES})
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    lp = ch["logprobs"]
    assert ch["text"].startswith(lm.tokenizer.decode(whole))
    assert len(lp["tokens"]) == len(whole) + 1 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    np.testing.assert_allclose(lp["token_logprobs"][len(ids):len(whole)], gen["logprobs"]["token_logprobs"], atol=1e-3)
    # without logprobs, echo is the prompt text alone; streamed, it comes first
    plain = srv.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "echo": True})
    assert plain.json()["choices"][0]["text"].startswith(PROMPT)
    with httpx.stream("POST", srv.url + "/v1/completions", timeout=TIMEOUT,
                      json={"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 0,
                            "stream": True}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert events[0]["choices"][0]["text"] == PROMPT
    assert len(events[0]["choices"][0]["logprobs"]["tokens"]) == len(ids)
    assert "".join(e["choices"][0]["text"] for e in events) == plain.json()["choices"][0]["text"]


def test_n_choices_are_the_seeds_streams(srv, lm):
    ids = prompt_ids(lm, PROMPT)
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0.9, "seed": 40, "n": 3, "return_token_ids": True,
            "stream_options": None}
    r = srv.post("/v1/completions", json=body).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    assert r["usage"]["completion_tokens"] == 36 and r["usage"]["prompt_tokens"] == len(ids)
    for i, c in enumerate(r["choices"]):  # choice i samples with seed + i
        ref = run_scalar(lm, ids, params(12, 0.9, 40 + i), speculative=False)
        assert compare_tokens(lm, ids, ref.tokens, c["token_ids"], params(12, 0.9, 40 + i)).ok
    assert len({tuple(c["token_ids"]) for c in r["choices"]}) > 1
    with httpx.stream("POST", srv.url + "/v1/completions", timeout=TIMEOUT,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    texts = {0: "", 1: "", 2: ""}
    finished = set()
    for e in events[:-1]:
        c = e["choices"][0]
        texts[c["index"]] += c["text"]
        if c["finish_reason"]:
            finished.add(c["index"])
    assert finished == {0, 1, 2} and events[-1]["usage"]["completion_tokens"] == 36
    assert [texts[i] for i in range(3)] == [c["text"] for c in r["choices"]]
    srv.wait_idle()


def test_chat_n_and_stream_logprobs(srv):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0.5, "seed": 2, "n": 2,
            "logprobs": True}
    full = srv.post("/v1/chat/completions", json=body).json()
    assert len(full["choices"]) == 2 and all(c["logprobs"]["content"] for c in full["choices"])
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=TIMEOUT) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    roles = [e for e in events if e["choices"][0]["delta"].get("role")]
    assert sorted(e["choices"][0]["index"] for e in roles) == [0, 1]
    for i in (0, 1):
        mine = [e["choices"][0] for e in events if e["choices"][0]["index"] == i]
        assert "".join(c["delta"].get("content") or "" for c in mine) == full["choices"][i]["message"]["content"]
        toks = [x["token"] for c in mine if c["logprobs"] for x in c["logprobs"]["content"]]
        assert toks == [x["token"] for x in full["choices"][i]["logprobs"]["content"]]


def test_role_prefixes_are_mlx_lm_servers():
    from mlx_lm.server import convert_chat

    from gmlx.serve.app import role_prefixed

    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"},
            {"role": "tool", "content": "t"}]
    assert role_prefixed(msgs) == convert_chat(msgs)
    rm = {"user": "Q: ", "assistant": "A: ", "stop": "\n\n"}
    assert role_prefixed(msgs, rm) == convert_chat(msgs, rm)


def test_concurrent_requests_with_processors_equal_solo_plain(srv, lm):
    """Several at once: the batch loop (speculating) serves them; each equals its solo plain decode."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = ["import os\n", "class Node:", "def main():", "for i in range(10):"]
    variants = [PENALTIES, {"repetition_penalty": 1.5, "repetition_context_size": 5}, {},
                {"frequency_penalty": 1.0, "logit_bias": {"7": -100}}]
    bodies = [{"prompt": p, "max_tokens": 20 + 4 * i, "temperature": 0.0 if i % 2 else 0.8, "seed": 60 + i,
               "logprobs": 2, "return_token_ids": True, **v} for i, (p, v) in enumerate(zip(prompts, variants))]
    def batched():
        return sum(srv.metric("gmlx:transitions_total", transition=t) for t in ("form_batch", "preempt"))

    before = batched()
    with ThreadPoolExecutor(4) as ex:
        outs = list(ex.map(lambda b: srv.post("/v1/completions", json=b), bodies))
    assert batched() > before  # they met in the batch loop
    for b, r in zip(bodies, outs):
        assert r.status_code == 200, r.text
        ch = r.json()["choices"][0]
        extra = {k: b[k] for k in b if k in PENALTIES or k.endswith("_size")}
        check_choice(lm, prompt_ids(lm, b["prompt"]), gmlx_params(extra, b["max_tokens"], b["temperature"], b["seed"], 2),
                     ch["token_ids"], ch["logprobs"]["token_logprobs"])
    srv.wait_idle()
