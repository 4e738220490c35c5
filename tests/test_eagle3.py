"""EAGLE-3 heads in their public layout (`--drafter eagle3 --draft-model PATH`,
gmlx/heads/eagle3_*.py), on tiny random llama and qwen3 targets with tiny random checkpoints
written with the released tensor names: the captured residual streams against a manual layer
loop, which layers (the default and `eagle_aux_hidden_state_layer_ids`), the layout checks, the
engine's oracle (every stream equals its solo plain stream, greedy and seeded, through scalar,
preempt, batch, gate and resume) and acceptance when the head is made to agree."""

from __future__ import annotations

import json
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest

from eagle3_fixtures import random_target, write_eagle3
from engine_helpers import P, check_solo, drive, solo
from gmlx import Engine, EngineConfig
from gmlx.config import Switches
from gmlx.errors import GmlxError, ModelLoadError
from gmlx.drafters.eagle3 import load_eagle3
from gmlx.heads.eagle3_streams import AuxTarget, layers_entering
from gmlx.models.loading import load

FAMILIES = ["llama", "qwen3"]


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """family -> (loaded target, its directory); the targets wander (scale 3)."""
    out = {}
    for fam in FAMILIES:
        d = random_target(fam, tmp_path_factory.mktemp("target") / fam)
        out[fam] = (load(d), d)
    return out


def prompt(i: int, salt: str = "") -> list[int]:
    """Prompt i; `salt` (the model) keeps the session-wide solo cache (keyed by prompt and params,
    not by model) from mixing up the several random targets' streams."""
    k = sum(map(ord, salt)) % 97
    return [(37 * i + 11 * j + 13 * k) % 1900 + 5 for j in range(12 + 3 * i)]


def manual_streams(model, tokens: mx.array, entering) -> tuple[mx.array, mx.array]:
    """The residual stream entering each layer, by running mlx-lm's layers one by one."""
    backbone = model.model
    h = backbone.embed_tokens(tokens)
    from mlx_lm.models.base import create_attention_mask

    mask = create_attention_mask(h, None)
    seen = []
    for layer in backbone.layers:
        seen.append(h)
        h = layer(h, mask, None)
    seen.append(h)
    return mx.concatenate([seen[i] for i in entering], axis=-1), model(tokens)


@pytest.mark.parametrize("fam", FAMILIES)
def test_captured_streams_and_logits(targets, fam):
    lm, _ = targets[fam]
    x = mx.array([prompt(1)], dtype=mx.int32)
    for entering in ((2, 3, 3), (1, 4, 6)):
        aux = AuxTarget(lm.target, entering)
        logits, hidden = aux(x, cache=None)
        want_hidden, want_logits = manual_streams(lm.target.model, x, entering)
        assert hidden.shape == (1, x.shape[1], 3 * lm.target.hidden_size)
        assert mx.allclose(hidden, want_hidden, atol=1e-4).item() and mx.allclose(logits, want_logits, atol=1e-3).item()
    # the loaded model is untouched: its own forward still returns the post-norm hidden
    _, h = lm.target(x, cache=None)
    assert h.shape[-1] == lm.target.hidden_size
    with pytest.raises(ModelLoadError, match="outside"):
        AuxTarget(lm.target, (0, 2, 3))


def test_which_layers(monkeypatch):
    assert layers_entering({}, 32) == (2, 16, 29)  # EAGLE-3's default: the stream entering 2, L/2, L-3
    ids = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}}
    assert layers_entering(ids, 32) == (2, 16, 29)  # SGLang: ids name layer outputs
    assert layers_entering({"eagle_aux_hidden_state_layer_ids": [0, 3, 5]}, 6) == (1, 4, 6)
    monkeypatch.setenv("GMLX_EAGLE3_LAYERS", "1,2,3")
    assert layers_entering(ids, 32) == (1, 2, 3)


@pytest.mark.parametrize("fam", FAMILIES)
def test_the_released_layout_loads(targets, fam, tmp_path):
    lm, tdir = targets[fam]
    e3 = write_eagle3(tmp_path / "e3", tdir, layer_ids=[0, 2, 4])
    names = set(mx.load(str(e3 / "model.safetensors")))
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.hidden_norm.weight", "lm_head.weight",
            "d2t", "t2d", "norm.weight"} <= names
    view, drafter = load_eagle3(e3, lm)
    assert view.target.entering == (1, 3, 5) and view.drafter_kind == "eagle3" and drafter.kind == "eagle3"
    assert view.head.ids.shape == (96,) and lm.head is None and lm.target is not view.target
    g = view.head(mx.array([[5, 6]]), mx.zeros((1, 2, view.target.aux_size)), None)
    assert view.head.logits(g).shape == (1, 2, lm.target.vocab_size)
    # prefixed names, its own embedding at another width
    other = write_eagle3(tmp_path / "own", tdir, hidden=48, embed=True, prefix="model.")
    view, _ = load_eagle3(other, lm)
    assert view.head.embed(mx.array([[3]])).shape == (1, 1, 48)


def test_target_rows_without_lm_head(targets, tmp_path):
    """No lm_head.weight but a d2t map (how gmlx ships its SmolLM2 head): the draft vocabulary is
    scored with the target's own LM-head rows for those ids, and every other id is never drafted."""
    lm, tdir = targets["llama"]
    e3 = write_eagle3(tmp_path / "e3", tdir, dtype=mx.float32)
    w = mx.load(str(e3 / "model.safetensors"))
    w.pop("lm_head.weight")
    mx.save_safetensors(str(e3 / "model.safetensors"), w)
    view, _ = load_eagle3(e3, lm)
    g = view.head(mx.array([[5, 6]]), mx.ones((1, 2, view.target.aux_size)), None)
    logits = view.head.logits(g)
    ids = view.head.ids
    want = lm.target.lm_head(view.head.module.norm(g))[..., ids]
    assert mx.allclose(logits[..., ids], want, atol=1e-4).item()
    others = mx.ones((lm.target.vocab_size,), dtype=mx.bool_).at[ids].add(-1)  # ids not drafted
    assert (mx.where(others, logits, 0) <= -1e8).sum().item() == 2 * (lm.target.vocab_size - ids.shape[0])
    w.pop("d2t")
    mx.save_safetensors(str(e3 / "model.safetensors"), w)
    with pytest.raises(ModelLoadError, match="no lm_head.weight, nor a d2t map"):
        load_eagle3(e3, lm)


def test_layout_errors(targets, tmp_path):
    lm, tdir = targets["llama"]
    e3 = write_eagle3(tmp_path / "e3", tdir)
    cfg = json.loads((e3 / "config.json").read_text())
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ModelLoadError, match="not an EAGLE-3 checkpoint"):
        load_eagle3(bad, lm)
    (bad / "config.json").write_text(json.dumps({**cfg, "vocab_size": 999}))
    with pytest.raises(ModelLoadError, match="trained for a target"):
        load_eagle3(bad, lm)
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="no model"):
        load_eagle3(bad, lm)
    w = mx.load(str(e3 / "model.safetensors"))
    w.pop("midlayer.hidden_norm.weight")
    mx.save_safetensors(str(bad / "model.safetensors"), w)
    with pytest.raises(ModelLoadError, match="missing midlayer.hidden_norm.weight"):
        load_eagle3(bad, lm)
    with pytest.raises(GmlxError, match="--draft-model"):
        Engine(lm, EngineConfig(drafter="eagle3"))


# ---- the engine's oracle --------------------------------------------------------------------

@pytest.mark.parametrize("fam", FAMILIES)
@pytest.mark.parametrize("t", [0.0, 0.8])
def test_schedule_equals_solo(targets, fam, t, tmp_path):
    """A scalar start preempted by two waiters, a batch over the cap (gated) and re-armed, with a
    random head and with one that agrees with the target's most frequent token: every stream
    equals its solo plain stream."""
    lm, tdir = targets[fam]
    common = Counter(solo(lm, prompt(0, fam), P(40, seed=1, t=t))).most_common(1)[0][0]
    for agree in (None, common):
        e3 = write_eagle3(tmp_path / f"e3-{agree}", tdir, agree_with=agree)
        eng = Engine(lm, EngineConfig(drafter="eagle3", draft_model=str(e3), width_cap=2, resume_min_remaining=2,
                                      num_draft_tokens=3), switches=Switches(preempt=True, resume=True))
        run = drive(eng, {0: [("a", prompt(0, fam), P(40, seed=1, t=t))],
                          2: [("b", prompt(1, fam), P(14, seed=2, t=t)), ("c", prompt(2, fam), P(10, seed=3, t=t))],
                          5: [("d", prompt(3, fam), P(12, seed=4, t=t))]})
        assert check_solo(eng.lm, run) <= 1
        tr = run.transitions()
        assert "preempt" in tr and "gate" in tr and "resume" in tr, tr
        drafted = sum(d for _, e in run.rounds() for _, d, _, _ in e.rows)
        assert drafted > 0
        eng.close()


@pytest.mark.parametrize("fam", FAMILIES)
def test_an_agreeing_head_is_accepted(fam, tmp_path):
    """On a target whose greedy stream repeats one token (mlx's init, unscaled), a head whose
    drafts are that token is accepted wherever it recurs; a random head (next to) never."""
    tdir = random_target(fam, tmp_path / "t", scale=1.0)
    lm = load(tdir)
    ref = solo(lm, prompt(0, fam + "-unscaled"), P(48, seed=0))
    common = Counter(ref).most_common(1)[0][0]
    rates = {}
    for agree in (None, common):
        e3 = write_eagle3(tmp_path / f"e3-{agree}", tdir, agree_with=agree)
        eng = Engine(lm, EngineConfig(drafter="eagle3", draft_model=str(e3), num_draft_tokens=3))
        rec = eng.generate(prompt(0, fam + "-unscaled"), P(48, seed=0))
        eng.close()
        assert rec.tokens == ref
        rates[agree] = rec.stats["draft_acceptance_rate"]
    assert rates[common] > 0.2 and rates[common] > rates[None], rates


def test_with_a_prediction(targets, tmp_path):
    """The EAGLE-3 drafter is wrapped for predicted outputs like every other kind."""
    lm, tdir = targets["qwen3"]
    e3 = write_eagle3(tmp_path / "e3", tdir)
    ref = solo(lm, prompt(2, "qwen3"), P(40, seed=0))
    eng = Engine(lm, EngineConfig(drafter="eagle3", draft_model=str(e3)))
    rec = eng.generate(prompt(2, "qwen3"), P(40, seed=0, prediction=tuple(ref)))
    eng.close()
    assert rec.tokens == ref and rec.stats["accepted_prediction_tokens"] == 40


def test_cli(targets, tmp_path):
    from test_cli import run

    _, tdir = targets["llama"]
    e3 = write_eagle3(tmp_path / "e3", tdir)

    def gen(*args):
        r = run("generate", "def f(x):", "--model", str(tdir), "--max-tokens", "24", "--seed", "3", "--temp", "0",
                "--no-chat", "--json", *args)
        assert r.code == 0, r.stderr
        return json.loads(r.stdout)

    spec, plain = gen("--drafter", "eagle3", "--draft-model", str(e3), "--num-draft-tokens", "2"), gen("--no-speculative")
    assert spec["tokens"] == plain["tokens"] and spec["num_drafted"] > 0
    r = run("generate", "x", "--model", str(tdir), "--drafter", "eagle3", "--draft-model", str(tmp_path))
    assert r.code == 1 and "EAGLE-3" in r.stderr, r.stderr
    np.testing.assert_equal(len(spec["tokens"]), 24)
