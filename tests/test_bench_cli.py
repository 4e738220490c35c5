"""`gmlx bench` and `gmlx sweep-cap` through the real entry point (error boundary included), on the
session's model (tests/conftest.py `lm`), with tiny workloads: 3 requests x 8 tokens, 2 widths.

Every test runs with GMLX_CONFIG pointing into its own temporary directory, so nothing here can
read or write the real user config. Timing is never asserted (docs/design.md §8): only shapes, types,
equality of streams and the transitions the arms record.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pandas as pd
import pytest
from cli_helpers import run, use_model

from gmlx.policy import user_config
from gmlx.config import SamplingParams
from gmlx.errors import InvalidRequest
from gmlx.engine.metrics import Event, EventKind
from gmlx.policy.admission import Mode, Round, Transition
from gmlx.models.loading import default_model_path
from gmlx_cli.bench import recommend, results, sweep
from gmlx_cli.bench.live import LiveView
from gmlx_cli.bench.driver import Backend, drive
from gmlx_cli.bench.workload import Arrival, build_requests, load_prompt_specs, parse_token_range

if not os.environ.get("GMLX_TEST_MODEL") and not (default_model_path() / "config.json").is_file():
    pytest.skip("the embedded default model is not exported yet", allow_module_level=True)

SMALL = ("--requests", "3", "--max-tokens", "8", "--seed", "1", "--no-warmup")


@pytest.fixture(autouse=True)
def isolated(lm, monkeypatch, tmp_path):
    """The session's model instead of a load; a user config that lives and dies with the test."""
    use_model(monkeypatch, lambda path: lm)
    monkeypatch.setenv("GMLX_CONFIG", str(tmp_path / "config.toml"))
    for name in ("GMLX_MTP_PREEMPT", "GMLX_MTP_RESUME", "GMLX_MTP_WIDTH_CAP"):
        monkeypatch.delenv(name, raising=False)


def only(out: Path, pattern: str) -> Path:
    (path,) = out.glob(pattern)
    return path


# -- bench -------------------------------------------------------------------------------------
def test_bench_json_csv_columns_and_dtypes(tmp_path):
    r = run("bench", "--concurrency", "1,3", *SMALL, "--ignore-eos", "--json", "--out", str(tmp_path))
    assert r.code == 0, r.stderr
    obj = json.loads(r.stdout)  # stdout is exactly one JSON object; view and tables went to stderr
    assert {"cells", "requests", "transitions"} <= obj.keys() and "summary per cell" in r.stderr
    assert [(c["arm"], c["concurrency"]) for c in obj["cells"]] == [("gmlx", 1), ("gmlx", 3)]
    assert len(obj["requests"]) == 6
    types = {"arm": str, "concurrency": int, "request_id": int, "prompt_tokens": list, "tokens": list,
             "finish_reason": str, "seed": int, "temperature": float, "ttft_s": float, "tokens_per_s": float,
             "num_drafted": int, "num_accepted": int}
    for req in obj["requests"]:
        for key, typ in types.items():
            assert isinstance(req[key], typ), (key, req[key])
        assert len(req["tokens"]) == 8 and req["finish_reason"] == "length" and all(isinstance(t, int) for t in req["prompt_tokens"])
    assert set(obj["transitions"]["gmlx"]) == {"preempt", "gate", "resume", "capture"}

    reqs = pd.read_csv(only(tmp_path, "bench-*-requests.csv"))
    cells = pd.read_csv(only(tmp_path, "bench-*-cells.csv"))
    for df, spec in ((reqs, results.REQUEST_COLUMNS), (cells, results.CELL_COLUMNS)):
        assert list(df.columns[: len(spec)]) == list(spec)
        assert {c for c in df.columns[len(spec):]} >= {"meta_cpu", "meta_blas", "meta_mlx", "meta_mlx_lm", "meta_gmlx",
                                                        "meta_git_commit"}
        for col, dtype in spec.items():
            if dtype in ("int64", "float64", "bool"):
                assert str(df[col].dtype) == dtype, (col, df[col].dtype)
    assert json.loads(reqs.tokens[0]) == obj["requests"][0]["tokens"]  # list cells are JSON arrays
    saved = json.loads(only(tmp_path, "bench-*.json").read_text())
    assert {"cpu", "cores", "blas", "mlx", "mlx_lm", "gmlx", "git_commit"} <= saved["meta"]["machine"].keys()
    assert "GMLX_MTP_PREEMPT" in saved["meta"]["env"] and saved["meta"]["seed"] == 1
    assert only(tmp_path, "bench-*.png").stat().st_size > 0


def test_bench_verify_plain_baseline_and_plain_lines(tmp_path):
    r = run("bench", "--concurrency", "3", *SMALL, "--temp", "0.7", "--baseline", "plain", "--verify",
            "--out", str(tmp_path))
    assert r.code == 0, r.stderr
    assert "verify: 6 streams checked, 0 mismatches" in r.stdout
    assert "== gmlx c=3 rep 0" in r.stdout and "== gmlx-plain c=3 rep 0" in r.stdout  # not a TTY: plain lines
    assert "\x1b[" not in r.stdout


def test_bench_mlx_lm_baselines_run_beside_gmlx(tmp_path):
    """Both mlx-lm arms (stream_generate and BatchGenerator) run through the live view and
    land in the cells; their tokens are counted like gmlx's."""
    r = run("bench", "--concurrency", "1,2", "--requests", "2", "--max-tokens", "6", "--ignore-eos", "--seed", "0",
            "--baseline", "mlx-lm", "--no-warmup", "--json", "--out", str(tmp_path))
    assert r.code == 0, r.stderr
    cells = json.loads(r.stdout)["cells"]
    assert {(c["arm"], c["concurrency"]) for c in cells} == {
        (arm, c) for arm in ("gmlx", "mlx-lm-stream", "mlx-lm-batch") for c in (1, 2)}
    assert all(c["tokens"] == 12 for c in cells), cells


def test_bench_verify_reports_a_mismatch(tmp_path, monkeypatch):
    import gmlx.engine.oracle

    class Wrong:
        tokens = [1, 2, 3]

    monkeypatch.setattr(gmlx.engine.oracle, "run_scalar", lambda *a, **k: Wrong())
    r = run("bench", "--concurrency", "3", *SMALL, "--verify", "--out", str(tmp_path))
    assert r.code == 1
    assert "mismatch: gmlx c=3 rep 0 request 0" in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("gmlx: error: 3 of 3 streams differ")
    assert only(tmp_path, "bench-*.json")  # written before failing


def test_ab_arms_really_set_the_switches(tmp_path):
    # One long request, then two short waiters while it runs; cap 1 gates the batch, and once the
    # waiters finish the long one is back within the cap with budget left: a resume.
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p, "max_tokens": m}) for p, m in
                                 (("def add(a, b):\n", 24), ("import os\n", 4), ("class Foo:\n", 4))) + "\n")
    r = run("bench", "--concurrency", "3", "--requests", "3", "--arrival", "join-late", "--join-after", "0",
            "--prompts", str(prompts), "--ab", "both", "--speculative-width-cap", "1", "--ignore-eos", "--no-warmup",
            "--json",
            "--out", str(tmp_path))
    assert r.code == 0, r.stderr
    obj = json.loads(r.stdout)
    tr = obj["transitions"]
    assert set(tr) == {f"gmlx-preempt{p}-resume{s}" for p in (0, 1) for s in (0, 1)}
    for arm, counts in tr.items():
        if "preempt0" in arm:
            assert counts["preempt"] == 0, (arm, counts)
        if "resume0" in arm:
            assert counts["resume"] == 0, (arm, counts)
    assert tr["gmlx-preempt1-resume1"]["preempt"] >= 1 and tr["gmlx-preempt1-resume1"]["resume"] >= 1
    flags = {c["arm"]: (c["switch_preempt"], c["switch_resume"]) for c in obj["cells"]}
    assert flags["gmlx-preempt0-resume1"] == (False, True) and flags["gmlx-preempt1-resume0"] == (True, False)


def test_bench_ctrl_c_writes_partial_results(tmp_path, monkeypatch):
    seen = {"finished": 0}
    real = LiveView.on_event

    def on_event(self, ev):
        real(self, ev)
        seen["finished"] += ev.kind is EventKind.FINISH
        if seen["finished"] == 3 and ev.kind is EventKind.ROUND:  # the second cell's first round: mid-run
            raise KeyboardInterrupt

    monkeypatch.setattr(LiveView, "on_event", on_event)
    r = run("bench", "--concurrency", "1,3", *SMALL, "--ignore-eos", "--out", str(tmp_path))
    assert r.code == 130
    assert r.stderr.strip().splitlines()[-1].startswith("gmlx: error: interrupted; partial results written to")
    saved = json.loads(only(tmp_path, "bench-*.json").read_text())
    assert saved["meta"]["interrupted"] is True
    cut = [q for q in saved["requests"] if q["finish_reason"] == "cancelled"]
    assert len(saved["requests"]) == 6 and len(cut) == 3  # the in-flight ones are kept, marked cancelled
    assert all(q["concurrency"] == 3 and 1 <= len(q["tokens"]) < 8 for q in cut)
    assert len(pd.read_csv(only(tmp_path, "bench-*-requests.csv"))) == 6


BAD = {
    "concurrency 0": (("bench", "--concurrency", "0"), "--concurrency"),
    "concurrency malformed": (("bench", "--concurrency", "1,,2"), "--concurrency"),
    "concurrency text": (("bench", "--concurrency", "a"), "--concurrency"),
    "requests 0": (("bench", "--requests", "0"), "--requests"),
    "ab unknown": (("bench", "--ab", "preemption"), "--ab"),
    "baseline unknown": (("bench", "--baseline", "vllm"), "--baseline"),
    "arrival unknown": (("bench", "--arrival", "sometimes"), "--arrival"),
    "max-tokens range": (("bench", "--max-tokens", "64-32"), "--max-tokens"),
    "max-tokens 0": (("bench", "--max-tokens", "0"), "--max-tokens"),
    "prompts missing": (("bench", "--prompts", "/nonexistent/prompts.txt"), "does not exist"),
    "repeats 0": (("bench", "--repeats", "0"), "--repeats"),
    "widths 0": (("sweep-cap", "--widths", "0,2"), "--widths"),
    "K list": (("sweep-cap", "--num-draft-tokens", "2,x"), "--num-draft-tokens"),
}


@pytest.mark.parametrize("args,needle", BAD.values(), ids=BAD.keys())
def test_bad_input_is_one_line_error(args, needle):
    r = run(*args)
    assert r.code == 1 and r.stdout == "", (r.code, r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("gmlx: error: ") and needle in lines[0], r.stderr


def test_bad_json_line_names_the_line(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt": "a"}\n{"prompt": "b",}\n')
    r = run("bench", "--prompts", str(p))
    assert r.code == 1 and r.stderr.count("\n") == 1 and "line 2 is not valid JSON" in r.stderr


# -- sweep-cap ---------------------------------------------------------------------------------
def test_sweep_cap_write_lands_in_the_temp_config(tmp_path):
    r = run("sweep-cap", "--widths", "1,2", "--max-tokens", "6", "--repeats", "1", "--no-warmup", "--write",
            "--json", "--out", str(tmp_path))
    assert r.code == 0, r.stderr
    obj = json.loads(r.stdout)
    assert obj["widths"] == [1, 2] and [w["width"] for w in obj["per_width"]] == [1, 2]
    assert {"plain_tokens_per_s", "spec", "best_k", "speedup"} <= obj["per_width"][0].keys()
    cap = obj["recommended_cap"]
    assert cap in (1, 2, "off") and obj["written"] == os.environ["GMLX_CONFIG"]
    entry = user_config.read_user_entry(user_config.DEFAULT_MODEL_KEY, path=os.environ["GMLX_CONFIG"])
    assert entry.cap == cap and entry.source == "sweep-cap"
    assert only(tmp_path, "sweep-*.png") and only(tmp_path, "sweep-*-measurements.csv")


def scripted(speedups: dict[int, dict[int | None, float]]):
    """A `measure` that reports tok/s by (width, K): plain 100, spec 100 x speedup."""
    def measure(lm, prompts, width, max_tokens, config, seed=0):
        k = config.num_draft_tokens if config.speculative else None
        tps = 100.0 * (1.0 if k is None else speedups[width][k])
        return {"tokens_per_s": tps, "tokens": 10, "seconds": 10 / tps, "draft_acceptance_rate": 0.5}
    return measure


def test_sweep_cap_k_per_width_and_validate(tmp_path, monkeypatch):
    monkeypatch.setattr(sweep, "measure", scripted({1: {2: 1.3, 3: 1.5}, 2: {2: 1.2, 3: 1.1}, 4: {2: 0.9, 3: 0.8}}))
    r = run("sweep-cap", "--widths", "1,2,4", "--num-draft-tokens", "2,3", "--max-tokens", "8", "--repeats", "1",
            "--write", "--validate", "--json", "--out", str(tmp_path))
    assert r.code == 0, r.stderr
    obj = json.loads(r.stdout)
    assert obj["recommended_cap"] == 2
    entry = user_config.read_user_entry(user_config.DEFAULT_MODEL_KEY, path=os.environ["GMLX_CONFIG"])
    assert entry.cap == 2 and dict(entry.k_by_width) == {1: 3, 2: 2}
    v = obj["validate"]  # the real A/B at the new cap, on a join-late workload
    assert v["cap"] == 2 and len(v["cells"]) == 4
    for arm, counts in v["transitions"].items():
        assert "preempt0" not in arm or counts["preempt"] == 0
        assert "resume0" not in arm or counts["resume"] == 0


def test_sweep_cap_off_when_speculation_never_wins(tmp_path, monkeypatch):
    monkeypatch.setattr(sweep, "measure", scripted({1: {3: 1.4}, 2: {3: 0.95}}))
    r = run("sweep-cap", "--widths", "1,2", "--num-draft-tokens", "3", "--repeats", "1", "--write", "--json",
            "--out", str(tmp_path))
    assert r.code == 0, r.stderr
    assert json.loads(r.stdout)["recommended_cap"] == "off"  # width 2 loses: not 0 (= uncapped)
    assert user_config.read_user_entry(user_config.DEFAULT_MODEL_KEY, path=os.environ["GMLX_CONFIG"]).cap == "off"


def test_sweep_cap_ctrl_c_writes_partial_and_no_cap(tmp_path, monkeypatch):
    calls = {"n": 0}
    inner = scripted({1: {3: 1.2}, 2: {3: 1.2}})

    def measure(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return inner(*a, **k)

    monkeypatch.setattr(sweep, "measure", measure)
    r = run("sweep-cap", "--widths", "1,2", "--num-draft-tokens", "3", "--repeats", "1", "--no-warmup", "--write",
            "--out", str(tmp_path))
    assert r.code == 130 and r.stderr.strip().splitlines()[-1].startswith("gmlx: error: interrupted")
    saved = json.loads(only(tmp_path, "sweep-*.json").read_text())
    assert len(saved["measurements"]) == 2 and saved["recommended_cap"] is None
    assert not Path(os.environ["GMLX_CONFIG"]).exists()


def test_recommend_rule():
    rows = lambda *s: [{"width": w, "speedup": x} for w, x in zip((1, 2, 4, 8), s)]  # noqa: E731
    assert recommend.recommend(rows(1.3, 1.2, 1.04, 1.5), 1.05) == 2  # stops at the first loss, even if 8 wins
    assert recommend.recommend(rows(1.3, 1.2, 1.1, 1.06), 1.05) == 8
    assert recommend.recommend(rows(0.9, 1.5), 1.05) == 2  # width 1 is the scalar loop: the cap does not gate it
    assert recommend.recommend(rows(1.3, 1.0), 1.05) == "off"
    assert recommend.recommend(rows(1.2, float("nan")), 1.05) == "off"


# -- workload and live view, without the model -------------------------------------------------
def test_workload_parsing_and_arrivals(tmp_path):
    assert parse_token_range("32-64") == (32, 64) and parse_token_range("8") == (8, 8)
    plain = tmp_path / "p.txt"
    plain.write_text("first\n\nsecond\n")
    assert [s.prompt for s in load_prompt_specs(plain)] == ["first", "second"]
    specs = load_prompt_specs(None)
    stag = build_requests(specs, 4, Arrival("staggered", stagger_s=0.5), (4, 8), 0.0, seed=7)
    assert [r.arrival_s for r in stag] == [0.0, 0.5, 1.0, 1.5] and [r.params.seed for r in stag] == [7, 8, 9, 10]
    assert all(4 <= r.params.max_tokens <= 8 for r in stag)
    pois = build_requests(specs, 5, Arrival("poisson", rate=10.0), (4, 4), 0.0, seed=7)
    assert pois == build_requests(specs, 5, Arrival("poisson", rate=10.0), (4, 4), 0.0, seed=7)  # replayable
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(pois, pois[1:]))
    jl = build_requests(specs, 3, Arrival("join-late", join_after_s=0.2), (4, 8), 0.0, seed=7)
    assert jl[0].params.max_tokens == 32 and not jl[0].after_start
    assert all(r.after_start and r.arrival_s == 0.2 for r in jl[1:])
    with pytest.raises(InvalidRequest):
        build_requests(specs, 0, Arrival(), (4, 4), 0.0, seed=0)


class FakeBackend(Backend):
    """One token per live request per step; finishes at the budget. Records the peak in flight."""

    def __init__(self):
        self.live, self.peak, self.next_id, self.log = {}, 0, 0, []

    def submit(self, prompt_ids, params):
        rid, self.next_id = self.next_id, self.next_id + 1
        self.live[rid] = [params.max_tokens, []]
        self.peak = max(self.peak, len(self.live))
        self.log.append(("submit", rid))
        return rid

    def step(self):
        self.log.append(("step", None))
        rows, fin = [], []
        for rid, st in list(self.live.items()):
            st[1].append(5)
            rows.append((rid, 0, 0, 1))
            if len(st[1]) == st[0]:
                fin.append(Event(EventKind.FINISH, Mode.GATED, 1, rid=rid))
        return [Event(EventKind.ROUND, Mode.GATED, len(rows), rows=tuple(rows), round=Round.PLAIN)] + fin

    def result(self, rid):
        return self.live.pop(rid)[1], "length", {}

    @property
    def has_work(self):
        return bool(self.live)

    def close(self):
        pass


def test_drive_respects_concurrency_and_join_late():
    specs = load_prompt_specs(None)[:2]
    reqs = build_requests(specs, 5, Arrival("burst"), (2, 3), 0.0, seed=1)
    be = FakeBackend()
    outs = drive(be, reqs, {r.request_id: [1, 2] for r in reqs}, concurrency=2)
    assert be.peak == 2 and len(outs) == 5
    assert all(len(o.tokens) == o.request.params.max_tokens and o.ttft_s is not None for o in outs)
    jl = build_requests(specs, 3, Arrival("join-late", join_after_s=0.0), (2, 2), 0.0, seed=1)
    be = FakeBackend()
    drive(be, jl, {r.request_id: [1] for r in jl}, concurrency=3)
    assert be.log[:3] == [("submit", 0), ("step", None), ("submit", 1)]  # waiters meet a running request


def test_live_view_from_events_only():
    t = {"now": 0.0}
    view = LiveView(total=3, file=io.StringIO(), rich=True, clock=lambda: t["now"])
    view.begin("gmlx c=2 rep 0", speculative=True, cap="4")
    view.submitted(0)
    view.submitted(1)
    t["now"] = 0.1
    view.on_event(Event(EventKind.ROUND, Mode.BATCHED, 2, 0.01, rows=((0, 3, 2, 3), (1, 3, 0, 1)), round=Round.SPECULATIVE))
    view.on_event(Event(EventKind.TRANSITION, Mode.GATED, 2, transition=Transition.GATE, reason="x"))
    t["now"] = 0.2
    view.on_event(Event(EventKind.ROUND, Mode.GATED, 2, 0.01, rows=((0, 0, 0, 1), (1, 0, 0, 1)), round=Round.PLAIN))
    view.on_event(Event(EventKind.FINISH, Mode.GATED, 2, rid=1, stats={}))
    assert "mode Gated" in view.header() and "width 2" in view.header() and "gate 1" in view.header()
    assert view.rows() == [("0", "gated", "4", "67%", "3.00", "30.0", "100ms")]
    from rich.console import Console

    buf = io.StringIO()
    Console(file=buf, width=120).print(view.render())
    assert "1/3 requests" in buf.getvalue() and "gated" in buf.getvalue()
    plain = io.StringIO()
    view = LiveView(total=1, file=plain, rich=False)
    view.begin("arm c=1 rep 0")
    view.submitted(0)
    view.on_event(Event(EventKind.ROUND, Mode.SCALAR, 1, rows=((0, 3, 3, 4),), round=Round.SCALAR))
    view.on_event(Event(EventKind.FINISH, Mode.SCALAR, 1, rid=0))
    view.end()
    lines = plain.getvalue().splitlines()
    assert lines[0] == "== arm c=1 rep 0 (cap -)" and lines[1].startswith("   id 0 tokens 4 accept 100%")


def test_sampling_params_carry_seed_and_budget():
    (req,) = build_requests(load_prompt_specs(None), 1, Arrival(), (8, 8), 0.5, seed=3, ignore_eos=True)
    assert req.params == SamplingParams(temperature=0.5, max_tokens=8, seed=3, ignore_eos=True).validated()


def test_sweep_measures_the_lone_request_on_several_prompts(lm, prompts, monkeypatch):
    """Width 1 is calibrated on LONE_PROMPTS prompts, each decoded alone (acceptance varies by prompt)."""
    from gmlx import Engine, EngineConfig

    seen = []
    real = Engine.submit

    def spy(self, prompt, params=None, **kw):
        seen.append((list(prompt), len(self.live_rows()) + self.service.queued))
        return real(self, prompt, params, **kw)

    monkeypatch.setattr(Engine, "submit", spy)
    m = sweep.measure(lm, prompts[:6], 1, 5, EngineConfig(speculative=False))
    assert [p for p, _ in seen] == prompts[:sweep.LONE_PROMPTS] and all(busy == 0 for _, busy in seen)
    assert m["tokens"] > 0
