"""The CLI with other drafters: --draft-model and --drafter on generate and doctor; the same tokens
as plain decoding; a draft model with another tokenizer is a one-line error."""

import json

import pytest
from drafter_fixtures import random_draft_dir
from numerics import same_stream
from test_cli import PROMPT, assert_one_line_error, run

from gmlx import SamplingParams


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    return random_draft_dir(tmp_path_factory.mktemp("cli") / "draft")


def gen(*args):
    r = run("generate", PROMPT, "--max-tokens", "24", "--seed", "3", "--json", *args)
    assert r.code == 0, r.stderr
    return json.loads(r.stdout)


def assert_plain_tokens(lm, spec, plain, temp="0"):
    """Speculation gives plain decoding's tokens, tie-aware (the target's weights are lm's)."""
    params = SamplingParams(temperature=float(temp), max_tokens=24, seed=spec["seed"])
    same_stream(lm, spec["prompt_tokens"], plain["tokens"], spec["tokens"], params)


@pytest.mark.parametrize("temp", ["0", "0.8"])
def test_draft_model_gives_the_plain_tokens(lm, draft_dir, temp):
    spec = gen("--temp", temp, "--draft-model", str(draft_dir))
    plain = gen("--temp", temp, "--no-speculative")
    assert spec["speculative"] and spec["num_drafted"] > 0
    assert_plain_tokens(lm, spec, plain, temp)


def test_draft_model_that_does_not_exist(tmp_path):
    r = run("generate", PROMPT, "--draft-model", str(tmp_path / "nope"))
    assert_one_line_error(r, "does not exist")


def test_unknown_drafter_kind():
    r = run("generate", PROMPT, "--drafter", "medusa")
    assert_one_line_error(r, "drafter must be")


def test_draft_kind_without_a_draft_model():
    r = run("generate", PROMPT, "--drafter", "draft")
    assert_one_line_error(r, "--draft-model")


def test_doctor_shows_the_drafter_and_its_cap_source(draft_dir):
    r = run("doctor", "--draft-model", str(draft_dir))
    assert r.code == 0, r.stderr
    assert f"draft ({draft_dir})" in r.stdout
    assert "2 (family default: draft model drafter)" in r.stdout


@pytest.fixture(scope="module")
def assistant_only_dir(lm, tmp_path_factory):
    """The embedded model with its assistant head but no MTP head."""
    import shutil

    d = tmp_path_factory.mktemp("assistant_only")
    for f in lm.path.iterdir():
        if f.is_file() and not f.name.startswith("mtp_"):
            shutil.copy2(f, d / f.name)
    return d


def test_a_model_with_only_an_assistant_head_drafts_with_it(lm, assistant_only_dir):
    spec = gen("--model", str(assistant_only_dir))
    plain = gen("--model", str(assistant_only_dir), "--no-speculative")
    assert spec["speculative"] and spec["num_drafted"] > 0
    assert_plain_tokens(lm, spec, plain)
    r = run("doctor", "--model", str(assistant_only_dir))
    assert r.code == 0 and "drafter:               assistant" in r.stdout, r.stdout
