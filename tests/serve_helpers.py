"""Helpers for the server tests: a real uvicorn server on a free loopback port, on a thread of the
test process (so it shares the session's loaded model and the test can look at the engine), and
readers for /metrics. Every wait is bounded."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from gmlx import Engine, EngineConfig, SamplingParams
from gmlx.config import Switches
from gmlx.engine.intake import tokenize
from gmlx.serve import Background, create_app

@contextmanager
def stand_in(handler: type):
    """A stand-in HTTP server (the standard library's, `handler` a BaseHTTPRequestHandler) on a free
    loopback port, on a thread; yields its base URL."""
    import threading
    from http.server import ThreadingHTTPServer

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        t.join(5)


TIMEOUT = 30.0  # per HTTP call: generous on a shared 2-core machine, never unbounded


@dataclass
class Served:
    url: str
    engine: Engine
    api: object  # gmlx.serve.app.Api
    key: str | None = None

    @property
    def model(self) -> str:
        return self.api.model_name

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(**self._client_args(kw))

    def aclient(self, **kw) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(**self._client_args(kw))

    def _client_args(self, kw: dict) -> dict:
        return {"base_url": self.url + "/v1", "api_key": self.key or "none", "max_retries": 0, "timeout": TIMEOUT} | kw

    def post(self, path: str, **kw) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.key}"} if self.key else {}
        return httpx.post(self.url + path, headers=headers | kw.pop("headers", {}), timeout=TIMEOUT, **kw)

    def metrics(self) -> dict[tuple, float]:
        """{(sample name, ((label, value), ...)): value}, the model_name label dropped."""
        text = httpx.get(self.url + "/metrics", timeout=TIMEOUT).text
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
                out[(s.name, labels)] = s.value
        return out

    def metric(self, name: str, **labels) -> float:
        return self.metrics().get((name, tuple(sorted(labels.items()))), 0.0)

    def wait_idle(self, timeout: float = 15.0) -> None:
        """Until no stream is open, nothing is queued and the engine has no rows."""
        deadline = time.monotonic() + timeout
        while self.engine.service.open_streams or self.engine.has_work:
            assert time.monotonic() < deadline, (f"still busy after {timeout} s: {self.engine.service.open_streams}"
                                                 f" open streams, live rows {len(self.engine.live_rows())}")
            time.sleep(0.01)


@contextmanager
def serving(lm, *, api_key: str | None = None, preempt: bool = True, resume: bool = True, **config):
    """An engine on `lm` served on 127.0.0.1:<free port>; stopping the server closes the engine."""
    eng = Engine(lm, EngineConfig(**config), switches=Switches(preempt=preempt, resume=resume))
    app = create_app(eng, api_key=api_key)
    try:
        with Background(app) as bg:
            yield Served(bg.url, eng, app.state.api, api_key)
    finally:
        eng.close()


def params(max_tokens: int, temperature: float = 0.0, seed: int = 0, **kw) -> SamplingParams:
    """The SamplingParams the server builds from the same request fields (top_p 1 unless given)."""
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, **kw)


def body(p: SamplingParams, prompt, **extra) -> dict:
    """The request fields for these params (what `params()` reads back)."""
    fields = {"prompt": prompt, "max_tokens": p.max_tokens, "temperature": p.temperature, "seed": p.seed,
              "top_p": p.top_p, "return_token_ids": True}
    if p.stop:
        fields["stop"] = list(p.stop)
    return fields | extra


def prompt_ids(lm, prompt) -> list[int]:
    return tokenize(lm, prompt)
