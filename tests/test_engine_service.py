"""The engine as a service: the prompt cache (prefix reuse prefills only the remainder and changes
no token; a preempted request is never offered back) and per-request fault isolation."""

import pytest
from engine_helpers import drive, P

from gmlx import Engine, EngineConfig
from gmlx.config import Switches
from gmlx.engine.oracle import run_scalar
from numerics import same_stream


LM_WITHOUT_EOS = True  # budgets (and cancels) alone end these requests: see conftest.lm



def _solo(lm, prompt, params):
    return run_scalar(lm, prompt, params, speculative=False).tokens


def test_shared_prefix_prefills_only_the_remainder(lm, prompts):
    eng = Engine(lm, EngineConfig(width_cap=0), switches=Switches())
    base = prompts[0]
    first = drive(eng, {0: [("a", base, P(16))]}).streams["a"].wait(1)
    follow = base + first.tokens[:6] + prompts[1][:3]
    params = P(12, 3)
    run = drive(eng, {0: [("b", follow, params)]})
    rec = run.streams["b"].wait(1)
    reused = len(base) + 6  # the retired sequence covers the prompt and the first emitted tokens
    assert rec.stats["prefill_tokens"] == len(follow) - 1 - reused
    same_stream(lm, follow, _solo(lm, follow, params), rec.tokens, params)
    eng.close()


def test_shared_prefix_in_a_batch(lm, prompts):
    eng = Engine(lm, EngineConfig(width_cap=0), switches=Switches())
    drive(eng, {0: [("a", prompts[2], P(10))]})
    a2, b = prompts[2] + [prompts[3][0]], prompts[4]
    run = drive(eng, {0: [("a2", a2, P(10, 1)), ("b", b, P(10, 2))]})
    assert run.streams["a2"].wait(1).stats["prefill_tokens"] < len(prompts[2]) // 2
    for name, prompt, params in (("a2", a2, P(10, 1)), ("b", b, P(10, 2))):
        same_stream(lm, prompt, _solo(lm, prompt, params), run.streams[name].wait(1).tokens, params)
    eng.close()


def test_preempted_request_is_not_retired(lm, prompts):
    eng = Engine(lm, EngineConfig(width_cap=0), switches=Switches(preempt=True))
    long_prompt = prompts[5]
    run = drive(eng, {0: [("a", long_prompt, P(24))], 3: [("w", prompts[6], P(6, 1))]})
    assert "preempt" in run.transitions()
    assert run.streams["a"].wait(1).finish_reason == "length"
    assert not any(k[: len(long_prompt)] == tuple(long_prompt) for k in eng.prompt_cache.keys())
    # the waiter (not preempted) was retired
    assert any(k[: len(prompts[6])] == tuple(prompts[6]) for k in eng.prompt_cache.keys())
    eng.close()


def test_prompt_cache_off(lm, prompts):
    eng = Engine(lm, EngineConfig(prompt_cache_bytes=0))
    assert eng.prompt_cache is None
    rec = drive(eng, {0: [("a", prompts[7], P(8))]}).streams["a"].wait(1)
    assert rec.stats["prefill_tokens"] == len(prompts[7]) - 1
    eng.close()


def test_a_faulty_detokenizer_ends_only_its_request(lm, prompts):
    """Fault isolation: an exception while emitting one request's tokens finishes that request
    with an error; the others are unchanged."""
    eng = Engine(lm, EngineConfig(width_cap=0))
    a = eng.submit(prompts[8], P(12), start=False)
    b = eng.submit(prompts[9], P(12, 1), start=False)
    eng.step()  # forms the batch

    class Broken:
        text = ""

        def add_token(self, tok):
            raise RuntimeError("detokenizer exploded")

    next(r for r in eng.batch.rows if r.rid == a.request_id).detokenizer = Broken()
    while eng.has_work:
        eng.step()
    ra, rb = a.wait(1), b.wait(1)
    assert ra.finish_reason == "error" and "detokenizer exploded" in ra.error
    assert rb.finish_reason == "length"
    same_stream(lm, prompts[9], _solo(lm, prompts[9], P(12, 1)), rb.tokens, P(12, 1))
    c = eng.generate(prompts[10], P(6, 2))  # the engine still serves
    assert c.finish_reason == "length"
    eng.close()


def test_invalid_switches_are_an_error_at_engine_start(lm, monkeypatch):
    from gmlx.errors import ConfigError

    for name, bad in (("GMLX_MTP_PREEMPT", "maybe"), ("GMLX_MTP_RESUME", "2"), ("GMLX_MTP_WIDTH_CAP", "-1"),
                      ("GMLX_MTP_WIDTH_CAP", "four")):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ConfigError, match=name):
            Engine(lm)
        monkeypatch.delenv(name)
