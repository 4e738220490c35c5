"""Quantized targets (mlx-lm's own `convert -q`, the format most MLX users run): on the CPU their
multi-token forwards go through a dequantized twin (gmlx/models/dequantized.py) so a verify is
cheap, and every stream still equals the same request decoded alone without speculation."""

import shutil

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from engine_helpers import P, check_solo, drive, engine
from gmlx.models.loading import default_model_path, load
from gmlx.engine.oracle import run_scalar
from numerics import same_stream

LM_WITHOUT_EOS = True  # budgets alone end these requests: see conftest.lm


@pytest.fixture(scope="module")
def q4(tmp_path_factory):
    from mlx_lm import convert

    out = tmp_path_factory.mktemp("q4") / "model"
    convert(str(default_model_path()), mlx_path=str(out), quantize=True, q_bits=4, q_group_size=64)
    for f in ("mtp_config.json", "mtp_head.safetensors"):  # the MTP head travels beside, as users copy it
        shutil.copy(default_model_path() / f, out / f)
    from engine_helpers import with_eos

    return with_eos(load(out), ())


def test_the_twin_holds_the_same_weights(q4):
    """Every quantized layer has a float32 twin equal to its dequantization; the rest is shared."""
    t = q4.target
    assert t.wide is not None and t.hidden_size == 256
    quantized = dict(t.model.named_modules())
    twins = dict(t.wide[0].named_modules())  # the twin's backbone
    n = 0
    for name, m in t.backbone.named_modules():
        if isinstance(m, nn.QuantizedLinear):
            w = mx.dequantize(m.weight, m.scales, m.biases, m.group_size, m.bits)
            assert mx.array_equal(twins[name].weight, w).item()  # sync: test check (same op, same shapes)
            n += 1
        elif isinstance(m, nn.RMSNorm):
            assert twins[name].weight is m.weight  # shared, not copied
    assert n >= 8 * 7 and quantized  # 7 linear layers per block


@pytest.mark.numerics
def test_wide_and_narrow_forwards_agree(q4):
    """A 4-token forward through the twin and four 1-token quantized steps give the same logits
    (to within the rounding of other kernels) and the same greedy tokens."""
    t = q4.target
    ids = mx.array([[5, 77, 301, 9, 1200, 42, 7, 88]], dtype=mx.int32)
    c1, c2 = t.make_cache(), t.make_cache()
    wide, _ = t(ids, c1)
    steps = [t(ids[:, i:i + 1], c2)[0] for i in range(ids.shape[1])]
    narrow = mx.concatenate(steps, axis=1)
    from numerics import assert_close, tie_margin

    # Different kernels on 4-bit weights: a looser bound than a float32 reorder, same argmax.
    assert_close(wide, narrow, dtype=mx.float16, msg="wide vs narrow logits")
    # Greedy tokens agree except where the top two are within rounding of each other (tie-aware).
    w, n = np.array(wide[0]), np.array(narrow[0])
    top2 = np.sort(n, axis=-1)[:, -2:]
    differ = w.argmax(-1) != n.argmax(-1)
    assert (top2[differ, 1] - top2[differ, 0] < tie_margin()).all(), np.flatnonzero(differ)


@pytest.mark.parametrize("t", [0.0, 0.8])
def test_scalar_speculation_equals_plain(q4, prompts, t):
    for i in (3, 11):
        params = P(40, seed=i, t=t)
        spec = run_scalar(q4, prompts[i], params)
        plain = run_scalar(q4, prompts[i], params, speculative=False)
        same_stream(q4, prompts[i], plain.tokens, spec.tokens, params)
        assert spec.stats.num_drafted > 0


def test_schedule_equals_solo(q4, prompts):
    """Scalar, preempt, a batch, gate (a third row over cap 2) and resume, greedy and seeded."""
    eng = engine(q4, 2, resume_min_remaining=2, num_draft_tokens=3)
    run = drive(eng, {0: [("a", prompts[12], P(30, seed=1))], 3: [("b", prompts[13], P(10, seed=2, t=0.8))],
                      6: [("c", prompts[14], P(8, seed=3))]})
    check_solo(q4, run)
    tr = run.transitions()
    assert "preempt" in tr and "gate" in tr and "resume" in tr, tr
    eng.close()


def test_one_token_steps_take_the_faster_path_and_the_stream_holds(q4, prompts, monkeypatch):
    """Where the twin decodes one token faster (measured at load; GMLX_DEQUANTIZED_DECODE forces
    it), plain steps run the twin: the same stream as the quantized steps give, tie-aware."""
    streams = {}
    for forced in ("1", "0"):
        monkeypatch.setenv("GMLX_DEQUANTIZED_DECODE", forced)
        lm = load(q4.path)
        t = lm.target
        assert t.decode_on_twin is (forced == "1") and (t.decode_model is t.model) is (forced == "0")
        x = mx.array([prompts[2][:5]], dtype=mx.int32)
        assert mx.array_equal(t.logits(x, None), t.decode_model(x)).item()  # sync: test check
        params = P(40, seed=5, t=0.8)
        streams[forced] = run_scalar(lm, prompts[2], params, speculative=False).tokens
    same_stream(q4, prompts[2], streams["0"], streams["1"], P(40, seed=5, t=0.8))


def test_the_measured_choice_is_consistent(q4, monkeypatch):
    monkeypatch.delenv("GMLX_DEQUANTIZED_DECODE")
    t = load(q4.path).target
    assert t.wide is not None and (t.decode_model is not t.model) is t.decode_on_twin


@pytest.mark.parametrize("forced", ["1", "0"])
def test_smollm2_loads_whichever_path_one_token_steps_take(smollm2, forced, monkeypatch):
    """The load-time check compares like with like (issue: `--model smollm2` failed on every
    machine where the twin decodes faster): forced both ways, the 4-bit model loads, its split
    forward on its own weights is mlx-lm's, and greedy streams equal the float32 conversion's."""
    from gmlx.models.loading import load
    from gmlx.engine.oracle import run_scalar

    monkeypatch.setenv("GMLX_DEQUANTIZED_DECODE", forced)
    lm = load(smollm2.path("q"))
    assert lm.target.decode_on_twin is (forced == "1")
    ids = lm.tokenizer.encode("The capital of France is")
    rec = run_scalar(lm, ids, P(12), speculative=False)
    ref = run_scalar(smollm2.load("float32"), ids, P(12), speculative=False)
    assert len(rec.tokens) == 12
    same_stream(smollm2.load("float32"), ids, ref.tokens, rec.tokens, P(12))


def test_a_twin_that_disagrees_is_refused_with_the_switch_that_avoids_it(q4, monkeypatch):
    from gmlx.errors import ModelLoadError
    from gmlx.models.adapter import Target

    t = Target(q4.target.model)
    lin = t.twin.model.layers[0].mlp.down_proj
    lin.weight = lin.weight * 3.0  # a dequantization gone wrong
    with pytest.raises(ModelLoadError, match="GMLX_DEQUANTIZED_VERIFY=0"):
        t.check()


def test_a_family_that_post_processes_logits_is_refused_by_name(q4):
    from gmlx.errors import ModelLoadError
    from gmlx.models.adapter import Target

    class Capped(nn.Module):  # logit soft-capping, as gemma2 does
        def __init__(self, inner):
            super().__init__()
            self.model, self.inner = inner.model, inner

        @property
        def layers(self):
            return self.inner.layers

        def __call__(self, x, cache=None):
            return 30.0 * mx.tanh(self.inner(x, cache=cache) / 30.0)

    t = Target(Capped(load(default_model_path()).target.model))
    with pytest.raises(ModelLoadError, match="post-processes logits"):
        t.check()
