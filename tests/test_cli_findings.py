"""What a first user of `gmlx` found (issue 10): each finding, as the user would meet it.

Bench and sweep-cap runs are tiny (a few requests of a few tokens); the sweep's measurements are
scripted where only the reporting is under test. Timing is never asserted.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from rich.console import Console
from cli_helpers import use_model
from test_bench_cli import only, run, scripted

from gmlx.config import SamplingParams
from gmlx.engine.metrics import EventKind
from gmlx_cli import app as app_mod
from gmlx_cli.bench import plots, recommend, results, sweep
from gmlx_cli.bench.summary import summary_notes, summary_tables
from gmlx_cli.bench.arms import Arm, Run
from gmlx_cli.bench.live import LiveView, print_table, rich_table
from gmlx_cli.bench.driver import Outcome
from gmlx_cli.bench.workload import Request

TINY = ("--no-warmup", "--seed", "1")


@pytest.fixture(autouse=True)
def model(lm, monkeypatch, tmp_path):
    """The session's model (tests may swap in a variant through `use`); a throwaway user config."""
    holder = {"lm": lm}
    from gmlx.models.loading import load

    use_model(monkeypatch, lambda path: holder["lm"] if path is None else load(path))
    monkeypatch.setenv("GMLX_CONFIG", str(tmp_path / "config.toml"))
    for name in ("GMLX_MTP_PREEMPT", "GMLX_MTP_RESUME", "GMLX_MTP_WIDTH_CAP"):
        monkeypatch.delenv(name, raising=False)
    return holder


def errors(r) -> list[str]:
    return [ln for ln in r.stderr.splitlines() if ln.startswith("gmlx: error: ")]


# -- a. sweep-cap: the recommendation, the table and the plot agree -----------------------------
def test_sweep_off_names_the_width_that_lost(tmp_path, monkeypatch):
    # The user's case: width 2 loses, width 4 wins; a cap cannot skip width 2, so "off".
    monkeypatch.setattr(sweep, "measure", scripted({1: {3: 0.84}, 2: {3: 0.44}, 4: {3: 1.17}}))
    seen = {}
    real_plot = plots.plot_sweep
    monkeypatch.setattr(plots, "plot_sweep", lambda *a: seen.setdefault("args", a) and real_plot(*a))
    r = run("sweep-cap", "--widths", "1,2,4", "--num-draft-tokens", "3", "--repeats", "1", "--no-warmup", "--json",
            "--out", str(tmp_path))
    assert r.code == 0, r.stderr
    obj = json.loads(r.stdout)
    assert obj["recommended_cap"] == "off"
    line = next(ln for ln in r.stderr.splitlines() if ln.startswith("recommended speculative_width_cap"))
    assert "never" not in line
    assert "width 2" in line and "0.44x" in line and "1.05x margin" in line and "4 (1.17x) won" in line
    assert obj["recommendation"] in line
    rows = {ln.split()[0]: ln.split() for ln in r.stderr.splitlines() if re.match(r"^[124] ", ln)}
    # ... wins, ideal speedup, achieved/ideal (no rounds counted by this stub: -), at cap
    assert rows["4"][-4:] == ["yes", "-", "-", "plain"] and rows["2"][-4:] == ["no", "-", "-", "plain"]
    # width 1 lost too (0.84x): a lone request is calibrated plain here (K = 0 at width 1)
    assert rows["1"][-1] == "plain" and obj["num_draft_tokens_by_width"] == {"1": 0}
    assert "a lone request: plain" in r.stderr
    assert seen["args"][1] == "off" and seen["args"][4] == obj["recommendation"]  # the plot's caption
    assert only(tmp_path, "sweep-*.png").stat().st_size > 0


def test_sweep_explanations():
    rows = lambda *s: [{"width": w, "speedup": x} for w, x in zip((1, 2, 4, 8), s)]  # noqa: E731
    summary = rows(1.3, 1.2, 1.04, 1.5)
    cap = recommend.recommend(summary, 1.05)
    why = recommend.explain(summary, 1.05, cap)
    assert cap == 2 and "up to 2" in why and "width 4" in why and "1.04x" in why and "8 (1.50x) won" in why
    assert [recommend.at_cap(w, cap) for w in (1, 2, 4, 8)] == ["scalar", "spec", "plain", "plain"]
    assert "every measured width up to 8" in recommend.explain(rows(1.3, 1.2, 1.1, 1.06), 1.05, 8)
    assert "no batch width >= 2" in recommend.explain(rows(1.3), 1.05, "off")
    assert "unmeasured" in recommend.explain(rows(1.2, math.nan), 1.05, "off")


# -- b. defaults fit the context; an explicit value that cannot fit names its flag -------------
@pytest.fixture
def short_context(lm, model, tmp_path):
    """The model with a 24-token context, and prompts of 5, 2 and 3 tokens."""
    model["lm"] = dataclasses.replace(lm, context_length=24)
    path = tmp_path / "p.txt"
    path.write_text("def f(x):\nimport os\nx = 1\n")
    return path


def test_join_late_default_long_budget_is_clamped_with_a_notice(short_context, tmp_path):
    r = run("bench", "--arrival", "join-late", "--join-after", "0", "--max-tokens", "6", "--requests", "3",
            "--concurrency", "3", "--prompts", str(short_context), "--ignore-eos", *TINY, "--json",
            "--out", str(tmp_path))
    assert r.code == 0, r.stderr
    assert ("gmlx: notice: join-late: the long request's default budget (4 x --max-tokens = 24) does not fit the"
            " model's context of 24 tokens after its 5-token prompt; it gets 19") in r.stderr
    budgets = {q["request_id"]: q["max_tokens"] for q in json.loads(r.stdout)["requests"]}
    assert budgets == {0: 19, 1: 6, 2: 6}


def test_explicit_long_tokens_that_cannot_fit_is_an_error_naming_the_flag(short_context):
    r = run("bench", "--arrival", "join-late", "--long-tokens", "100", "--max-tokens", "4", "--requests", "3",
            "--prompts", str(short_context), *TINY)
    assert r.code == 1 and "==" not in r.stdout, r.stdout  # nothing ran
    (err,) = errors(r)
    assert "--long-tokens 100 does not fit the model's context of 24 tokens" in err and "--long-tokens 19 or less" in err


def test_max_tokens_advice_holds_for_every_prompt(short_context, tmp_path, monkeypatch):
    # Request 0 (5 tokens) is the longest prompt: the advice is 24 - 5 = 19, whichever request
    # the engine would have met first, and following it passes.
    r = run("bench", "--max-tokens", "20", "--requests", "3", "--prompts", str(short_context), *TINY)
    (err,) = errors(r)
    assert r.code == 1 and "--max-tokens 20 does not fit" in err and "use --max-tokens 19 or less" in err
    r = run("bench", "--max-tokens", "10-22", "--requests", "3", "--prompts", str(short_context), *TINY)
    assert "use --max-tokens a range up to 19" in errors(r)[0]
    from gmlx_cli.bench import bench

    monkeypatch.setattr(bench, "run_matrix", lambda *a, **k: None)  # only the checks are under test
    r = run("bench", "--max-tokens", "19", "--requests", "3", "--prompts", str(short_context), *TINY,
            "--out", str(tmp_path))
    assert r.code == 0, r.stderr


def test_sweep_max_tokens_that_cannot_fit_is_an_error_before_measuring(short_context, monkeypatch):
    monkeypatch.setattr(sweep, "measure", lambda *a, **k: pytest.fail("measured"))
    r = run("sweep-cap", "--widths", "1,2", "--max-tokens", "30", "--prompts", str(short_context), "--no-warmup")
    (err,) = errors(r)
    assert r.code == 1 and "--max-tokens 30 does not fit" in err and "use --max-tokens 19 or less" in err


# -- c. a bad --out is reported before any work ------------------------------------------------
@pytest.mark.parametrize("command", [("bench",), ("sweep-cap",)])
@pytest.mark.parametrize("kind", ["existing file", "below a file"])
def test_bad_out_is_reported_before_any_work(command, kind, tmp_path, monkeypatch):
    use_model(monkeypatch, lambda path: pytest.fail("the model was loaded"))
    blocker = tmp_path / "results.txt"
    blocker.write_text("not a directory")
    out = blocker if kind == "existing file" else blocker / "sub"
    r = run(*command, "--out", str(out))
    (err,) = errors(r)
    assert r.code == 1 and r.stdout == "" and err.startswith(f"gmlx: error: --out {str(out)!r}"), r.stderr


def test_out_is_not_created_by_the_check(tmp_path):
    out = tmp_path / "a" / "b"
    r = run("bench", "--out", str(out), "--concurrency", "0")  # fails after the --out check
    assert r.code == 1 and not (tmp_path / "a").exists()


# -- d, e, h. the summary: 80 columns, `-` where nothing was drafted, partial cells marked ------
def _outcome(rid: int, tokens: int, drafted: int, finish: str = "length") -> Outcome:
    req = Request(rid, "p", SamplingParams(max_tokens=8, seed=rid).validated(), 0.0)
    o = Outcome(req, [1, 2, 3], submit_s=0.0, finish_reason=finish, tokens=[7] * tokens)
    o.chunks = [(0.01 * (i + 1), 1) for i in range(tokens)]
    o.stats = {"num_drafted": drafted, "num_accepted": drafted // 2, "num_rounds": 1 if drafted else 0,
               "draft_acceptance_rate": 0.5 if drafted else 0.0, "mean_acceptance_length": 1.5 if drafted else 0.0}
    return o


def _runs():
    spec, ab = Arm("gmlx"), Arm("gmlx-preempt1-resume0", resume=False)
    over_cap = Run(spec, 16, 0, outcomes=[_outcome(0, 8, 0), _outcome(1, 8, 0)], complete=True)
    drafting = Run(spec, 1, 0, outcomes=[_outcome(0, 8, 6), _outcome(1, 0, 3, "stop")], complete=True)
    cut = Run(ab, 16, 0, outcomes=[_outcome(0, 3, 2, "cancelled")], complete=False)
    return [drafting, over_cap, cut]


def test_nothing_drafted_shows_a_dash_and_partial_cells_are_marked():
    runs = _runs()
    req = results.requests_frame(runs)
    cells = results.cells_frame(runs, req, repeats=1)
    by = {(c.arm, c.concurrency): c for c in cells.itertuples()}
    assert math.isnan(by["gmlx", 16].draft_acceptance_rate) and math.isnan(by["gmlx", 16].mean_acceptance_length)
    assert by["gmlx", 1].draft_acceptance_rate == pytest.approx(4 / 9)
    assert [c.partial for c in cells.itertuples()] == [False, False, True]
    (_, cols, rows), (_, scols, srows) = summary_tables(cells)
    buf = io.StringIO()
    print_table("t", scols, srows, buf)
    over = next(ln for ln in buf.getvalue().splitlines() if ln.startswith("gmlx ") and " 16 " in ln)
    assert over.split()[2:4] == ["-", "-"]
    assert [r[0] for r in rows] == ["gmlx", "gmlx", "gmlx-preempt1-resume0*"]
    notes = summary_notes(cells, req)
    assert any(n.startswith("* partial") for n in notes)
    assert any("request 1 ended at EOS before its first token (gmlx c=1)" in n for n in notes)


def test_summary_fits_80_columns_without_cutting_a_cell():
    worst = {"arm": "gmlx-preempt1-resume0", "concurrency": 16, "speculative": True, "switch_preempt": True,
             "switch_resume": False, "repeats": 3, "requests": 48, "tokens": 99999, "ttft_p50_s": 12.3456,
             "ttft_p95_s": 98.7654, "itl_p50_s": 1.2345, "itl_p95_s": 9.8765, "tokens_per_s_p50": 123.45,
             "aggregate_tokens_per_s": 9876.5, "num_drafted": 9, "num_accepted": 3, "draft_acceptance_rate": 0.3333,
             "mean_acceptance_length": 3.1416, "preempt": 1234, "gate": 1234, "resume": 1234, "capture": 1234,
             "partial": True, "eos_first": 2, "num_rounds": 3, "speedup_vs_plain": 1.2345, "ideal_speedup": 1.5678,
             "achieved_over_ideal": 0.7874}
    cells = pd.DataFrame([worst, {**worst, "arm": "mlx-lm-stream", "partial": False}])
    for title, cols, rows in summary_tables(cells):
        buf = io.StringIO()
        Console(file=buf, width=80, highlight=False).print(rich_table(title, cols, rows))
        text = buf.getvalue()
        assert "…" not in text and max(map(len, text.splitlines())) <= 80, text
        assert len(text.splitlines()) == 1 + 2 + len(rows), text  # title, two header lines: nothing folded
        assert re.search(r"^gmlx-preempt1-resume0\*\s+16\s", text, re.M), text
        plain = io.StringIO()
        print_table(title, cols, rows, plain)
        assert max(map(len, plain.getvalue().splitlines())) <= 80, plain.getvalue()


def test_ctrl_c_cell_is_partial_in_table_json_and_csv(tmp_path, monkeypatch):
    seen = {"finished": 0}
    real = LiveView.on_event

    def on_event(self, ev):
        real(self, ev)
        seen["finished"] += ev.kind is EventKind.FINISH
        if seen["finished"] == 2 and ev.kind is EventKind.ROUND:  # the second cell, mid-run
            raise KeyboardInterrupt

    monkeypatch.setattr(LiveView, "on_event", on_event)
    r = run("bench", "--concurrency", "1,2", "--requests", "2", "--max-tokens", "6", *TINY, "--ignore-eos",
            "--out", str(tmp_path))
    assert r.code == 130
    saved = json.loads(only(tmp_path, "bench-*.json").read_text())
    assert [(c["concurrency"], c["partial"]) for c in saved["cells"]] == [(1, False), (2, True)]
    assert list(pd.read_csv(only(tmp_path, "bench-*-cells.csv")).partial) == [False, True]
    assert re.search(r"^gmlx\*\s+2 ", r.stdout, re.M) and re.search(r"^gmlx\s+1 ", r.stdout, re.M)
    assert "* partial: interrupted" in r.stdout


# -- f. a seed drawn at random is on screen -----------------------------------------------------
def test_generate_shows_a_drawn_seed_only():
    r = run("generate", "def f(x):\n", "--max-tokens", "2", "--temp", "0.7")
    assert r.code == 0, r.stderr
    seed = re.search(r"seed:\s+(\d+) \(drawn at random; --seed \1 repeats this run\)", r.stderr)
    assert seed, r.stderr
    r = run("generate", "def f(x):\n", "--max-tokens", "2", "--temp", "0.7", "--seed", seed.group(1))
    assert r.code == 0 and "seed" not in r.stderr  # chosen by the user: nothing to report without -v


def test_bench_shows_a_drawn_seed(tmp_path):
    r = run("bench", "--concurrency", "2", "--requests", "2", "--max-tokens", "2", "--no-warmup",
            "--out", str(tmp_path))
    assert r.code == 0, r.stderr
    seed = re.search(r"^seed: (\d+) \(drawn at random; --seed \1 replays this workload\)$", r.stdout, re.M)
    saved = json.loads(only(tmp_path, "bench-*.json").read_text())
    assert seed and saved["meta"]["seed"] == int(seed.group(1)) and saved["meta"]["seed_drawn"] is True


# -- g. importing mlx.core first warns once -----------------------------------------------------
@pytest.mark.skipif(sys.platform != "linux", reason="only Linux loads OpenBLAS")
@pytest.mark.parametrize("code,env,warns", [
    ("import mlx.core\nimport gmlx\ngmlx.blas.warn_if_reference()", {}, True),
    ("import gmlx\nimport mlx.core", {}, False),
    ("import mlx.core\nimport gmlx", {"GMLX_OPENBLAS": "0"}, False),
], ids=["mlx first", "gmlx first", "opted out"])
def test_import_order_warning(code, env, warns):
    base = {k: v for k, v in os.environ.items() if k != "GMLX_OPENBLAS"}
    p = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if "gmlx" in ln]
    if warns:
        assert len(lines) == 1 and "mlx.core was imported before gmlx" in lines[0], p.stderr
        assert "import gmlx before mlx" in lines[0] and lines[0].startswith("<string>:2: RuntimeWarning")
    else:
        assert lines == [], p.stderr


# -- i. a corrupt weights file is a one-line user error naming it -------------------------------
def _copy_with_truncated(src: Path, dst: Path, name: str) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("draft"), copy_function=os.link)
    f = dst / name
    data = f.read_bytes()
    f.unlink()  # a hard link: write a new file, never into the shipped one
    f.write_bytes(data[: len(data) // 2])
    return f


@pytest.mark.parametrize("name", ["model.safetensors", "mtp_head.safetensors"])
def test_truncated_weights_name_the_file(lm, tmp_path, name):
    bad = _copy_with_truncated(lm.path, tmp_path / "m", name)
    r = run("generate", "x", "--max-tokens", "2", "--model", str(tmp_path / "m"))
    (err,) = errors(r)
    assert r.code == 1 and "internal error" not in err and "Traceback" not in r.stderr
    assert f"the weights file {str(bad)!r} is truncated or corrupt" in err


def test_truncated_draft_model_names_the_file(lm, tmp_path):
    src = lm.path / "draft"
    if not (src / "model.safetensors").is_file():
        pytest.skip("the embedded model ships no draft model")
    bad = _copy_with_truncated(src, tmp_path / "d", "model.safetensors")
    r = run("generate", "x", "--max-tokens", "2", "--draft-model", str(tmp_path / "d"))
    (err,) = errors(r)
    assert r.code == 1 and f"the weights file {str(bad)!r} is truncated or corrupt" in err


# -- j. an unknown option is reported plainly ---------------------------------------------------
@pytest.mark.parametrize("args,suggestion", [
    (("generate", "x", "--bogus"), None),
    (("bench", "--bogus"), None),
    (("generate", "x", "--verbos"), "--verbose"),
    (("bench", "--max-token", "3"), "--max-tokens"),
    (("bench", "--concurency", "2"), "--concurrency"),
    (("generate", "x", "--temperature", "0"), "--temp"),
])
def test_unknown_option(args, suggestion):
    r = run(*args)
    (err,) = errors(r)
    option = next(a for a in args if a.startswith("--"))
    assert r.code == 2 and f"no such option: {option}" in err
    if suggestion is None:
        assert "did you mean" not in err and "Possible" not in err
    else:
        assert f"(did you mean {suggestion}?)" in err
    assert app_mod.close_options("--bogus", ["--verbose", "--out", "--debug"]) == []


# -- l. requests that end at EOS before their first token ---------------------------------------
def test_eos_first_requests_are_counted_and_named(lm, model, tmp_path):
    from engine_helpers import with_eos

    from gmlx.engine.oracle import run_scalar

    prompt = "def add(a, b):\n"
    first = run_scalar(lm, lm.tokenizer.encode(prompt), SamplingParams(max_tokens=1), speculative=False).tokens[0]
    model["lm"] = with_eos(lm, (first,))
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": p}) for p in (prompt, "import os\n")) + "\n")
    r = run("bench", "--concurrency", "2", "--requests", "3", "--max-tokens", "4", "--prompts", str(path), *TINY,
            "--json", "--out", str(tmp_path / "out"))
    assert r.code == 0, r.stderr
    obj = json.loads(r.stdout)
    eos = sorted(q["request_id"] for q in obj["requests"] if q["eos_first"])
    assert 0 in eos and 2 in eos  # both carry the prompt whose first token is now EOS
    for q in obj["requests"]:
        if q["eos_first"]:
            assert q["tokens"] == [] and q["ttft_s"] is None and q["tokens_per_s"] is None
    assert obj["cells"][0]["eos_first"] == len(eos)
    assert f"requests {', '.join(map(str, eos))} ended at EOS before their first token (every cell)" in r.stderr
    assert "(finished before its first token)" in r.stderr  # the live lines, not "TTFT None"
    assert "None" not in r.stderr


def test_generate_eos_first_explains_the_missing_ttft(lm, model):
    from engine_helpers import with_eos

    from gmlx.engine.oracle import run_scalar

    prompt = "def add(a, b):\n"
    first = run_scalar(lm, lm.tokenizer.encode(prompt), SamplingParams(max_tokens=1), speculative=False).tokens[0]
    model["lm"] = with_eos(lm, (first,))
    r = run("generate", prompt, "--max-tokens", "4", "--temp", "0")
    assert r.code == 0, r.stderr
    assert re.search(r"TTFT:\s+- \(ended at EOS before the first token\)", r.stderr), r.stderr
    assert "None" not in r.stderr
