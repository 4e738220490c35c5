"""`gmlx bench --url` through the real entry point against a real `gmlx serve` (uvicorn on a free
loopback port, on a thread of this process: tests/serve_helpers.py), and against small stand-in
servers (stdlib http.server) for what gmlx serve never does: chunks without token ids (as
mlx_lm.server sends them), failed requests, and answers that are not OpenAI's. Timing is never
asserted (docs/design.md §8): counts, shapes, order of events and the one-line errors."""

from __future__ import annotations

import asyncio
import functools
import json
import socket
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, SimpleHTTPRequestHandler

import pytest
from serve_helpers import serving, stand_in
from test_bench_cli import only, run

from gmlx.engine.intake import tokenize
from gmlx_cli.bench.http_backend import drive_http, spread
from gmlx_cli.bench.target import Target, probe
from gmlx_cli.bench.workload import Arrival, build_requests, load_prompt_specs

KEY = "sekret"
SMALL = ("--requests", "3", "--max-tokens", "6", "--seed", "1", "--no-warmup")


@pytest.fixture(scope="module")
def srv(lm):
    with serving(lm, api_key=KEY) as s:
        yield s


def one_error_line(r, needle: str, ran: bool = False) -> str:
    """Exit 1 and one error line on stderr; nothing else printed unless the run itself went ahead."""
    assert r.code == 1 and (ran or r.stdout == ""), (r.code, r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("gmlx: error: ") and needle in lines[0], r.stderr
    return lines[0]


def test_bench_url_table_json_and_budgets(srv, lm, tmp_path):
    r = run("bench", "--url", srv.url + "/v1", "--api-key", KEY, "--concurrency", "1,3", *SMALL, "--ignore-eos",
            "--label", "gmlx-serve", "--json", "--out", str(tmp_path))
    assert r.code == 0, r.stderr
    obj = json.loads(r.stdout)
    assert "summary per cell" in r.stderr and "gmlx-serve" in r.stderr
    assert [(c["arm"], c["concurrency"]) for c in obj["cells"]] == [("gmlx-serve", 1), ("gmlx-serve", 3)]
    assert obj["meta"]["url"] == srv.url and obj["meta"]["model"] == srv.model and obj["errors"] == []
    assert "api_key" not in obj["meta"]["options"] and KEY not in json.dumps(obj)
    prompts = {i: s.prompt for i, s in enumerate(load_prompt_specs(None)[:3])}
    assert len(obj["requests"]) == 6
    for req in obj["requests"]:
        # ignore_eos reached the server: every budget is spent, and counted exactly (token ids)
        assert req["finish_reason"] == "length" and req["num_generated"] == req["max_tokens"] == 6
        assert len(req["tokens"]) == 6 and req["prompt_tokens"] == tokenize(lm, prompts[req["request_id"]])
        assert req["num_prompt_tokens"] == len(req["prompt_tokens"])
        assert req["ttft_s"] > 0 and req["e2e_s"] >= req["ttft_s"] and all(g >= 0 for g in req["itl_s"])
        assert len(req["itl_s"]) <= 5
        # a rate where the chunks span time; none (null, not 0) where the client read them at one instant
        assert req["tokens_per_s"] > 0 if any(req["itl_s"]) else req["tokens_per_s"] is None
    for cell in obj["cells"]:
        assert cell["tokens"] == 18 and cell["aggregate_tokens_per_s"] > 0 and cell["ttft_p50_s"] > 0
        # acceptance: the server's own /metrics counters (tests/test_bench_measure.py checks the values)
        assert cell["num_drafted"] >= cell["num_accepted"] >= 0 and cell["partial"] is False
    assert only(tmp_path, "bench-*-requests.csv") and only(tmp_path, "bench-*.png")


def test_join_late_waiters_are_sent_once_the_long_request_streams(srv, tmp_path):
    reqs = build_requests(load_prompt_specs(None), 3, Arrival("join-late", join_after_s=0.0, long_tokens=10), (3, 3),
                          0.0, seed=0, ignore_eos=True)
    outs = asyncio.run(drive_http(Target(srv.url, srv.model, KEY), reqs, 3, ignore_eos=True))
    by_id = {o.request.request_id: o for o in outs}
    first_token = by_id[0].chunks[0][0]
    assert all(by_id[i].submit_s >= first_token for i in (1, 2))
    assert [by_id[i].num_generated for i in range(3)] == [10, 3, 3]


# -- stand-in servers ----------------------------------------------------------------------------
class Fake(BaseHTTPRequestHandler):
    """mode "text": mlx_lm.server's way (one text chunk per token or a few, no ids, usage at the
    end); "fail": completions answer 500; "html": not an OpenAI server at all."""

    mode = "text"

    def log_message(self, *a):  # quiet
        pass

    def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.mode == "html":
            self._send(200, b"<html><body>hello</body></html>", "text/html")
        else:
            self._send(200, json.dumps({"object": "list", "data": [{"id": "fake", "object": "model"}]}).encode())

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.mode == "fail":
            return self._send(500, json.dumps({"error": {"message": "the model fell over"}}).encode())
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        events = [{"choices": [{"index": 0, "text": t, "finish_reason": None}]} for t in ("def", " f", "(x):")]
        events += [{"choices": [{"index": 0, "text": "", "finish_reason": "length"}]},
                   {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}}]
        for e in events:
            self.wfile.write(b"data: " + json.dumps({"id": "x", "object": "text_completion", "created": 0,
                                                     "model": "fake", **e}).encode() + b"\n\n")
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")


@contextmanager
def fake_server(mode: str):
    handler = type("Handler", (Fake,), {"mode": mode})
    with stand_in(handler) as url:
        yield url


def test_text_only_chunks_count_tokens_from_usage():
    assert spread(5, 3) == [1, 2, 2] and sum(spread(64, 7)) == 64 and spread(3, 0) == []
    reqs = build_requests(load_prompt_specs(None), 2, Arrival(), (5, 5), 0.0, seed=0)
    with fake_server("text") as url:
        outs = asyncio.run(drive_http(probe(url), reqs, 2))
    for o in outs:
        assert o.finish_reason == "length" and o.tokens == [] and o.text == "def f(x):"
        assert o.num_generated == 5 and [n for _, n in o.chunks] == [1, 2, 2] and o.num_prompt_tokens == 7
        assert o.ttft_s == o.chunks[0][0] - o.submit_s and len(o.itl_s) == 2


def test_failed_requests_are_counted_and_the_results_kept(tmp_path):
    with fake_server("fail") as url:
        r = run("bench", "--url", url, "--concurrency", "2", *SMALL, "--out", str(tmp_path))
    line = one_error_line(r, "3 of 3 requests failed (first: request", ran=True)
    assert "HTTP 500" in line and "the model fell over" in line and "results written to" in line
    saved = json.loads(only(tmp_path, "bench-*.json").read_text())
    assert len(saved["errors"]) == 3 and all(q["finish_reason"] == "error" for q in saved["requests"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_url_is_one_line():
    one_error_line(run("bench", "--url", f"http://127.0.0.1:{free_port()}", *SMALL), "cannot reach http://127.0.0.1:")


def test_wrong_key_is_one_line(srv):
    line = one_error_line(run("bench", "--url", srv.url, "--api-key", "wrong", *SMALL), "refused the request (HTTP 401")
    assert "check --api-key" in line
    one_error_line(run("bench", "--url", srv.url, *SMALL), "pass its key with --api-key")


def test_not_an_openai_server_is_one_line(tmp_path):
    with fake_server("html") as url:
        one_error_line(run("bench", "--url", url, *SMALL), "GET /v1/models did not answer with a model list")
    (tmp_path / "index.html").write_text("hi")  # a static file server: 404 on /v1/models
    quiet = type("Quiet", (SimpleHTTPRequestHandler,), {"log_message": lambda *a: None})
    handler = functools.partial(quiet, directory=str(tmp_path))
    with stand_in(handler) as url:
        one_error_line(run("bench", "--url", url, *SMALL), "GET /v1/models answered HTTP 404")


@pytest.mark.parametrize("args,needle", [
    (("--url", "http://127.0.0.1:1", "--ab", "both"), "--ab configures the in-process engine"),
    (("--url", "http://127.0.0.1:1", "--verify"), "--verify configures the in-process engine"),
    (("--url", "http://127.0.0.1:1", "--draft-model", "x"), "--draft-model configures"),
    (("--served-model", "m"), "--served-model needs --url"),
    (("--url", "ftp://x"), "--url must start with http://"),
], ids=["ab", "verify", "draft-model", "served-model", "scheme"])
def test_option_mixups_are_one_line(args, needle):
    one_error_line(run("bench", *args, *SMALL), needle)
