"""The EAGLE-3 trainer (gmlx_training/train_smollm2_eagle3.py) trains what drafting runs: its
training-time-test unroll equals the head as the engine chains it (one KV cache, depth 1 over the
verified positions, then one chained step per depth), and what it exports loads through
`--drafter eagle3` (the public layout, the target's LM-head rows for its draft vocabulary) with
the same logits. A tiny random llama target; no SmolLM2 weights or data needed."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map
from mlx_lm.models.cache import KVCache

from eagle3_fixtures import random_target
from numerics import assert_close
from gmlx.drafters.eagle3 import load_eagle3
from gmlx.heads.draft_vocab import lm_head_rows
from gmlx.heads.eagle3_checkpoint import layer_args
from gmlx.heads.eagle3_head import Eagle3Model
from gmlx.models.loading import load
from gmlx_training.train_smollm2_eagle3 import config_json, depth_terms, export, unroll

DEPTHS, S = 3, 10


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    lm = load(random_target("llama", tmp_path_factory.mktemp("t") / "llama"))
    t = lm.target
    entering = (2, 3, 5)
    cfg = config_json(t, 96, 64, entering)
    model = Eagle3Model(layer_args(cfg), t.hidden_size, 64, 3, own_lm_head=False)
    # fp16-representable weights, so the exported (float16) head is the same function
    model.update(tree_map(lambda p: (p * 4).astype(mx.float16).astype(mx.float32), model.parameters()))
    rng = np.random.default_rng(0)
    ids = np.sort(rng.choice(np.arange(1, t.vocab_size), size=64, replace=False)).astype(np.int32)
    x = mx.array(rng.integers(1, t.vocab_size, size=(1, S + DEPTHS)).astype(np.int32))
    aux = mx.array(rng.normal(size=(1, S, 3 * t.hidden_size)).astype(np.float32))
    return lm, model, cfg, ids, entering, {"aux": aux, "x": x}


def test_unroll_is_the_drafting_chain(setup):
    lm, model, cfg, ids, entering, b = setup
    embed = lm.target.embed_tokens
    g = unroll(model, embed, b, DEPTHS)
    layer = model.midlayer
    for t in (0, 4, S - 1):
        cache = KVCache()  # verify wrote positions 0..t (target streams, the next tokens)
        h = layer(embed(b["x"][:, 1 : t + 2]), model.fc(b["aux"][:, : t + 1]), "causal" if t else None, cache)
        assert_close(h[:, -1], g[0][:, t], msg=f"{t}")  # one position vs the unrolled batch: other kernels
        for d in range(1, DEPTHS):  # chained: the drafted token (here the true one) and the head's own output
            h = layer(embed(b["x"][:, t + 1 + d : t + 2 + d]), h[:, -1:], None, cache)
            assert_close(h[:, -1], g[d][:, t], msg=f"{t}, {d}")


def test_export_loads_with_the_same_logits(setup, tmp_path):
    lm, model, cfg, ids, entering, b = setup
    export(model, cfg, ids, tmp_path / "e3")
    view, drafter = load_eagle3(tmp_path / "e3", lm)
    assert view.target.entering == entering and drafter.kind == "eagle3"
    assert np.array_equal(np.array(view.head.ids), ids)
    rows = lm_head_rows(lm.target, mx.array(ids))
    batch = {**b, "h": mx.zeros((1, S + DEPTHS, lm.target.hidden_size)), "a": mx.zeros((1, S + DEPTHS), mx.int32),
             "valid": mx.ones((1, S + DEPTHS))}
    g = unroll(model, lm.target.embed_tokens, batch, DEPTHS)
    _, _, sub, _, _ = depth_terms(model, g[0], batch, 1, rows)
    got = view.head.logits(view.head(b["x"][:, 1 : S + 1], b["aux"], None))
    assert mx.allclose(got[..., mx.array(ids)], sub, atol=1e-3, rtol=1e-3).item()


def test_batches_cover_every_example_once_per_epoch():
    from gmlx_training.training import batches

    draws = batches(10, 4, np.random.default_rng(0))
    seen = np.concatenate([next(draws) for _ in range(5)])  # two epochs of 10
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:]) == list(range(10))


def test_held_out_windows_know_their_prompt_kind(tmp_path):
    """shard_kinds reads each shard's kind from its data run's log, so the held-out curve can
    report chat answers apart from code; a run without a log says "?" rather than guess."""
    import json

    from gmlx_training.train_smollm2_eagle3 import shard_kinds, windows

    logged, bare = tmp_path / "logged", tmp_path / "bare"
    shards = []
    for d, n in ((logged, 3), (bare, 1)):
        d.mkdir()
        for i in range(n):
            s = {"tokens": np.arange(6, dtype=np.int32), "hidden": np.zeros((6, 4), np.float16),
                 "argmax": np.arange(6, dtype=np.int32), "aux": np.zeros((6, 12), np.float16),
                 "starts": np.array([0, 6]), "prompt_len": np.array([2]), "temp": np.array([0.0], np.float32)}
            np.savez(d / f"val-{i:04d}.npz", **s)
            shards.append(s)
    batches = [{"split": "val", "kind": k} for k in ("code", "chat")] + [{"split": "train", "kind": "chat"},
                                                                          {"split": "val", "kind": "code"}]
    (logged / "data_log.json").write_text(json.dumps({"batches": batches}))
    kinds = shard_kinds([logged, bare], "val")
    assert kinds == ["code", "chat", "code", "?"]
    w = windows(shards, 4, 2, np.arange(8, dtype=np.int32), kinds)
    assert [bool(c.all()) for c in w["chat"]] == [False, True, False, False]  # one window per 6-token row


def test_coverage_counts_the_target_token_among_the_heads_top_k(setup):
    """replay_smollm2_eagle3.coverage: labels at the head's second-best token at t+2 are in its top
    2 and not its top 1 (and t+3 is then never asked); labels at its best agree with `agreement`."""
    from gmlx_training.replay_smollm2_eagle3 import coverage
    from gmlx_training.train_smollm2_eagle3 import agreement

    lm, model, cfg, ids, entering, b = setup
    embed, rows = lm.target.embed_tokens, lm_head_rows(lm.target, mx.array(ids))
    g1, g2 = unroll(model, embed, b, 2)
    order = np.array(mx.argsort(-(model.norm(g1) @ rows.T), axis=-1))  # sync: test data
    best2 = np.array(mx.argmax(model.norm(g2) @ rows.T, axis=-1))  # sync: test data
    n = S + DEPTHS
    val = {"aux": np.array(b["aux"]), "x": np.array(b["x"]), "h": np.zeros((1, n, lm.target.hidden_size), np.float16),
           "valid": np.ones((1, n), np.bool_), "ans": np.ones((1, S), np.bool_), "chat": np.zeros((1, S), np.bool_)}
    a = np.zeros((1, n), np.int32)
    a[0, 1 : 1 + S] = order[0, :, 1]
    cov = coverage(model, embed, rows, {**val, "a": a}, ks=(1, 2, 4))
    assert cov == {"top1": 0.0, "top2": 1.0, "top4": 1.0, "t3_given_t2": 0.0}
    a[0, 1 : 1 + S] = order[0, :, 0]  # labels are one sequence: t+3's label at t is t+2's at t+1
    cov = coverage(model, embed, rows, {**val, "a": a}, ks=(1,))
    assert cov["top1"] == 1.0 == agreement(model, embed, rows, {**val, "a": a}, 3)["t2"]
    assert cov["t3_given_t2"] == pytest.approx(np.mean(best2[0] == a[0, 2 : 2 + S]))
