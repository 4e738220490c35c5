"""The load test, shortened (the full run is `benchmarks/load_serve.py`): requests over HTTP from
the async openai client with random budgets, temperatures, seeds, stop strings and disconnects,
while the cap flips live. No stream differs from its solo plain decode (cut ones as a prefix), no
response is >= 500, nothing is left open, and MLX memory returns to its start."""

from __future__ import annotations

from gmlx.data import load_prompts
from gmlx.serve.loadgen import QUICK, run_load


def test_load_quick(loaded_lm):
    r = run_load(loaded_lm, QUICK, seed=0, prompts=load_prompts())
    assert not r["failures"], (r["failures"], r["mismatch_details"][:3], r["errors"][:3])
    assert r["requests"] == QUICK.requests and r["status_5xx"] == 0
    assert r["checked"] >= QUICK.requests // 2 and r["left"] >= 1  # streams were checked; clients did leave
    assert r["statuses"].get("200", 0) + r["statuses"].get("left before an answer", 0) == QUICK.requests
