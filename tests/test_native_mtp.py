"""Native MTP heads read from a checkpoint (DeepSeek-V3 and Qwen3-Next layouts), the bound-head
interface, the target's hidden conventions, and loading without a head.

Checkpoints are tiny and random (tests/native_checkpoints.py): "ds" a deepseek_v3 target with
its MTP layer 61; "q3" a dense qwen3 target with Qwen3-Next-layout `mtp.*` tensors; "qn" a real
(hybrid) qwen3_next target, whose linear-attention layers roll back by per-position capture
(gmlx/recurrent.py; tests/test_hybrid.py covers hybrids in depth).
"""

from __future__ import annotations

import dataclasses
import shutil

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import deepseek_v3, qwen3, qwen3_next
from mlx_lm.models.cache import KVCache

from engine_helpers import drive, engine, speculates, with_eos
from gmlx import SamplingParams
from gmlx.errors import NoDrafterError
from gmlx.kv import RaggedKVCache
from gmlx.model_cache import trim_rows
from gmlx.heads.bound import BoundHead
from gmlx.models.loading import load, no_drafter_message, no_rollback_message
from gmlx.engine.oracle import run_scalar
from native_checkpoints import deepseek_checkpoint, qwen3_checkpoint, qwen3_next_checkpoint
from numerics import assert_close, same_stream

PROMPT = [5, 17, 300, 42, 7, 99, 1000, 3, 64, 1500]
X = mx.array([PROMPT], dtype=mx.int32)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("native")
    ds, ds_ref = deepseek_checkpoint(root / "ds")
    q3, q3_ref = qwen3_checkpoint(root / "q3")
    qn, qn_ref, qn_model = qwen3_next_checkpoint(root / "qn")
    bare, _ = qwen3_checkpoint(root / "bare", with_mtp=False)
    return {"ds": (ds, ds_ref), "q3": (q3, q3_ref), "qn": (qn, qn_ref, qn_model), "bare": (bare, None)}


@pytest.fixture(scope="module")
def lms(ckpts):
    return {name: load(c[0]) for name, c in ckpts.items()}


def manual_head(lm, ref: dict, tokens: mx.array, hidden: mx.array) -> mx.array:
    """The head's forward written out from its reference (mlx-space) weights."""
    args = lm.target.model.args
    layer = {"deepseek_v3": lambda: deepseek_v3.DeepseekV3DecoderLayer(args, 61),
             "qwen3": lambda: qwen3.TransformerBlock(args),
             "qwen3_next": lambda: qwen3_next.Qwen3NextDecoderLayer(args, 3)}[args.model_type]()
    layer.load_weights([(k[len("layer."):], v) for k, v in ref.items() if k.startswith("layer.")])
    eps = args.rms_norm_eps
    e = mx.fast.rms_norm(lm.target.embed_tokens(tokens), ref["embed_norm.weight"], eps)
    h = mx.fast.rms_norm(hidden, ref["hidden_norm.weight"], eps)
    x = mx.concatenate([e, h], axis=-1) @ ref["fc.weight"].T
    mask = mx.tril(mx.ones((x.shape[1], x.shape[1]), dtype=mx.bool_))
    return mx.fast.rms_norm(layer(x, mask, None), ref["out_norm.weight"], eps)


# -- finding the head ------------------------------------------------------------------------
@pytest.mark.parametrize("name,kind", [("ds", "native-mtp:deepseek_v3"), ("q3", "native-mtp:qwen3_next"),
                                       ("qn", "native-mtp:qwen3_next")])
def test_load_finds_the_native_head(lms, name, kind):
    lm = lms[name]
    assert lm.has_drafter and lm.drafter_kind == kind and lm.head.kind == kind
    assert isinstance(lm.head, BoundHead) and lm.head.hidden_convention == "post_norm"
    assert lm.target.hidden_convention == "post_norm"


@pytest.mark.numerics
@pytest.mark.parametrize("name", ["ds", "q3", "qn"])
def test_head_is_the_checkpoint_head_on_the_post_norm_hidden(lms, ckpts, name):
    """The head's input is the target's hidden after its final norm (mlx-lm's model.model(x)),
    and its output is the manual forward of the tensors saved under their real names (HF layout:
    experts one by one, MLA kv_b_proj, Qwen3-Next's zero-centred norms)."""
    lm, ref = lms[name], ckpts[name][1]
    _, hidden = lm.target(X[:, :-1], cache=None)
    assert mx.array_equal(hidden, lm.target.model.model(X[:, :-1])).item()  # the same ops: bit-exact
    got = lm.head(X[:, 1:], hidden, None)
    want = manual_head(lm, ref, X[:, 1:], hidden)  # other kernels (mask form, fused projections)
    assert_close(got, want)
    assert lm.head.logits(got).shape == (1, len(PROMPT) - 1, 2048)


@pytest.mark.parametrize("name,changed,ignored", [
    ("ds", "model.layers.61.eh_proj.weight", "model.layers.61.shared_head.head.weight"),
    ("q3", "mtp.layers.0.self_attn.o_proj.weight", None)])
def test_head_reads_its_tensors_by_their_real_names(lms, ckpts, tmp_path, name, changed, ignored):
    """Perturb one tensor on disk: the head's output moves. A copy of the target's own weights
    (DeepSeek's shared_head.head) is not read: the target's LM head is shared."""
    src = ckpts[name][0]
    _, hidden = lms[name].target(X[:, :-1], cache=None)
    base = lms[name].head(X[:, 1:], hidden, None)
    for key, should_change in ((changed, True), (ignored, False)):
        if key is None:
            continue
        d = tmp_path / f"{name}-{key}"
        shutil.copytree(src, d)
        f = next(f for f in sorted(d.glob("*.safetensors")) if key in mx.load(str(f)))
        tensors = mx.load(str(f))
        tensors[key] = tensors[key] * 1.5
        mx.save_safetensors(str(f), tensors)
        out = load(d).head(X[:, 1:], hidden, None)
        assert (not mx.allclose(out, base).item()) == should_change, key


@pytest.mark.parametrize("name", ["ds", "q3", "qn", "bare"])
def test_mlx_lm_model_loads_unchanged(lms, ckpts, name):
    lm = lms[name]
    model, _ = mlx_lm.load(str(ckpts[name][0]))
    ref = model(X)
    assert mx.array_equal(lm.target.logits(X, cache=None), ref).item()
    assert mx.array_equal(lm.target(X, cache=None)[0], ref).item()


def test_hf_qwen3_next_round_trip_and_rollback(lms, ckpts):
    """mlx-lm reads the HF-layout qwen3_next back to the weights it was built from, and its
    linear-attention layers roll back (per-position capture), so it speculates; a target with a
    blocker is explained."""
    lm, model = lms["qn"], ckpts["qn"][2]
    want = dict(tree_flatten(model.parameters()))
    for k, v in tree_flatten(lm.target.model.parameters()):
        np.testing.assert_allclose(np.array(v), np.array(want[k]), rtol=1e-6, atol=1e-6, err_msg=k)
    assert lm.can_rollback and lm.rollback_blockers == () and speculates(lm)
    blocked = dataclasses.replace(lm, rollback_blockers=("ArraysCache (Mamba2Block: ...)",))
    assert not speculates(blocked)
    assert "Mamba2Block" in no_rollback_message(blocked) and "without speculation" in no_rollback_message(blocked)
    assert lm.is_moe and lm.default_cap == 1 and "MoE" in lm.cap_source
    assert lms["ds"].can_rollback and speculates(lms["q3"])


def test_checkpoint_without_a_head_loads_plain(lms, ckpts):
    lm = lms["bare"]
    assert not lm.has_drafter and lm.head is None and lm.drafter_kind is None
    assert no_drafter_message(lm) == (f"no MTP head in {ckpts['bare'][0]}; run with --no-speculative, or draft"
                                      " with --drafter ngram (prompt lookup) or --draft-model PATH")
    with pytest.raises(NoDrafterError):
        engine(lm, None, speculative=True)
    assert load(ckpts["q3"][0], drafter=False).head is None


def test_gmlx_head_wins_over_the_native_one(ckpts, tmp_path):
    from gmlx.heads.mtp_head import MTPConfig, MTPHead

    d = tmp_path / "both"
    shutil.copytree(ckpts["q3"][0], d)
    cfg = MTPConfig(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
    (d / "mtp_config.json").write_text(__import__("json").dumps(cfg.to_dict()))
    mx.save_safetensors(str(d / "mtp_head.safetensors"), dict(tree_flatten(MTPHead(cfg).parameters())))
    lm = load(d)
    assert lm.drafter_kind == "mtp" and lm.head.kind == "mtp" and lm.head.module.config == cfg


# -- the bound interface -----------------------------------------------------------------------
@pytest.mark.numerics
@pytest.mark.parametrize("name", ["ds", "q3"])
def test_bound_head_caches_incrementally_and_per_row(lms, name):
    """Teacher-forcing P entries at once equals feeding them in two calls on one cache; a
    right-padded batch on a RaggedKVCache, trimmed per row, then chained one step, equals each
    row alone on its own KVCache (what the batch loop relies on)."""
    head = lms[name].head
    _, hidden = lms[name].target(X[:, :-1], cache=None)
    toks, p = X[:, 1:], hidden.shape[1]
    whole = head(toks, hidden, head.make_cache())
    c = head.make_cache()
    parts = mx.concatenate([head(toks[:, :4], hidden[:, :4], c), head(toks[:, 4:], hidden[:, 4:], c)], axis=1)
    assert_close(parts, whole, msg="two calls vs one")
    assert isinstance(c, KVCache) and c.offset == p

    short = p - 3  # row 1 has 3 fewer pending entries (right padding)
    rc = RaggedKVCache(2)
    out = head(mx.concatenate([toks, toks], axis=0), mx.concatenate([hidden, hidden], axis=0), rc)
    trim_rows([rc], np.array([0, p - short]))
    nxt = mx.array([[11], [11]], dtype=mx.int32)
    g_batch = head(nxt, mx.concatenate([out[:1, p - 1:], out[1:, short - 1:short]], axis=0), rc)
    for row, n in ((0, p), (1, short)):
        c1 = head.make_cache()
        g1 = head(toks[:, :n], hidden[:, :n], c1)[:, -1:]
        solo = head(nxt[:1], g1, c1)
        assert_close(g_batch[row:row + 1], solo, msg=f"batch row {row} vs alone")


# -- speculation never moves a token -----------------------------------------------------------
# These go through gmlx.engine.oracle.run_scalar and the engine, i.e. gmlx/decode's loops. Until
# the drafter protocol lands there, those loops call the head the old way and BoundHead serves
# that call (BoundHead._legacy); afterwards the same tests run the bound interface.
@pytest.mark.parametrize("name", ["ds", "q3", "qn"])
@pytest.mark.parametrize("temp,seed", [(0.0, 0), (0.8, 3)])
def test_scalar_speculation_equals_plain(lms, name, temp, seed):
    lm = lms[name]
    params = SamplingParams(temperature=temp, max_tokens=16, seed=seed)
    plain = run_scalar(lm, PROMPT, params, speculative=False, eos_ids=[])
    spec = run_scalar(lm, PROMPT, params, speculative=True, eos_ids=[])
    assert spec.stats.num_drafted > 0
    same_stream(lm, PROMPT, plain.tokens, spec.tokens, params)


@pytest.mark.parametrize("name", ["ds", "q3", "qn"])
def test_batch_speculation_equals_plain(lms, name):
    lm = with_eos(lms[name], [])
    params = SamplingParams(temperature=0.0, max_tokens=12, seed=1)
    prompts = {"a": PROMPT, "b": PROMPT[3:] + [8, 9]}
    run = drive(engine(lm, 0, speculative=True), {0: [(k, p, params) for k, p in prompts.items()]})
    for k, p in prompts.items():
        ref = run_scalar(lm, p, params, speculative=False, eos_ids=[]).tokens
        same_stream(lm, p, ref, run.streams[k].result.tokens, params)
    assert sum(run.streams[k].result.stats["num_drafted"] for k in prompts) > 0


# -- the target's hidden conventions -----------------------------------------------------------
def test_pre_norm_target_returns_the_residual_stream_and_the_same_logits(lms):
    """A pre-norm target hands drafters the hidden before the final norm (manual forward), with
    logits bit-identical to mlx-lm's; the mlx-lm model itself is never modified."""
    from gmlx.models.adapter import Target

    model = lms["q3"].target.model
    pre = Target(model, hidden_convention="pre_norm")
    pre.check()
    h = model.model.embed_tokens(X)
    for layer in model.model.layers:
        h = layer(h, "causal", None)
    logits, hidden = pre(X, cache=None)
    assert mx.array_equal(hidden, h).item()
    assert mx.array_equal(logits, model(X)).item() and mx.array_equal(pre.logits(X, None), model(X)).item()
    assert mx.array_equal(pre.final_norm(hidden), model.model(X)).item()
    # (mlx-lm's RMSNorm, or on the CPU backend its fused subclass: gmlx/models/cpu_fused.py)
    assert isinstance(model.model.norm, nn.RMSNorm) and pre.final_norm is model.model.norm
    with pytest.raises(ValueError):
        Target(model, hidden_convention="sideways")
