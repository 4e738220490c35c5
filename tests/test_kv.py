"""RaggedKVCache must decode exactly like per-row mlx-lm KVCaches."""

import gmlx  # noqa: F401  (loads OpenBLAS before mlx.core)

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from numerics import assert_close
from mlx_lm.models import llama
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache, make_prompt_cache

from gmlx.kv import RaggedKVCache
from gmlx.model_cache import (
    cache_nbytes,
    extend_rows,
    extract_row,
    filter_rows,
    lift_caches,
    make_ragged_cache,
    trim_rows,
)

VOCAB = 256
pytestmark = pytest.mark.numerics  # batched vs per-row forwards: compared to within rounding


@pytest.fixture(scope="module")
def model():
    mx.random.seed(0)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=VOCAB,
        tie_word_embeddings=True,
    )
    m = llama.Model(args)
    m.set_dtype(mx.float32)
    mx.eval(m.parameters())
    return m


def toks(rng, n):
    return rng.integers(0, VOCAB, size=n).tolist()


class Ref:
    """One sequence decoded alone with mlx-lm KVCaches."""

    def __init__(self, model, prompt):
        self.model = model
        self.cache = make_prompt_cache(model)
        self.logits = self.feed(prompt)

    def feed(self, tokens):
        out = self.model(mx.array([tokens]), cache=self.cache)[0]
        mx.eval(out, [c.state for c in self.cache])
        return out

    def trim(self, n):
        for c in self.cache:
            c.trim(n)

    @property
    def length(self):
        return self.cache[0].offset


def feed_batch(model, cache, rows):
    """All rows get the same number of new tokens; returns logits [B, L, V]."""
    out = model(mx.array(rows), cache=cache)
    mx.eval(out, [c.state for c in cache])
    return out


def decode_and_compare(model, cache, refs, rng, steps, width):
    for _ in range(steps):
        rows = [toks(rng, width) for _ in refs]
        out = feed_batch(model, cache, rows)
        for b, (ref, r) in enumerate(zip(refs, rows)):
            assert_close(out[b], ref.feed(r))
        assert list(cache[0].lengths) == [r.length for r in refs]


def test_right_padded_prefill_then_trim(model):
    rng = np.random.default_rng(0)
    prompts = [toks(rng, n) for n in (5, 9, 3)]
    refs = [Ref(model, p) for p in prompts]
    P = max(map(len, prompts))
    cache = make_ragged_cache(model, batch_size=len(prompts))
    out = feed_batch(model, cache, [p + [0] * (P - len(p)) for p in prompts])
    for b, (p, ref) in enumerate(zip(prompts, refs)):
        assert_close(out[b, : len(p)], ref.logits)
    trim_rows(cache, [P - len(p) for p in prompts])
    decode_and_compare(model, cache, refs, rng, steps=4, width=1)
    decode_and_compare(model, cache, refs, rng, steps=2, width=3)


def test_lift_then_decode(model):
    rng = np.random.default_rng(1)
    refs = [Ref(model, toks(rng, n)) for n in (7, 2, 12, 4)]
    cache = lift_caches([[c for c in r.cache] for r in refs])
    # lift copies, so refs keep their own storage
    assert list(cache[0].lengths) == [7, 2, 12, 4]
    decode_and_compare(model, cache, refs, rng, steps=3, width=1)
    decode_and_compare(model, cache, refs, rng, steps=2, width=4)


def test_per_row_rollback(model):
    rng = np.random.default_rng(2)
    refs = [Ref(model, toks(rng, n)) for n in (6, 3, 10)]
    cache = lift_caches([r.cache for r in refs])
    L = 4
    for _ in range(4):
        decode_and_compare(model, cache, refs, rng, steps=1, width=L)
        ns = rng.integers(0, L + 1, size=len(refs))
        trim_rows(cache, ns)
        for ref, n in zip(refs, ns):
            ref.trim(int(n))
        assert list(cache[0].lengths) == [r.length for r in refs]
    decode_and_compare(model, cache, refs, rng, steps=2, width=1)


def test_growth_across_step(model):
    rng = np.random.default_rng(3)
    refs = [Ref(model, toks(rng, n)) for n in (250, 9)]
    cache = lift_caches([r.cache for r in refs])
    assert cache[0].capacity == 256
    decode_and_compare(model, cache, refs, rng, steps=3, width=4)
    assert cache[0].capacity == 512


def test_uniform_trim_and_mask_forms(model):
    c = RaggedKVCache(2)
    assert c.make_mask(1) is None and c.make_mask(3) == "causal"
    k = mx.ones((2, 2, 5, 16))
    c.update_and_fetch(k, k)
    assert c.trim(2) == 2 and list(c.lengths) == [3, 3] and c.is_trimmable()
    c.trim_rows([1, 0])
    with pytest.raises(ValueError):
        c.trim_rows([3, 0])  # row 0 only has 2
    for window in (None, 2):
        m = np.array(c.make_mask(3, window_size=window))
        assert m.shape == (2, 1, 3, 6)
        for b, n in enumerate(c.lengths):
            want = np.array(create_causal_mask(3, int(n), window_size=window))
            assert (m[b, 0, :, : n + 3] == want).all()
            assert not m[b, 0, :, n + 3 :].any()


def test_extract_round_trip(model):
    rng = np.random.default_rng(4)
    refs = [Ref(model, toks(rng, n)) for n in (8, 3, 5)]
    cache = lift_caches([r.cache for r in refs])
    decode_and_compare(model, cache, refs, rng, steps=1, width=2)
    trim_rows(cache, [1, 0, 2])
    for ref, n in zip(refs, [1, 0, 2]):
        ref.trim(n)
    for i, ref in enumerate(refs):
        single = extract_row(cache, i)
        for s, r in zip(single, ref.cache):  # K/V from a width-2 batched decode vs the row's own
            assert s.offset == r.offset
            assert_close(s.keys, r.keys[..., : r.offset, :])
            assert_close(s.values, r.values[..., : r.offset, :])
        # the extracted caches keep decoding like the reference
        t = toks(rng, 2)
        out = model(mx.array([t]), cache=single)[0]
        assert_close(out, ref.feed(t))
        # extract copied: the batch is untouched
        assert cache[0].lengths[i] == ref.length - 2


def test_filter_frees_and_keeps_rows(model):
    rng = np.random.default_rng(5)
    refs = [Ref(model, toks(rng, n)) for n in (300, 4, 260, 6)]
    cache = lift_caches([r.cache for r in refs])
    before = cache_nbytes(cache)
    assert cache[0].capacity == 512
    filter_rows(cache, [3, 1])
    refs = [refs[3], refs[1]]
    assert cache[0].capacity == 256
    assert cache_nbytes(cache) == before * 2 // 4 // 2
    decode_and_compare(model, cache, refs, rng, steps=2, width=2)


def test_lift_different_offsets_and_empty():
    mx.random.seed(1)
    singles = []
    for n in (0, 3, 300, 1):
        c = KVCache()
        if n:
            kv = mx.random.normal((1, 2, n, 8))
            c.update_and_fetch(kv, kv * 2)
        singles.append(c)
    r = RaggedKVCache.lift(singles)
    assert list(r.lengths) == [0, 3, 300, 1] and r.capacity == 512
    for i, c in enumerate(singles):
        e = r.extract(i)
        assert e.offset == c.offset
        if c.offset:  # lift and extract only copy: bit-exact
            assert mx.array_equal(e.keys, c.keys[..., : c.offset, :]).item()
            assert mx.array_equal(e.values, c.values[..., : c.offset, :]).item()
        else:
            assert e.empty()
    assert RaggedKVCache.lift([KVCache(), KVCache()]).empty()
    # state round trip
    s = RaggedKVCache()
    s.state = r.state
    assert list(s.lengths) == list(r.lengths) and s.nbytes == r.nbytes


def test_extend_mixed_capacity():
    a = RaggedKVCache.lift([_kv(3), _kv(5)])
    b = RaggedKVCache.lift([_kv(270)])
    e = RaggedKVCache(1)  # no storage yet
    a.extend(b)
    a.extend(e)
    assert list(a.lengths) == [3, 5, 270, 0] and a.capacity == 512
    assert mx.array_equal(a.extract(2).keys, b.extract(0).keys).item()  # copies: bit-exact


def _kv(n):
    c = KVCache()
    kv = mx.random.normal((1, 2, n, 8))
    c.update_and_fetch(kv, kv)
    return c


op = st.one_of(
    st.tuples(st.just("append"), st.integers(1, 3)),
    st.tuples(st.just("trim"), st.integers(0, 2**31)),
    st.tuples(st.just("filter"), st.integers(0, 2**31)),
    st.tuples(st.just("extend"), st.integers(1, 6)),
    st.tuples(st.just("extract"), st.integers(0, 2**31)),
)


@settings(max_examples=25, deadline=None)
@given(
    prompts=st.lists(st.integers(1, 8), min_size=1, max_size=3),
    ops=st.lists(op, min_size=1, max_size=6),
    seed=st.integers(0, 2**16),
)
def test_random_operations(model, prompts, ops, seed):
    rng = np.random.default_rng(seed)
    refs = [Ref(model, toks(rng, n)) for n in prompts]
    cache = lift_caches([r.cache for r in refs])
    for name, arg in ops:
        r = np.random.default_rng(arg)
        if name == "append":
            decode_and_compare(model, cache, refs, rng, steps=1, width=arg)
        elif name == "trim":
            ns = [int(r.integers(0, ref.length + 1)) for ref in refs]
            trim_rows(cache, ns)
            for ref, n in zip(refs, ns):
                ref.trim(n)
        elif name == "filter":
            keep = r.permutation(len(refs))[: r.integers(1, len(refs) + 1)].tolist()
            filter_rows(cache, keep)
            refs = [refs[i] for i in keep]
        elif name == "extend":
            new = Ref(model, toks(rng, arg))
            extend_rows(cache, lift_caches([new.cache]))
            refs.append(new)
        else:
            i = int(r.integers(0, len(refs)))
            for s, c in zip(extract_row(cache, i), refs[i].cache):
                assert s.offset == c.offset
                if c.offset:
                    assert_close(s.keys, c.keys[..., : c.offset, :])
        assert list(cache[0].lengths) == [ref.length for ref in refs]
    decode_and_compare(model, cache, refs, rng, steps=1, width=1)
