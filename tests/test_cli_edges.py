"""The smaller CLI findings of issue 18, each as the user meets it: a fast --help, option names
whole at 80 columns, what --model takes, the stats of greedy, one-token and interrupted runs,
contradicting options, the install hints, the float16-on-CPU notice, serve's shutdown line and
/metrics, and the GGUF conversion cache. Timing is never asserted."""

from __future__ import annotations

import inspect
import json
import os
import shutil
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest
from cli_helpers import use_model
from test_cli import assert_one_line_error, run

from gmlx.request_stats import RequestStats
from gmlx.engine.stream import Stream
from gmlx_cli import app as app_mod
from gmlx_cli import ui

PROMPT = "def fibonacci(n):\n"


@pytest.fixture(autouse=True)
def session_model(lm, monkeypatch):
    use_model(monkeypatch, lambda path: lm)


def stats(stderr: str) -> dict[str, str]:
    """The `key: value` rows of the stats block."""
    block = stderr.split("==========", 1)[1] if "==========" in stderr else ""
    return {k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in block.splitlines() if ":" in ln)
            if not k.startswith("gmlx")}


# -- 1. --help imports no command module's heavy dependencies ----------------------------------
def test_help_does_not_import_the_heavy_libraries():
    code = ("import sys, gmlx_cli.app, gmlx_cli.generate, gmlx_cli.serve, gmlx_cli.doctor, gmlx_cli.convert\n"
            "from gmlx_cli.app import main\n"
            "for args in (['--help'], ['generate', '--help'], ['serve', '--help']):\n"
            "    try:\n"
            "        main(args)\n"
            "    except SystemExit as e:\n"
            "        assert e.code == 0, e.code\n"
            "print(sorted(m for m in ('mlx_lm', 'transformers', 'pandas', 'matplotlib', 'gmlx.engine.engine')"
            " if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "COLUMNS": "100"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]", r.stdout[-500:]


def test_the_command_list_shows_each_commands_own_docstring():
    """`gmlx --help` reads the docstrings from source (no import); they are the commands' own."""
    r = run("--help")
    assert r.code == 0
    for name, (module, function) in app_mod.COMMANDS.items():
        real = app_mod.build_command(name)
        assert app_mod.docstring_of(module, function) == inspect.cleandoc(real.help), name
        assert name in r.stdout


def test_a_mistyped_command_is_still_suggested():
    r = run("genrate")
    assert r.code == 2 and "Did you mean 'generate'?" in r.stderr


# -- 2. option names are never cut at 80 columns -------------------------------------------------
@pytest.mark.parametrize("command", list(app_mod.COMMANDS))
def test_option_names_are_whole_at_80_columns(command):
    r = run(command, "--help", env={"COLUMNS": "80", "TERMINAL_WIDTH": "80"})
    assert r.code == 0, r.stderr
    assert max(len(ln) for ln in r.stdout.splitlines()) <= 80
    assert "…" not in r.stdout
    names = [o for p in app_mod.build_command(command).params for o in (*p.opts, *p.secondary_opts)
             if o.startswith("--")]
    for name in names:
        assert name in r.stdout, (command, name)


# -- 3. what --model takes -----------------------------------------------------------------------
def test_model_help_names_every_kind_of_model():
    r = run("generate", "--help", env={"COLUMNS": "200"})
    # rich may still wrap the help column (its console width can come from an earlier test in the
    # same worker): drop the panel's borders so a phrase wrapped across lines reads whole again
    text = " ".join(r.stdout.replace("│", " ").split())
    for needle in ("mlx-lm model directory", ".gguf file", "smollm2", "never downloads"):
        assert needle in text, needle


# -- 4. a greedy run shows no seed (it cannot change the output); -v still does ------------------
def test_greedy_run_has_no_seed_line_unless_verbose():
    r = run("generate", PROMPT, "--max-tokens", "4", "--temp", "0")
    assert r.code == 0 and "seed" not in stats(r.stderr), r.stderr
    r = run("generate", PROMPT, "--max-tokens", "4", "--temp", "0", "-v")
    assert r.code == 0 and stats(r.stderr)["seed"].isdigit(), r.stderr
    r = run("generate", PROMPT, "--max-tokens", "4", "--temp", "0.8")
    seed = stats(r.stderr)["seed"]
    assert "drawn at random" in seed and "--seed" in seed


# -- 5. one token: no rate, not 0.0 --------------------------------------------------------------
def test_one_token_has_no_decode_rate():
    r = run("generate", PROMPT, "--max-tokens", "1", "--temp", "0")
    assert r.code == 0, r.stderr
    row = stats(r.stderr)["generation"]
    assert row.startswith("1 token, - tokens/s"), row
    out = json.loads(run("generate", PROMPT, "--max-tokens", "1", "--temp", "0", "--json").stdout)
    assert len(out["tokens"]) == 1 and out["tokens_per_s"] is None


def test_request_stats_rate_needs_a_decode_interval():
    s = RequestStats(num_generated=1, t_first_token=1.0, t_end=2.0)
    assert s.tokens_per_s is None and s.as_dict()["tokens_per_s"] is None
    assert RequestStats(num_generated=3, t_first_token=1.0, t_end=1.0).tokens_per_s is None  # all in one round
    assert RequestStats(num_generated=3, t_first_token=1.0, t_end=2.0).tokens_per_s == 2.0


# -- 6. Ctrl-C: the stats so far, then "interrupted", exit 130 -----------------------------------
def test_ctrl_c_prints_the_partial_stats_and_exits_130(monkeypatch):
    real_iter = Stream.__iter__

    def interrupted_after_3(self):
        for i, piece in enumerate(real_iter(self)):
            if i == 3:
                raise KeyboardInterrupt
            yield piece

    monkeypatch.setattr(Stream, "__iter__", interrupted_after_3)
    r = run("generate", PROMPT, "--max-tokens", "64", "--temp", "0", "-v")
    assert r.code == 130, r.stderr
    rows = stats(r.stderr)
    assert rows["finish reason"] == "cancelled"
    assert int(rows["generation"].split()[0]) >= 3
    assert r.stderr.strip().splitlines()[-1] == "gmlx: error: interrupted"


# -- 7. --no-speculative with a drafting option is a usage error, before the load ------------------
@pytest.mark.parametrize("extra", [("--drafter", "ngram"), ("--draft-model", "some/dir"), ("--num-draft-tokens", "2")])
@pytest.mark.parametrize("command", ["generate", "serve"])
def test_no_speculative_with_a_drafting_option_is_a_usage_error(command, extra, monkeypatch):
    use_model(monkeypatch, lambda path: pytest.fail("the model was loaded"))
    args = (PROMPT,) if command == "generate" else ("--port", "0")
    r = run(command, *args, "--no-speculative", *extra)
    assert_one_line_error(r, "--no-speculative", extra[0], "drop", code=2)


# -- 8. a model that is not there says what --model takes ----------------------------------------
def test_a_hugging_face_id_says_how_to_get_a_local_copy(monkeypatch):
    use_model(monkeypatch, None)
    r = run("generate", "x", "--model", "HuggingFaceTB/SmolLM2-135M-Instruct")
    assert_one_line_error(r, "never downloads", ".gguf", "smollm2", "mlx_lm.convert --hf-path"
                          " HuggingFaceTB/SmolLM2-135M-Instruct", "huggingface-cli download")
    r = run("generate", "x", "--model", "/no/such-dir")
    assert_one_line_error(r, "does not exist", "mlx-lm directory", ".gguf", "smollm2", "never downloads")
    assert "huggingface-cli" not in r.stderr


# -- 9. the install hint fits the installation ---------------------------------------------------
def test_install_hint_for_a_checkout_and_for_an_installed_package(monkeypatch, tmp_path):
    assert ui.install_extra("serve").startswith("pip install -e ") and "[serve]" in ui.install_extra("serve")
    monkeypatch.setattr(ui, "__file__", str(tmp_path / "site-packages" / "gmlx_cli" / "ui.py"))
    assert ui.install_extra("client") == "pip install 'gmlx[client]'"


def test_serve_without_its_extra_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "gmlx.serve", None)  # as if starlette & co. were missing
    r = run("serve", "--port", "0")
    assert_one_line_error(r, "gmlx serve needs the web dependencies", ui.install_extra("serve"))


# -- 10. float16 weights on the CPU: one notice --------------------------------------------------
def test_float16_weights_on_the_cpu_get_a_notice(lm, tmp_path, monkeypatch):
    from test_gguf_tiny import tiny_llama

    from gmlx.models.loading import load

    assert ui.slow_dtype_notice(lm) is None  # the test model: float32
    tiny_llama(tmp_path / "tiny.gguf")  # F16 tensors: a "q" conversion keeps them float16
    monkeypatch.setenv("GMLX_CACHE", str(tmp_path / "cache"))
    half = load(tmp_path / "tiny.gguf", drafter=False)
    line = ui.slow_dtype_notice(half)
    assert line is not None and "float16" in line and "--dtype float32" in line
    assert f"gmlx convert {(tmp_path / 'tiny.gguf').resolve()}" in line
    use_model(monkeypatch, None)  # from disk, as every command loads
    r = run("doctor", "--model", str(tmp_path / "tiny.gguf"))
    notices = [ln for ln in r.stderr.splitlines() if "decode slowly on the CPU" in ln]
    assert len(notices) == 1 and notices[0].startswith("gmlx: notice: "), r.stderr


# -- 11. serve says it is shutting down ----------------------------------------------------------
def test_serve_shutdown_says_what_it_cancels(capsys):
    from gmlx.serve.server import Server

    closed = []
    engine = SimpleNamespace(service=SimpleNamespace(open_streams=3), close=lambda: closed.append(True))
    app = SimpleNamespace(state=SimpleNamespace(api=SimpleNamespace(engine=engine, closing=False)))
    server = Server(app)
    server.handle_exit(signal.SIGTERM, None)
    server.handle_exit(signal.SIGINT, None)  # the second signal forces the exit: no second line
    err = capsys.readouterr().err
    assert err.splitlines() == ["gmlx: notice: shutting down (SIGTERM): 3 requests cancelled"]
    assert app.state.api.closing


# -- 12. /metrics without *_created --------------------------------------------------------------
def test_metrics_text_has_no_created_series():
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

    from gmlx.serve.prometheus import _WithoutCreated

    r = CollectorRegistry()
    Counter("gmlx:x", "x", registry=r).inc()
    Histogram("gmlx:y_seconds", "y", registry=r).observe(0.1)
    assert b"_created" in generate_latest(r)  # what prometheus_client adds by default
    text = generate_latest(_WithoutCreated(r)).decode()
    assert "_created" not in text and "gmlx:x_total 1.0" in text and "gmlx:y_seconds_count 1.0" in text


# -- 13. GGUF conversions: keyed by content, stale ones removed ----------------------------------
def test_gguf_cache_is_keyed_by_content_and_prunes_stale_conversions(tmp_path, monkeypatch):
    from gmlx.gguf import convert as gguf

    monkeypatch.setenv("GMLX_CACHE", str(tmp_path / "cache"))
    root = tmp_path / "cache" / "gguf"
    root.mkdir(parents=True)
    venv1 = _tiny(tmp_path / "venv1", seed=0)
    # Before: the same file converted under an old (mtime) key; another version of the file from a
    # virtualenv since deleted; a different file of the same name, still in place; another dtype.
    old_key = gguf.convert_gguf(venv1, root / "tiny-q-oldmtimekey")
    gone = gguf.convert_gguf(_tiny(tmp_path / "gone", seed=1), root / "tiny-q-gonevenv")
    shutil.rmtree(tmp_path / "gone")
    other = gguf.cached_conversion(_tiny(tmp_path / "other", seed=2))
    as_f32 = gguf.cached_conversion(venv1, "float32")

    first = gguf.cached_conversion(venv1)
    assert not old_key.exists() and not gone.exists()  # stale: removed by the new conversion
    assert other.exists() and as_f32.exists()  # another file still in place; this file, another dtype
    # A new virtualenv: the same file under a new path and mtime reuses the conversion.
    venv2 = _tiny(tmp_path / "venv2", seed=0)
    os.utime(venv2, (1, 1))
    before = sorted(p.name for p in root.iterdir())
    assert gguf.cached_conversion(venv2) == first and sorted(p.name for p in root.iterdir()) == before
    # An upgrade replaces the file in place: its new conversion replaces the old one.
    newer = gguf.cached_conversion(_tiny(tmp_path / "venv1", seed=3))
    assert newer != first and not first.exists() and not as_f32.exists() and other.exists()


def _tiny(d, seed):
    from test_gguf_tiny import tiny_llama

    d.mkdir(exist_ok=True)
    tiny_llama(d / "tiny.gguf", seed=seed)
    return d / "tiny.gguf"
