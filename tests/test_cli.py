"""The command line through its real entry point (`gmlx_cli.app.main`, error boundary included).

The model is loaded once per session (conftest's `lm`) and handed to the CLI through main()'s
`load_model` seam (tests/cli_helpers.py: `run`, `use_model`).
"""

from __future__ import annotations

import json
import os
import shutil
from functools import lru_cache
from pathlib import Path

import pytest

from gmlx import blas
from gmlx.models.loading import default_model_path, load
from gmlx.engine.stream import FinalRecord
from cli_helpers import Outcome, run, use_model
from numerics import compare_tokens

PROMPT = "def fibonacci(n):\n"
JSON_KEYS = {
    "text": str, "tokens": list, "prompt_tokens": list, "finish_reason": str, "seed": int, "model": str,
    "speculative": bool, "num_draft_tokens": int, "num_drafted": int, "num_accepted": int,
    "draft_acceptance_rate": float, "mean_acceptance_length": float, "acceptance_histogram": list,
    "ttft_s": float, "tokens_per_s": float,
}

if not os.environ.get("GMLX_TEST_MODEL") and not (default_model_path() / "config.json").is_file():
    pytest.skip("the embedded default model is not exported yet", allow_module_level=True)


def assert_one_line_error(r: Outcome, *needles: str, code: int = 1) -> None:
    assert r.code == code, (r.code, r.stdout, r.stderr)
    assert "Traceback" not in r.stdout + r.stderr
    assert r.stdout == ""
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("gmlx: error: ")]
    assert len(errors) == 1, r.stderr
    # Anything else on stderr may only be gmlx's own one-line warnings / notices.
    assert all(ln.startswith("gmlx: ") for ln in r.stderr.splitlines() if ln.strip()), r.stderr
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])


@pytest.fixture(scope="module")
def headless_dir(lm, tmp_path_factory) -> Path:
    """The test model without a drafter: everything but the mtp_* and assistant_* files.

    Hard links (or copies), not symlinks: the training run may swap the default model's
    directory while the tests run, and a hard link keeps the file this session started with."""
    d = tmp_path_factory.mktemp("headless")
    for f in lm.path.iterdir():
        if f.is_file() and not f.name.startswith(("mtp_", "assistant_")):
            try:
                os.link(f, d / f.name)
            except OSError:
                shutil.copy2(f, d / f.name)
    return d


@pytest.fixture(autouse=True)
def cached_models(lm, monkeypatch):
    """Default model -> the session's loaded one; other paths load once (errors are not cached)."""
    use_model(monkeypatch, lambda path: lm if path is None else _load_cached(str(path)))


@lru_cache(maxsize=4)
def _load_cached(path: str):
    return load(path)


def gen_json(*args: str, input: str | None = None) -> dict:
    r = run("generate", *args, "--json", input=input)
    assert r.code == 0, r.stderr
    return json.loads(r.stdout)


def test_generate_streams_text_to_stdout_and_stats_to_stderr():
    r = run("generate", PROMPT, "--max-tokens", "8", "--temp", "0")
    assert r.code == 0, r.stderr
    assert r.stdout.strip() != ""
    for stat in ("prompt", "TTFT", "tokens/s", "acceptance rate", "mean acceptance length", "rounds"):
        assert stat in r.stderr and stat not in r.stdout
    assert "Traceback" not in r.stderr


def test_generate_verbose_reports_setup():
    r = run("generate", PROMPT, "--max-tokens", "4", "--seed", "11", "--verbose")
    assert r.code == 0, r.stderr
    for needle in ("BLAS", blas.active_blas(), "mlx / mlx-lm", "seed", "11", "finish reason", "K (num_draft_tokens)"):
        assert needle in r.stderr


def test_json_schema(lm):
    out = gen_json(PROMPT, "--max-tokens", "8", "--seed", "5")
    for key, typ in JSON_KEYS.items():
        assert isinstance(out[key], typ), (key, out[key])
    assert 1 <= len(out["tokens"]) <= 8
    assert all(isinstance(t, int) for t in out["tokens"] + out["prompt_tokens"])
    assert out["prompt_tokens"] == list(lm.tokenizer.encode(PROMPT, add_special_tokens=True))
    assert out["speculative"] is True and out["num_draft_tokens"] == lm.default_k
    assert out["seed"] == 5 and out["finish_reason"] in ("length", "stop")
    assert 0.0 <= out["draft_acceptance_rate"] <= 1.0
    assert sum(out["acceptance_histogram"]) == out["num_rounds"]


def test_seed_is_drawn_and_reported():
    out = gen_json(PROMPT, "--max-tokens", "2", "--temp", "0.7")
    assert isinstance(out["seed"], int) and out["seed"] >= 0


@pytest.mark.parametrize("sampling", [("--temp", "0"), ("--temp", "0.8", "--seed", "3")], ids=["greedy", "sampled"])
def test_no_speculative_gives_the_same_tokens(lm, sampling):
    from gmlx.config import SamplingParams

    spec = gen_json(PROMPT, "--max-tokens", "16", *sampling)
    plain = gen_json(PROMPT, "--max-tokens", "16", "--no-speculative", *sampling)
    assert spec["speculative"] is True and plain["speculative"] is False
    assert plain["num_drafted"] == 0 and plain["num_draft_tokens"] is None
    if spec["tokens"] != plain["tokens"]:  # docs/design.md §3: only a floating-point near-tie may differ
        params = SamplingParams(temperature=float(sampling[1]), max_tokens=16, seed=spec["seed"])
        cmp = compare_tokens(lm, spec["prompt_tokens"], plain["tokens"], spec["tokens"], params)
        assert cmp.tie, cmp


def test_stdin_prompt_matches_argument():
    via_stdin = gen_json("-", "--max-tokens", "4", "--temp", "0", input=PROMPT)
    via_arg = gen_json(PROMPT, "--max-tokens", "4", "--temp", "0")
    assert via_stdin["prompt_tokens"] == via_arg["prompt_tokens"]
    assert via_stdin["tokens"] == via_arg["tokens"]


def test_stop_string_reaches_the_engine():
    full = gen_json(PROMPT, "--max-tokens", "16", "--temp", "0")
    text = full["text"]
    if len(text.strip()) < 4:
        pytest.skip("the model's greedy continuation is too short to cut")
    stop = text.strip()[2:4]
    cut = gen_json(PROMPT, "--max-tokens", "16", "--temp", "0", "--stop", stop)
    assert cut["finish_reason"] == "stop"
    assert stop not in cut["text"] and text.startswith(cut["text"])


def test_headless_model_without_request_decodes_plain_with_a_notice(headless_dir):
    r = run("generate", PROMPT, "--max-tokens", "4", "--json", "--model", str(headless_dir))
    assert r.code == 0, r.stderr
    assert json.loads(r.stdout)["speculative"] is False
    assert f"gmlx: notice: {headless_dir.name} has no MTP or assistant head; decoding without speculation" in r.stderr


def test_long_prompt_is_rejected(lm):
    prompt = " ".join(str(i) for i in range(2 * (lm.context_length or 4096)))
    assert_one_line_error(run("generate", prompt, "--max-tokens", "4"), "context")


BAD_INPUTS = {
    "empty prompt": (("", ), "prompt is empty"),
    "max-tokens 0": (("x", "--max-tokens", "0"), "max_tokens"),
    "max-tokens negative": (("x", "--max-tokens", "-3"), "max_tokens"),
    "temp negative": (("x", "--temp", "-1"), "temperature"),
    "top-p 0": (("x", "--top-p", "0"), "top_p"),
    "top-p above 1": (("x", "--top-p", "1.5"), "top_p"),
    "top-k negative": (("x", "--top-k", "-1"), "top_k"),
    "min-p above 1": (("x", "--min-p", "2"), "min_p"),
    "seed negative": (("x", "--seed", "-1"), "seed"),
    "num-draft-tokens 0": (("x", "--num-draft-tokens", "0"), "num_draft_tokens"),
    "missing model": (("x", "--model", "/nonexistent/model"), "does not exist"),
}


@pytest.mark.parametrize("args,needle", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_bad_input_is_one_line_error(args, needle):
    assert_one_line_error(run("generate", *args), needle)


def test_empty_stdin_is_one_line_error():
    assert_one_line_error(run("generate", "-", input=""), "prompt is empty")


def test_directory_that_is_not_a_model(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert_one_line_error(run("generate", "x", "--model", str(tmp_path)), "not an mlx-lm model directory")


def test_speculative_on_headless_model_is_an_error(headless_dir):
    assert_one_line_error(run("generate", "x", "--speculative", "--model", str(headless_dir)), "no MTP head")


@pytest.mark.parametrize("args", [("generate",), ("generate", "x", "--max-tokens", "abc"), ("generate", "x", "--nope"),
                                  ("nope",)], ids=["no prompt", "not an int", "unknown option", "unknown command"])
def test_usage_errors_are_one_line_with_exit_2(args):
    assert_one_line_error(run(*args), "--help", code=2)


def test_engine_error_in_final_record_exits_1(monkeypatch):
    class FailingStream:
        def __iter__(self):
            return iter(())

        result = FinalRecord(request_id=0, prompt_tokens=[1], tokens=[], text="", finish_reason="error", seed=0,
                             speculative=True, error="RuntimeError: boom")

    from gmlx.engine import Engine  # generate imports it when it runs (not at import: --help stays fast)

    monkeypatch.setattr(Engine, "submit", lambda self, prompt, params: FailingStream())
    assert_one_line_error(run("generate", "x", "--max-tokens", "2"), "generation failed: RuntimeError: boom")


def test_debug_shows_the_traceback():
    for r in (run("generate", "x", "--model", "/nonexistent", "--debug"),
              run("generate", "x", "--model", "/nonexistent", env={"GMLX_DEBUG": "1"})):
        assert r.code == 1
        assert "Traceback" in r.stderr and r.stderr.strip().splitlines()[-1].startswith("gmlx: error: ")


def test_help_and_bare_command():
    for r in (run(), run("--help"), run("generate", "--help")):
        assert r.code == 0 and "Usage" in r.stdout


def test_doctor_names_blas_and_model(lm):
    r = run("doctor")
    assert r.code == 0, r.stderr
    for needle in (blas.active_blas(), "mlx-lm", "default model", "drafter", "mtp", "num_draft_tokens",
                   "speculative_width_cap", "model default", "context length"):
        assert needle in r.stdout, needle


def test_doctor_on_headless_model(headless_dir):
    r = run("doctor", "--model", str(headless_dir))
    assert r.code == 0, r.stderr
    assert "none" in r.stdout


def test_chat_template_applies_by_default_where_the_model_has_one(smollm2, monkeypatch):
    """As mlx_lm.generate: a model with a chat template gets the prompt as a user message (so a
    chat model answers); --no-chat sends it as it is; --chat on a model without one is an error."""
    lm = smollm2.load("float32")
    use_model(monkeypatch, lambda path: lm)
    r = run("generate", "What is the capital of France?", "--max-tokens", "12", "--seed", "0", "--json")
    assert r.code == 0, r.stderr
    obj = json.loads(r.stdout)
    assert "Paris" in obj["text"] and obj["num_prompt_tokens"] > 20  # the template's tokens around it
    raw = json.loads(run("generate", "What is the capital of France?", "--max-tokens", "2", "--seed", "0", "--json",
                         "--no-chat").stdout)
    assert raw["num_prompt_tokens"] < 12


def test_chat_on_a_model_without_a_template_is_a_one_line_error():
    r = run("generate", "def f():", "--chat", "--max-tokens", "2")
    assert r.code == 1 and "no chat template" in r.stderr and len(r.stderr.strip().splitlines()) == 1
