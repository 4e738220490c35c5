"""`gmlx serve` as users run it (a subprocess): SIGINT or SIGTERM while requests are live stops
accepting, ends the live streams with a finish reason and a clean `data: [DONE]` (never half an
event), answers a waiting non-streaming request, and exits 0."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

START_S = 120.0  # the model load on a shared 2-core machine
LONG = {"prompt": "import os\n", "max_tokens": 900, "temperature": 0, "ignore_eos": True}


def start_server(lines: list[str] | None = None) -> tuple[subprocess.Popen, str]:
    """`lines`: filled with the server's stderr as it comes."""
    proc = subprocess.Popen([sys.executable, "-m", "gmlx_cli.app", "serve", "--port", "0", "--log-level", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines = [] if lines is None else lines
    found = threading.Event()

    def read():
        for line in proc.stderr:
            lines.append(line)
            if "serving" in line:
                found.set()

    threading.Thread(target=read, daemon=True).start()
    if not found.wait(START_S):
        proc.kill()
        pytest.fail(f"gmlx serve did not start within {START_S} s: {''.join(lines)}")
    url = re.search(r"on (http://\S+)/v1", next(x for x in lines if "serving" in x)).group(1)
    return proc, url


def wait_running(url: str, n: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(url + "/health", timeout=5).json()["running"] < n:
        assert time.monotonic() < deadline, f"fewer than {n} requests running after {timeout} s"
        time.sleep(0.02)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_ends_live_streams_cleanly_and_exits_0(sig):
    stderr: list[str] = []
    proc, url = start_server(stderr)
    try:
        plain: dict = {}

        def post_plain():
            r = httpx.post(url + "/v1/completions", json=LONG, timeout=60)
            plain.update(status=r.status_code, body=r.json())

        with httpx.Client(timeout=60) as client, client.stream("POST", url + "/v1/completions",
                                                               json={**LONG, "stream": True}) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            events = [next(x for x in lines if x)]  # the first token is out: the request is decoding
            waiter = threading.Thread(target=post_plain)
            waiter.start()
            wait_running(url, 2)  # both requests are with the engine
            proc.send_signal(sig)
            events += [x for x in lines if x]
        waiter.join(60)
        assert proc.wait(60) == 0, proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]  # each a whole JSON object
    assert all(e.startswith("data: ") for e in events)
    finishes = [c["choices"][0]["finish_reason"] for c in chunks]
    assert finishes[-1] == "cancelled" and set(finishes[:-1]) == {None}
    assert len("".join(c["choices"][0]["text"] for c in chunks)) > 0
    assert plain["status"] == 200 and plain["body"]["choices"][0]["finish_reason"] == "cancelled"
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health", timeout=5)
    # one line says the server stops and what that cancels (the two requests above)
    deadline = time.monotonic() + 10  # the reader thread may still be behind the exited process
    while not any("shutting down" in ln for ln in stderr) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [ln.strip() for ln in stderr if "shutting down" in ln] == [
        f"gmlx: notice: shutting down ({sig.name}): 2 requests cancelled"]


def test_cli_errors_are_one_line_before_the_model_load(monkeypatch):
    """A taken port, a bad option value: one `gmlx: error:` line, exit 1, and no model loaded."""
    from cli_helpers import use_model
    from test_cli import assert_one_line_error, run

    use_model(monkeypatch, lambda path: pytest.fail("loaded the model"))
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        port = str(taken.getsockname()[1])
        assert_one_line_error(run("serve", "--port", port), f"127.0.0.1:{port}", "--port")
    finally:
        taken.close()
    assert_one_line_error(run("serve", "--log-level", "loud"), "--log-level")
    assert_one_line_error(run("serve", "--api-key", " "), "--api-key")
    assert_one_line_error(run("serve", "--port", "70000"), "--port")
    assert_one_line_error(run("serve", "--max-queued", "0"), "max_queued")
