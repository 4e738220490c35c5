"""The soak, shortened (issue 5 item 6; the full run is `benchmarks/soak.py`), and the engine
faults found while building it, each pinned down deterministically."""

from __future__ import annotations

import numpy as np
import pytest

from gmlx import Engine, EngineConfig, SamplingParams
from gmlx.config import Switches
from soak_harness import QUICK, soak
from soak_workload import CAP_ENV, make_schedule
from gmlx.policy import admission
from gmlx.policy.admission import Mode


def test_submit_landing_between_plan_and_apply_waits_for_its_turn(lm, prompts, monkeypatch):
    """An idle engine plans "start_scalar" for its one queued request; a second request that a
    client thread submits before the plan is applied must wait in the queue (it is admitted by
    the next plan), not be popped into the batch loop beside the scalar request. The soak found
    the engine doing the latter: the stray batch row is never decoded, and when the scalar
    request retires the engine is left in SCALAR mode without a sequence, so the next step
    raises and fails every live request. Here the submit is placed in that window on purpose."""
    eng = Engine(lm, EngineConfig(width_cap=None), switches=Switches(preempt=True, resume=True))
    first = eng.submit(prompts[0], SamplingParams(max_tokens=6, seed=1), start=False)
    late = []
    real_plan = admission.plan

    def plan_then_submit(view):
        plan = real_plan(view)
        if not late:  # a concurrent submitter, after the plan and before its application
            late.append(eng.submit(prompts[1], SamplingParams(max_tokens=6, seed=2), start=False))
        return plan

    monkeypatch.setattr(admission, "plan", plan_then_submit)
    eng.step()
    assert eng.mode is Mode.SCALAR
    assert eng.batch.rows == [], "the late request was admitted into the batch beside the scalar request"
    for _ in range(100):
        if not eng.has_work:
            break
        eng.step()
    for s in (first, late[0]):
        rec = s.wait(5)
        assert (rec.finish_reason, rec.error) == ("length", None)


def test_invalid_cap_env_mid_run_does_not_strand_a_queued_request(lm, prompts, monkeypatch):
    """GMLX_MTP_WIDTH_CAP takes integers only, and the engine re-reads it every round. Set to an
    invalid value mid-run (found while building the soak's cap flipper), the engine keeps the
    last valid cap with a warning and serves the request; before the fix every step raised and a
    queued request waited forever."""
    eng = Engine(lm, EngineConfig(width_cap=None), switches=Switches(preempt=True, resume=True))
    try:
        eng.generate(prompts[0], SamplingParams(max_tokens=2, seed=0))  # the engine thread is up
        monkeypatch.setenv(CAP_ENV, "off")
        with pytest.warns(RuntimeWarning, match="keeping the cap in force"):
            stream = eng.submit(prompts[1], SamplingParams(max_tokens=4, seed=1, ignore_eos=True))
            rec = stream.wait(10)  # four tokens take milliseconds
        assert rec.finish_reason == "length" and rec.error is None
    finally:
        monkeypatch.delenv(CAP_ENV, raising=False)
        eng.close()


def test_schedule_is_reproducible_and_varied(lm):
    """The workload comes from the seed alone, and covers what the soak is for."""
    from gmlx.data import load_prompts

    texts = load_prompts()
    tokens = [list(lm.tokenizer.encode(t)) for t in texts]
    a = make_schedule(texts, tokens, QUICK, np.random.default_rng(3))
    b = make_schedule(texts, tokens, QUICK, np.random.default_rng(3))
    assert a == b and len(a) == QUICK.requests
    assert {it.params.temperature for it in a} >= {0.0, 0.5, 0.8, 1.0}
    assert {it.cancel for it in a} >= {None, "pieces", "delay"}
    assert any(it.drain for it in a) and any(isinstance(it.prompt, str) for it in a)


def test_soak_quick(lm, tmp_path, monkeypatch):
    """48 requests with random arrivals, lengths, seeds, temperatures and cancellations through
    the engine thread while the cap flips live: every stream equals its solo plain reference
    (cancelled ones a prefix of it), and active memory returns to where it started."""
    monkeypatch.setenv("GMLX_CONFIG", str(tmp_path / "config.toml"))  # never the user's config
    monkeypatch.delenv(CAP_ENV, raising=False)
    r = soak(lm, QUICK, seed=0, config_path=tmp_path / "config.toml")
    assert r["mismatches"] == 0, r["mismatch_details"]
    assert r.get("errored", 0) == 0 and r.get("client_error", 0) == 0
    assert r["completed"] + r["cancelled"] == QUICK.requests
    assert r["cancelled"] >= 1 and r["cap_flips"] >= 5 and len(r["rounds_by_cap"]) >= 2
    assert sum(r["transitions"]["events"].values()) >= 1 and r["cap_violations"] == []
    # Start and end are measured the same way (nothing in flight, the prompt cache emptied):
    # the same 5% bound as the full run; the small run leaves no more behind than the large.
    assert r["memory"]["end"]["active"] <= r["memory"]["start"]["active"] * 1.05, r["memory"]
    assert r["failures"] == []
