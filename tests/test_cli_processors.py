"""`gmlx generate` with logits processors and logprobs: --repetition-penalty, --presence-penalty,
--frequency-penalty, --logit-bias, --min-tokens, --logprobs N (in --json); speculative and
--no-speculative give the same tokens and logprobs, equal to the library's plain decoding."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gmlx.config import SamplingParams
from gmlx.engine.oracle import run_scalar
from cli_helpers import use_model
from numerics import compare_tokens
from test_cli import PROMPT, assert_one_line_error, run

LM_WITHOUT_EOS = True
ARGS = ["--max-tokens", "16", "--temp", "0", "--seed", "0", "--repetition-penalty", "1.3",
        "--presence-penalty", "0.5", "--frequency-penalty", "0.2", "--logit-bias", "10=3", "--logit-bias", "25=-100",
        "--logprobs", "2", "--json", "--no-chat"]


@pytest.fixture(autouse=True)
def _model(lm, monkeypatch):
    use_model(monkeypatch, lambda path: lm)


def test_generate_options_equal_plain_decoding(lm):
    spec = run("generate", PROMPT, *ARGS, "--num-draft-tokens", "3")
    plain = run("generate", PROMPT, *ARGS, "--no-speculative")
    assert spec.code == plain.code == 0, (spec.stderr, plain.stderr)
    a, b = json.loads(spec.stdout), json.loads(plain.stdout)
    p = SamplingParams(max_tokens=16, seed=0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2,
                       logit_bias={10: 3.0, 25: -100.0}, logprobs=2)
    ref = run_scalar(lm, a["prompt_tokens"], p, speculative=False)
    assert a["num_drafted"] > 0 and b["speculative"] is False
    for got in (a, b):
        c = compare_tokens(lm, got["prompt_tokens"], ref.tokens, got["tokens"], p)
        assert c.ok, c
        if c.equal:
            np.testing.assert_allclose([e["logprob"] for e in got["logprobs"]], [t.logprob for t in ref.logprobs],
                                       atol=1e-3)
            assert all(len(e["top_logprobs"]) == 2 for e in got["logprobs"])
            assert [e["token"] for e in got["logprobs"]] == got["tokens"]
    assert 25 not in a["tokens"]


@pytest.mark.parametrize("args,needle", [
    (["--logit-bias", "x=1"], "--logit-bias takes TOKEN=BIAS"),
    (["--logit-bias", "5"], "--logit-bias takes TOKEN=BIAS"),
    (["--logit-bias", "99999999=1"], "logit_bias keys"),
    (["--logit-bias", "5=1000"], "logit_bias values"),
    (["--repetition-penalty", "-1"], "repetition_penalty"),
    (["--presence-penalty", "3"], "presence_penalty"),
    (["--logprobs", "21", "--json"], "logprobs"),
    (["--logprobs", "2"], "--json"),
])
def test_bad_options_are_one_line(args, needle):
    assert_one_line_error(run("generate", PROMPT, "--max-tokens", "4", *args), needle)
