"""The KV-sharing assistant head drafts at inference exactly as it was trained, row by row."""

import gmlx  # noqa: F401  (loads OpenBLAS before mlx.core)

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from numerics import assert_close

from gmlx.kv import RaggedKVCache
from gmlx.heads.assistant_head import (
    AssistantConfig,
    AssistantHead,
    causal_key_mask,
    key_mask,
    load_assistant,
    save_assistant,
)

N = 24  # teacher-forced window


@pytest.fixture(scope="module")
def setup(lm):
    mx.random.seed(3)
    cfg = AssistantConfig.for_target(lm.config, intermediate_size=128)
    head = AssistantHead(cfg)
    mx.eval(head.parameters())
    rng = np.random.default_rng(0)
    x = mx.array(rng.integers(1, lm.target.vocab_size, size=(1, N + 1)).astype(np.int32))
    return lm.target, head, x


def prefix(target, kv_layer, tokens):
    """Target cache over `tokens` [1, n]: (hidden [1, n, D], keys, values [1, Hkv, n, Dh])."""
    cache = make_prompt_cache(target.model)
    hid = target.backbone(tokens, cache=cache)
    c = cache[kv_layer]  # its storage is longer than the prefix: keep the valid part
    return hid, c.keys[:, :, : c.offset], c.values[:, :, : c.offset]


def teacher_forced(target, head, x):
    """Training-time forward: depth 1 (predicts i+2) and chained depth 2 (predicts i+3)."""
    hid, keys, values = prefix(target, head.config.kv_layer, x[:, :N])
    emb, norm = target.embed_tokens, target.final_norm
    g1 = head(emb(x[:, 1:N]), hid[:, :-1], keys, values, mx.array([1]), causal_key_mask(N - 1, N), norm)
    g2 = head(emb(x[:, 2:N]), g1[:, :-1], keys, values, mx.array([2]), causal_key_mask(N - 2, N), norm)
    return g1, g2


@pytest.mark.numerics
def test_inference_step_matches_teacher_forced(setup):
    target, head, x = setup
    g1, g2 = teacher_forced(target, head, x)
    emb, norm = target.embed_tokens, target.final_norm
    for t in (0, 5, N - 3):
        hid, keys, values = prefix(target, head.config.kv_layer, x[:, : t + 1])  # cache holds 0..t
        mask = key_mask([t + 1], keys.shape[2])
        d1 = head(emb(x[:, t + 1 : t + 2]), hid[:, -1:], keys, values, mx.array([t + 1]), mask, norm)
        d2 = head(emb(x[:, t + 2 : t + 3]), d1, keys, values, mx.array([t + 2]), mask, norm)
        assert_close(d1[:, 0], g1[:, t])  # one step vs the teacher-forced window: other shapes
        assert_close(d2[:, 0], g2[:, t])


@pytest.mark.numerics
def test_the_trainers_unroll_is_the_drafting_chain(setup):
    """gmlx_training.train_drafters trains depths 1-3 through `assistant_unroll`: each depth must
    be the step the drafter runs after the target cached 0..t, chained on the previous output."""
    from gmlx_training.train_drafters import assistant_unroll

    target, head, x = setup
    teacher, gs = assistant_unroll(head, target, x, 3)
    assert [g.shape[1] for g in gs] == [N - 1, N - 2, N - 3] and teacher.shape[1] == N
    emb, norm = target.embed_tokens, target.final_norm
    for t in (0, 6, N - 4):
        hid, keys, values = prefix(target, head.config.kv_layer, x[:, : t + 1])
        mask, g = key_mask([t + 1], keys.shape[2]), hid[:, -1:]
        assert_close(target.lm_head(hid[:, -1]), teacher[:, t])
        for d in range(1, 4):
            g = head(emb(x[:, t + d : t + d + 1]), g, keys, values, mx.array([t + d]), mask, norm)
            assert_close(g[:, 0], gs[d - 1][:, t])


@pytest.mark.numerics
def test_ragged_batch_equals_rows_alone(setup):
    target, head, x = setup
    kv, emb, norm = head.config.kv_layer, target.embed_tokens, target.final_norm
    lengths = [7, 19]
    rows, caches = [], []
    for n in lengths:
        cache = make_prompt_cache(target.model)
        hid = target.backbone(x[:, :n], cache=cache)
        rows.append((hid[:, -1:], x[:, n : n + 1], cache[kv].keys[:, :, :n], cache[kv].values[:, :, :n]))
        caches.append(cache[kv])
    batch = RaggedKVCache.lift(caches)  # left-aligned rows, padded past each length
    T = batch.keys.shape[2]
    hidden = mx.concatenate([r[0] for r in rows])
    embeds = emb(mx.concatenate([r[1] for r in rows]))
    q_offset = mx.array(lengths, dtype=mx.int32)
    out = head(embeds, hidden, batch.keys, batch.values, q_offset, key_mask(lengths, T), norm)
    for b, (h, tok, k, v) in enumerate(rows):
        alone = head(emb(tok), h, k, v, q_offset[b : b + 1], key_mask([lengths[b]], k.shape[2]), norm)
        assert_close(out[b : b + 1], alone)


def test_key_mask_shapes():
    m = key_mask(np.array([1, 3]), T=4, L=2)
    assert m.shape == (2, 1, 2, 4)
    assert m.tolist()[1][0][1] == [True, True, True, False]  # sync: test assertion
    assert causal_key_mask(2, 3).tolist() == [[[[True, False, False], [True, True, False]]]]  # sync: test assertion


def test_load_assistant_round_trip(setup, tmp_path):
    target, head, x = setup
    assert load_assistant(tmp_path) is None
    save_assistant(head, tmp_path)
    loaded = load_assistant(tmp_path)
    assert loaded.config == head.config
    hid, keys, values = prefix(target, head.config.kv_layer, x[:, :9])
    args = (target.embed_tokens(x[:, 9:10]), hid[:, -1:], keys, values, mx.array([9]), key_mask([9], 9))
    a = head(*args, target.final_norm)
    b = loaded(*args, target.final_norm)
    assert mx.array_equal(a, b).item()  # the same computation on the same weights: bit-exact


def test_shipped_drafters_load(lm):
    """The embedded model ships both extra drafters, fitted to its geometry and tokenizer."""
    import mlx_lm

    from gmlx.models.loading import default_model_path

    path = default_model_path()
    head = load_assistant(path)
    assert head is not None
    assert head.config.kv_layer == lm.target.num_layers - 1
    assert head.config.hidden_size == lm.target.hidden_size
    draft, tokenizer = mlx_lm.load(str(path / "draft"))
    assert draft.args.vocab_size == lm.target.vocab_size
    text = "def f(x):\n    return x + 1\n"
    assert tokenizer.encode(text) == lm.tokenizer.encode(text)


def _drafts(drafter, lm, prompt, k=3):
    """Greedy drafts from the state a prefill of `prompt` leaves (the target's cache over all but
    the last token, whose hidden and the last token seed the chain)."""
    from gmlx.drafters.assistant import AssistantRows
    from gmlx.drafters.base import DraftPick

    cache = make_prompt_cache(lm.target.model)
    _, hid = lm.target(mx.array([prompt[:-1]], dtype=mx.int32), cache)
    st = AssistantRows(hid[:, -1:], mx.array([[prompt[-1]]], dtype=mx.int32))
    return drafter.draft(st, k, DraftPick(None, np.array([len(prompt)])), cache).tolist()  # sync: test read


def test_the_compiled_draft_chain_is_the_heads_own_and_sees_new_weights(lm, prompts, monkeypatch):
    """The drafter runs the head's query and finish compiled (gmlx/drafters/assistant.py): its drafts
    equal the uncompiled head's (GMLX_COMPILE=0), and weights replaced after it was built are used."""
    from drafter_fixtures import random_assistant

    fast, other = random_assistant(lm, seed=1), random_assistant(lm, seed=2)
    monkeypatch.setenv("GMLX_COMPILE", "0")
    eager = random_assistant(lm, seed=1)
    monkeypatch.delenv("GMLX_COMPILE")
    assert eager._query.__name__ == "<lambda>"  # the plain function: not compiled
    want = [_drafts(eager, lm, p) for p in prompts[:4]]
    assert [_drafts(fast, lm, p) for p in prompts[:4]] == want
    fast.head.update(other.head.parameters())  # new weights into the same module
    assert [_drafts(fast, lm, p) for p in prompts[:4]] == [_drafts(other, lm, p) for p in prompts[:4]] != want
