"""Early dispatch (gmlx/models/early_dispatch.py): the target's forwards dispatch their layers as they
are built, only inside `early()` and where wanted (never mlx-lm's own calls of the model), and every
stream stays plain decoding's with it on and off."""

from __future__ import annotations

import mlx.core as mx
import pytest

from gmlx import Engine, EngineConfig, SamplingParams
from gmlx.models import early_dispatch
from gmlx.models.early_dispatch import early, install

from engine_helpers import matches_solo


class _Counting:
    """mlx.core with its async_eval counted (what early dispatch hands it)."""

    def __init__(self):
        self.calls: list[tuple] = []

    def __getattr__(self, name):
        return getattr(mx, name)

    def async_eval(self, *arrays):
        self.calls.append(tuple(a.shape for a in arrays))
        mx.async_eval(*arrays)


@pytest.fixture
def counted(monkeypatch):
    c = _Counting()
    monkeypatch.setattr(early_dispatch, "mx", c)
    return c


@pytest.mark.parametrize("raw, on", [("1", True), ("0", False), (None, mx.default_device().type == mx.cpu)])
def test_wanted_follows_the_switch_else_the_backend(monkeypatch, raw, on):
    if raw is None:
        monkeypatch.delenv("GMLX_EARLY_DISPATCH", raising=False)
    else:
        monkeypatch.setenv("GMLX_EARLY_DISPATCH", raw)
    assert early_dispatch.wanted() is on


def test_the_target_s_forwards_dispatch_each_layer_and_mlx_lm_s_calls_do_not(loaded_lm, counted, monkeypatch):
    monkeypatch.setenv("GMLX_EARLY_DISPATCH", "1")
    t = loaded_lm.target
    x = mx.array([[5, 6, 7]], dtype=mx.int32)
    ref = t.model(x, cache=t.make_cache())  # mlx-lm's forward of the same model objects
    assert counted.calls == []
    for forward in (lambda: t(x, t.make_cache())[0], lambda: t.logits(x, t.make_cache()),
                    lambda: t.lm_head(t.run_backbone(x, t.make_cache()))):
        counted.calls.clear()
        logits = forward()
        assert counted.calls == [((1, 3, t.hidden_size),)] * t.num_layers
        # sync: test; the same operations (a compiler may contract a multiply-add differently: tolerance)
        assert mx.allclose(logits, ref, rtol=1e-5, atol=1e-5).item()
    counted.calls.clear()
    monkeypatch.setenv("GMLX_EARLY_DISPATCH", "0")
    t(x, t.make_cache())
    assert counted.calls == []


def test_an_engine_s_rounds_dispatch_early_plain_and_speculative(loaded_lm, counted, monkeypatch):
    monkeypatch.setenv("GMLX_EARLY_DISPATCH", "1")
    n = loaded_lm.target.num_layers
    d = loaded_lm.target.hidden_size
    for config, tokens in ((EngineConfig(speculative=False), 1), (EngineConfig(num_draft_tokens=2), 3)):
        counted.calls.clear()
        eng = Engine(loaded_lm, config)
        eng.generate([1, 2, 3], SamplingParams(max_tokens=6, ignore_eos=True, seed=0))
        eng.close()
        assert len(counted.calls) % n == 0
        assert counted.calls.count(((1, tokens, d),)) >= n  # plain's one-token steps, the K = 2 verifies


def test_install_is_idempotent_and_keeps_the_class_s_name(loaded_lm):
    layers = loaded_lm.target.backbone.layers
    assert install(layers) == 0  # loading installed it
    cls = type(layers[0])
    assert cls.__name__ == cls.__mro__[1].__name__ and cls.__mro__[1] not in early_dispatch._classes.values()


@pytest.mark.parametrize("raw", ["0", "1"])
@pytest.mark.parametrize("t", [0.0, 0.8])
def test_streams_are_plain_decoding_s_with_early_dispatch_off_and_on(loaded_lm, prompts, monkeypatch, raw, t):
    """Forced both ways: the scalar lane (K = 2 every round, the default's control) and the batch
    lane (two requests), greedy and seeded — each stream its solo plain decode, tie-aware."""
    monkeypatch.setenv("GMLX_EARLY_DISPATCH", raw)
    params = SamplingParams(max_tokens=24, temperature=t, seed=3, ignore_eos=True)
    for config in (EngineConfig(num_draft_tokens=2), EngineConfig()):
        eng = Engine(loaded_lm, config)
        streams = [eng.submit(p, params, start=False) for p in prompts[:1]]
        while eng.has_work:
            eng.step()
        batch = [eng.submit(p, params, start=False) for p in prompts[1:3]]
        while eng.has_work:
            eng.step()
        eng.close()
        for p, s in zip(prompts[:3], streams + batch):
            matches_solo(loaded_lm, p, params, s.result.tokens)


@pytest.mark.parametrize("raw", ["0", "1"])
def test_the_real_model_s_streams_with_early_dispatch_off_and_on(smollm2, monkeypatch, raw):
    """SmolLM2 float32 with its shipped EAGLE-3 head, as a user runs it (the default engine), and
    K = 1 every round: greedy and seeded streams are its solo plain decode."""
    monkeypatch.setenv("GMLX_EARLY_DISPATCH", raw)
    lm = smollm2.load("float32")
    prompt = list(lm.tokenizer.apply_chat_template([{"role": "user", "content": "Write a Python function that"
                                                     " reverses a list."}], add_generation_prompt=True))
    for config in (EngineConfig(), EngineConfig(num_draft_tokens=1)):
        for t in (0.0, 0.7):
            params = SamplingParams(max_tokens=16, temperature=t, seed=5, ignore_eos=True)
            eng = Engine(lm, config)
            got = eng.generate(prompt, params).tokens
            eng.close()
            matches_solo(lm, prompt, params, got)


def test_a_quantized_target_s_twin_dispatches_early_too(smollm2):
    """The dequantized twin (a quantized target's verifies on the CPU) is made of shallow copies of
    the layers, made after the install: its layers are early-dispatching too."""
    t = smollm2.load("q").target
    if t.twin is None:
        pytest.skip("no dequantized twin on this backend")
    assert all(type(layer) in early_dispatch._classes.values() for layer in t.twin.model.layers)
    assert all(type(layer) in early_dispatch._classes.values() for layer in t.backbone.layers)
