"""`gmlx bench`'s default workload gives every request tokens (issue 18): no shipped prompt ends
at EOS before its first token, greedy, on the embedded model (and on SmolLM2, raw text as bench
sends it), and a default-workload run has no request that "finished before its first token"."""

from __future__ import annotations

import json

import pytest
from cli_helpers import use_model
from test_bench_cli import run

from gmlx.config import SamplingParams
from gmlx.data import load_prompts
from gmlx.engine.intake import tokenize
from gmlx.engine.oracle import run_scalar


def first_tokens(lm) -> list[int]:
    """How many tokens each shipped prompt gets with a budget of 1, greedy (0: EOS first)."""
    return [len(run_scalar(lm, tokenize(lm, p), SamplingParams(max_tokens=1, temperature=0.0),
                           speculative=False).tokens) for p in load_prompts()]


def test_no_shipped_prompt_ends_at_once_on_the_embedded_model(lm):
    if lm.name != "gmlx-default":
        pytest.skip(f"GMLX_TEST_MODEL is {lm.name}: the shipped prompts are chosen for the embedded model")
    got = first_tokens(lm)
    assert len(got) == 48 and [i for i, n in enumerate(got) if n == 0] == []


def test_no_shipped_prompt_ends_at_once_on_smollm2(smollm2):
    got = first_tokens(smollm2.load("q"))
    assert [i for i, n in enumerate(got) if n == 0] == []


def test_default_workload_run_has_no_request_without_tokens(lm, monkeypatch, tmp_path):
    """The default prompts, arrival (burst) and sampling (greedy, EOS honoured), shortened budgets:
    every request of every cell gets its first token."""
    if lm.name != "gmlx-default":
        pytest.skip(f"GMLX_TEST_MODEL is {lm.name}: the shipped prompts are chosen for the embedded model")
    use_model(monkeypatch, lambda path: lm)
    monkeypatch.setenv("GMLX_CONFIG", str(tmp_path / "config.toml"))
    r = run("bench", "--concurrency", "4,8", "--requests", "16", "--max-tokens", "2", "--seed", "0", "--no-warmup",
            "--json", "--out", str(tmp_path))
    assert r.code == 0, r.stderr
    obj = json.loads(r.stdout)
    assert len(obj["requests"]) == 32 and all(q["num_generated"] >= 1 for q in obj["requests"])
    assert all(c["eos_first"] == 0 for c in obj["cells"]) and "before its first token" not in r.stderr
