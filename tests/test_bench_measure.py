"""What `gmlx bench` measures, checked against hand computations (issue 18): every request has an
end (EOS first, cancelled and rejected ones included), and a cell's aggregate throughput = its
tokens / (last end - first submit) alike in the five places it is shown: the live line, the
summary table, the JSON, the CSV and the data the PNG is drawn from. Over HTTP (`--url`): a 429 is
"rejected" (its own column), engine-only fields are absent, acceptance comes from the server's
/metrics counters. And the default results directory is ./runs, not the committed bench_results/.

In process the times are exact (a scripted backend on a fake clock); over HTTP a stand-in server
(stdlib http.server) answers each prompt its own way, and a real `gmlx serve` on a free loopback
port checks the acceptance read from /metrics against the engine's own counters."""

from __future__ import annotations

import functools
import json
import re
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler

import pandas as pd
import pytest
from serve_helpers import serving, stand_in
from test_bench_cli import isolated, only, run  # noqa: F401 - isolated: the same autouse fixture

from gmlx.engine.metrics import Event, EventKind
from gmlx.policy.admission import Mode, Round
from gmlx_cli.bench import arms, plots
from gmlx_cli.bench.target import counters_delta, parse_spec_counters
from gmlx_cli.bench.driver import Backend, aggregate_tokens_per_s, drive


@pytest.fixture
def plotted(monkeypatch):
    """What the PNG is drawn from: every `plots.bench_series` result, as plot_bench gets it."""
    seen = []
    real = plots.bench_series
    monkeypatch.setattr(plots, "bench_series", lambda cells: seen.append(real(cells)) or seen[-1])
    return seen


def live_aggregate(text: str, label: str) -> tuple[int, float]:
    m = re.search(rf"^   {re.escape(label)}: (\d+) tokens, ([\d.]+) tok/s aggregate", text, re.M)
    assert m, text
    return int(m.group(1)), float(m.group(2))


def summary_row(text: str, arm: str, conc: int) -> list[str]:
    """The first summary table's row of a cell, split (not a TTY: plain aligned text)."""
    block = text.split("summary per cell: latency (ms) and throughput (tok/s)", 1)[1]
    row = next(ln for ln in block.splitlines() if re.match(rf"^{re.escape(arm)}\s+{conc}\s", ln))
    return row.split()


def csv_cells(out) -> pd.DataFrame:
    return pd.read_csv(only(out, "bench-*-cells.csv"))


# -- in process: exact times -------------------------------------------------------------------
class Scripted(Backend):
    """Each request does what its budget says, one step = 0.5 s on the fake clock:
    4 -> one token per step, "length" after 4; 5 -> EOS before any token, at step 6 (it ends last);
    6 -> two tokens, then "cancelled" at step 3."""

    def __init__(self, clock):
        self.clock, self.live, self.next_id = clock, {}, 0

    def submit(self, prompt_ids, params):
        rid, self.next_id = self.next_id, self.next_id + 1
        self.live[rid] = {"kind": params.max_tokens, "steps": 0, "tokens": []}
        return rid

    def step(self):
        self.clock.now += 0.5
        rows, fin = [], []
        for rid, st in self.live.items():
            st["steps"] += 1
            emit = (st["kind"] == 4) or (st["kind"] == 6 and st["steps"] <= 2)
            if emit:
                st["tokens"].append(7)
            rows.append((rid, 0, 0, int(emit)))
            done = {4: len(st["tokens"]) == 4, 5: st["steps"] == 6, 6: st["steps"] == 3}[st["kind"]]
            if done:
                st["reason"] = {4: "length", 5: "stop", 6: "cancelled"}[st["kind"]]
                fin.append(Event(EventKind.FINISH, Mode.GATED, len(rows), rid=rid))
        return [Event(EventKind.ROUND, Mode.GATED, len(rows), rows=tuple(rows), round=Round.PLAIN)] + fin

    def result(self, rid):
        st = self.live.pop(rid)
        return st["tokens"], st["reason"], {}

    @property
    def has_work(self):
        return bool(self.live)

    def close(self):
        pass


class FakeClock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_in_process_cell_with_eos_first_and_cancelled_agrees_in_all_five(tmp_path, monkeypatch, plotted):
    clock = FakeClock()
    monkeypatch.setattr(arms, "make_backend", lambda *a, **k: (Scripted(clock), "-"))
    monkeypatch.setattr(arms, "drive", functools.partial(drive, clock=clock, sleep=lambda s: None))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p, "max_tokens": m})
                                 for p, m in (("def a():\n", 4), ("def b():\n", 5), ("def c():\n", 6))) + "\n")
    out = tmp_path / "out"
    r = run("bench", "--concurrency", "3", "--requests", "3", "--prompts", str(prompts), "--seed", "0",
            "--no-warmup", "--out", str(out))
    assert r.code == 0, r.stderr
    # By hand: 4 + 0 + 2 tokens; first submit 0.0; the EOS-first request ends last, at step 6 = 3.0 s.
    # (Leaving it out, as bench once did, gives 6 / 2.0 = 3.0.)
    expected = 6 / 3.0
    assert live_aggregate(r.stdout, "gmlx c=3 rep 0") == (6, pytest.approx(expected, abs=0.05))
    assert float(summary_row(r.stdout, "gmlx", 3)[7]) == pytest.approx(expected, rel=5e-3)
    saved = json.loads(only(out, "bench-*.json").read_text())
    (cell,) = saved["cells"]
    assert cell["aggregate_tokens_per_s"] == pytest.approx(expected) and cell["tokens"] == 6
    assert cell["eos_first"] == 1 and cell["rejected"] == 0
    assert saved["runs"] == [{"arm": "gmlx", "concurrency": 3, "repeat": 0, "tokens": 6, "first_submit_s": 0.0,
                              "last_end_s": 3.0, "aggregate_tokens_per_s": pytest.approx(expected),
                              "complete": True}]
    assert csv_cells(out).aggregate_tokens_per_s.tolist() == [pytest.approx(expected)]
    (series,) = plotted
    assert series["gmlx"].aggregate_tokens_per_s.tolist() == [pytest.approx(expected)]
    by_id = {q["request_id"]: q for q in saved["requests"]}
    assert [by_id[i]["finish_reason"] for i in range(3)] == ["length", "stop", "cancelled"]
    assert [by_id[i]["end_s"] for i in range(3)] == [2.0, 3.0, 1.5]
    assert [by_id[i]["e2e_s"] for i in range(3)] == [2.0, 3.0, 1.5]  # defined for every request
    assert by_id[1]["ttft_s"] is None and by_id[1]["eos_first"] is True
    assert "(finished before its first token)" in r.stdout


def test_aggregate_counts_every_request():
    assert aggregate_tokens_per_s([4, 0, 2], [0.0, 0.0, 0.5], [2.0, 3.0, 1.5]) == 2.0
    assert aggregate_tokens_per_s([], [], []) != aggregate_tokens_per_s([], [], [])  # NaN: nothing ran
    assert aggregate_tokens_per_s([0], [1.0], [1.0]) != 0  # no time: NaN, not a division by zero


# -- over HTTP: a stand-in server ---------------------------------------------------------------
class Scripts(BaseHTTPRequestHandler):
    """Per prompt: "normal" streams 4 tokens; "eos" waits, then ends with "stop" and no token;
    "cancel" streams 2 tokens, then "cancelled"; "reject" answers 429 (queue full). /metrics
    counts vLLM's spec_decode counters, +2 drafts, +6 draft tokens, +3 accepted per answered request."""

    counters = {"drafts": 0, "draft_tokens": 0, "accepted": 0}
    lock = threading.Lock()

    def log_message(self, *a):
        pass

    def _send(self, status: int, body: bytes, ctype: str = "application/json", extra: dict | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/metrics":
            c = self.counters
            text = "".join([
                "# HELP vllm:spec_decode_num_drafts Number of spec decoding drafts.\n",
                "# TYPE vllm:spec_decode_num_drafts counter\n",
                f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="fake"}} {float(c["drafts"])}\n',
                'vllm:spec_decode_num_drafts_created{engine="0",model_name="fake"} 1.7e9\n',
                f'vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="fake"}} {float(c["draft_tokens"])}\n',
                f'vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="fake"}} {float(c["accepted"])}\n',
                'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="fake",position="0"}'
                f' {float(c["accepted"])}\n'])
            return self._send(200, text.encode(), "text/plain; version=0.0.4")
        self._send(200, json.dumps({"object": "list", "data": [{"id": "fake", "object": "model"}]}).encode())

    def do_POST(self):
        prompt = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))["prompt"]
        if prompt == "reject":
            return self._send(429, json.dumps({"error": {"message": "queue full", "type": "overloaded"}}).encode(),
                              extra={"Retry-After": "1"})
        with self.lock:
            for k, v in (("drafts", 2), ("draft_tokens", 6), ("accepted", 3)):
                self.counters[k] += v
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        n, finish = {"normal": (4, "length"), "eos": (0, "stop"), "cancel": (2, "cancelled")}[prompt]
        if prompt == "eos":
            time.sleep(0.3)  # it ends last: the span must reach its end
        events = [{"choices": [{"index": 0, "text": "x", "token_ids": [5], "finish_reason": None}]}
                  for _ in range(n)]
        events += [{"choices": [{"index": 0, "text": "", "token_ids": [], "finish_reason": finish}]},
                   {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}}]
        for e in events:
            self.wfile.write(b"data: " + json.dumps({"id": "x", "object": "text_completion", "created": 0,
                                                     "model": "fake", **e}).encode() + b"\n\n")
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")


@contextmanager
def scripted_server():
    handler = type("Handler", (Scripts,), {"counters": {"drafts": 0, "draft_tokens": 0, "accepted": 0}})
    with stand_in(handler) as url:
        yield url


def test_url_cell_with_eos_first_cancelled_and_rejected(tmp_path, plotted):
    prompts = tmp_path / "p.txt"
    prompts.write_text("normal\neos\ncancel\nreject\n")
    out = tmp_path / "out"
    with scripted_server() as url:
        r = run("bench", "--url", url, "--concurrency", "4", "--requests", "4", "--max-tokens", "8", "--prompts",
                str(prompts), "--seed", "0", "--no-warmup", "--out", str(out))
    assert r.code == 0, r.stderr  # a refusal is measured, not a failure
    saved = json.loads(only(out, "bench-*.json").read_text())
    reqs = {q["request_id"]: q for q in saved["requests"]}
    assert [reqs[i]["finish_reason"] for i in range(4)] == ["length", "stop", "cancelled", "rejected"]
    assert [reqs[i]["num_generated"] for i in range(4)] == [4, 0, 2, 0]
    assert all(q["end_s"] is not None and q["e2e_s"] == pytest.approx(q["end_s"] - q["submit_s"])
               for q in reqs.values())
    # By hand, from the requests' own times: the EOS-first one ends last (the server held it 0.3 s).
    first, last = min(q["submit_s"] for q in reqs.values()), max(q["end_s"] for q in reqs.values())
    assert last == reqs[1]["end_s"] and last - first >= 0.3
    expected = 6 / (last - first)
    assert live_aggregate(r.stdout, "server c=4 rep 0") == (6, pytest.approx(expected, abs=0.05))
    row = summary_row(r.stdout, "server", 4)
    assert float(row[7]) == pytest.approx(expected, rel=5e-3) and row[8] == "1"  # agg tok/s, rej
    (cell,) = saved["cells"]
    assert cell["aggregate_tokens_per_s"] == pytest.approx(expected)
    assert csv_cells(out).aggregate_tokens_per_s.tolist() == [pytest.approx(expected)]
    (series,) = plotted
    assert series["server"].aggregate_tokens_per_s.tolist() == [pytest.approx(expected)]
    # 429: its own column and note, never "finished before its first token", not an error
    assert cell["rejected"] == 1 and cell["eos_first"] == 1 and saved["errors"] == []
    assert "request 3 rejected by the server (HTTP 429)" in r.stdout
    assert "request 1 ended at EOS before its first token" in r.stdout
    assert re.search(r"^   id 3 .*\(rejected by the server: HTTP 429\)$", r.stdout, re.M), r.stdout
    assert not re.search(r"^   id 3 .*finished before its first token", r.stdout, re.M)
    # acceptance from /metrics (vllm: prefix): 3 answered requests x (2 drafts, 6 drafted, 3 accepted)
    assert (cell["num_drafted"], cell["num_accepted"]) == (18, 9)
    assert cell["draft_acceptance_rate"] == pytest.approx(0.5) and cell["mean_acceptance_length"] == pytest.approx(2.5)
    assert saved["runs"][0]["server_spec_counters"] == {"drafts": 6, "draft_tokens": 18, "accepted": 9}
    assert "summary per cell: speculation" in r.stdout and "the server's /metrics counters" in r.stdout
    # engine-only fields: absent, not guessed
    engine_only = {"speculative", "switch_preempt", "switch_resume", "preempt", "gate", "resume", "capture",
                   "num_rounds", "ideal_speedup"}
    assert not engine_only & cell.keys() and not engine_only & set(csv_cells(out).columns)
    assert not {"num_drafted", "num_rounds", "draft_acceptance_rate"} & reqs[0].keys()
    assert "mode " not in r.stdout and "transitions" not in r.stdout and "(cap" not in r.stdout


def test_parse_spec_counters():
    gmlx_text = "\n".join([
        "# TYPE gmlx:spec_decode_num_drafts counter",
        'gmlx:spec_decode_num_drafts_total{model_name="m"} 4.0',
        'gmlx:spec_decode_num_drafts_created{model_name="m"} 1.7e9',
        'gmlx:spec_decode_num_draft_tokens_total{model_name="m"} 12.0',
        'gmlx:spec_decode_num_accepted_tokens_total{model_name="m"} 7.0',
        'gmlx:generation_tokens_total{model_name="m"} 99.0'])
    assert parse_spec_counters(gmlx_text, "m") == {"drafts": 4.0, "draft_tokens": 12.0, "accepted": 7.0}
    assert parse_spec_counters(gmlx_text, "other") == {"drafts": 4.0, "draft_tokens": 12.0, "accepted": 7.0}
    plain = "spec_decode_num_drafts_total 1\ngmlx_spec_decode_num_draft_tokens_total 3\n" \
            "spec_decode_num_accepted_tokens_total 2\n"
    assert parse_spec_counters(plain) == {"drafts": 1.0, "draft_tokens": 3.0, "accepted": 2.0}
    two = gmlx_text + "\n" + gmlx_text.replace('"m"', '"n"').replace(" 4.0", " 40.0")
    assert parse_spec_counters(two, "n")["drafts"] == 40.0 and parse_spec_counters(two, "x") is None
    assert parse_spec_counters("mlx_lm_requests_total 3\n") is None and parse_spec_counters("<html>") is None
    # gmlx serve before its first drafting round: the labelled counter is declared, with no sample yet
    fresh = gmlx_text.replace('gmlx:spec_decode_num_drafts_total{model_name="m"} 4.0', "")
    assert parse_spec_counters(fresh, "m") == {"drafts": 0.0, "draft_tokens": 12.0, "accepted": 7.0}
    assert parse_spec_counters(fresh.replace("# TYPE gmlx:spec_decode_num_drafts counter", ""), "m") is None
    assert parse_spec_counters(gmlx_text.replace("accepted_tokens_total", "accepted_tokens_per_pos_total")) is None
    assert counters_delta({"drafts": 1.0, "draft_tokens": 3.0, "accepted": 2.0},
                          {"drafts": 5.0, "draft_tokens": 15.0, "accepted": 9.0}) == \
        {"drafts": 4, "draft_tokens": 12, "accepted": 7}
    assert counters_delta(None, {"drafts": 1.0}) is None


# -- over HTTP: a real gmlx serve ----------------------------------------------------------------
def test_url_acceptance_is_the_servers_own(lm, tmp_path):
    with serving(lm) as srv:
        names = ("gmlx:spec_decode_num_drafts_total", "gmlx:spec_decode_num_draft_tokens_total",
                 "gmlx:spec_decode_num_accepted_tokens_total")
        before = [srv.metric(n) for n in names]
        engine_before = (srv.engine.counters.drafted, srv.engine.counters.accepted)
        r = run("bench", "--url", srv.url, "--concurrency", "1,2", "--requests", "2", "--max-tokens", "6",
                "--ignore-eos", "--seed", "1", "--no-warmup", "--json", "--out", str(tmp_path))
        assert r.code == 0, r.stderr
        srv.wait_idle()
        drafts, drafted, accepted = (srv.metric(n) - b for n, b in zip(names, before))
        engine = (srv.engine.counters.drafted - engine_before[0], srv.engine.counters.accepted - engine_before[1])
    obj = json.loads(r.stdout)
    cells = obj["cells"]
    assert [c["tokens"] for c in cells] == [12, 12] and all(c["rejected"] == 0 for c in cells)
    assert sum(c["num_drafted"] for c in cells) == drafted == engine[0]
    assert sum(c["num_accepted"] for c in cells) == accepted == engine[1]
    assert sum(run_["server_spec_counters"]["drafts"] for run_ in obj["runs"]) == drafts
    for c, run_ in zip(cells, obj["runs"]):
        d = run_["server_spec_counters"]
        if d["draft_tokens"]:
            assert c["draft_acceptance_rate"] == pytest.approx(d["accepted"] / d["draft_tokens"])
            assert c["mean_acceptance_length"] == pytest.approx(1 + d["accepted"] / d["drafts"])
        assert not {"speculative", "switch_preempt", "switch_resume", "preempt", "gate", "resume", "capture"} & c.keys()
    assert obj["meta"]["acceptance_source"].startswith("the server's /metrics")
    assert "mode " not in r.stderr and "transitions" not in r.stderr


# -- where the files go -------------------------------------------------------------------------
def test_default_out_is_runs_not_bench_results(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = run("bench", "--concurrency", "1", "--requests", "1", "--max-tokens", "2", "--seed", "0", "--no-warmup")
    assert r.code == 0, r.stderr
    assert only(tmp_path / "runs", "bench-*.json") and not (tmp_path / "bench_results").exists()
    assert re.search(r"^results: runs/bench-", r.stdout, re.M), r.stdout

