"""Finish reasons: an enum whose values are the wire strings, so every output carries them unchanged."""

from __future__ import annotations

import io
import json

import pandas as pd

from gmlx import Engine, EngineConfig, SamplingParams
from gmlx.finish import COMPLETE, FinishReason


def test_values_are_the_wire_strings():
    assert [r.value for r in FinishReason] == ["stop", "length", "cancelled", "error", "rejected"]
    assert COMPLETE == {"stop", "length"}
    for r in FinishReason:
        assert r == r.value and str(r) == f"{r}" == r.value and FinishReason(r.value) is r


def test_serialized_as_the_strings():
    """JSON (serve's responses and chunks, generate --json, bench's JSON) and CSV (bench's tables)."""
    for r in FinishReason:
        assert json.dumps({"finish_reason": r}) == json.dumps({"finish_reason": r.value})
        assert json.dumps({"finish_reason": r}, separators=(",", ":")) == f'{{"finish_reason":"{r.value}"}}'
    df = pd.DataFrame({"finish_reason": list(FinishReason) + [None]})
    plain = pd.DataFrame({"finish_reason": [r.value for r in FinishReason] + [None]})
    got, want = io.StringIO(), io.StringIO()
    df.to_csv(got, index=False)
    plain.to_csv(want, index=False)
    assert got.getvalue() == want.getvalue()
    assert df.to_json(orient="records") == plain.to_json(orient="records")


def test_the_engine_reports_members(lm, prompts):
    eng = Engine(lm, EngineConfig(width_cap=0))
    try:
        rec = eng.generate(prompts[0], SamplingParams(max_tokens=2, seed=0, ignore_eos=True))
        assert rec.finish_reason is FinishReason.LENGTH
        stream = eng.submit(prompts[1], SamplingParams(max_tokens=64, seed=0))
        stream.cancel()
        assert stream.wait(30).finish_reason in (FinishReason.CANCELLED, *COMPLETE)
    finally:
        eng.close()
