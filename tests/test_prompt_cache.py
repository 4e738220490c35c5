"""The prefix cache: exact reuse with a real (tiny) model, copies, selection, byte bound, LRU."""

from collections import OrderedDict

import gmlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache, RotatingKVCache
from numerics import assert_close

from gmlx.prompt_cache import PromptCache

BIG = 1 << 30


@pytest.fixture(scope="module")
def model():
    mx.random.seed(0)
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=256,
                           tie_word_embeddings=True)
    m = llama.Model(args)
    m.set_dtype(mx.float32)
    mx.eval(m.parameters())
    return m


def run(model, tokens, caches=None):
    """Logits [L, V] for `tokens`, continuing `caches` (fresh ones when None); returns both."""
    caches = caches if caches is not None else [KVCache() for _ in model.layers]
    return model(mx.array(tokens)[None], cache=caches)[0], caches


def toks(n, seed):
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


@pytest.mark.numerics
def test_reused_prefix_gives_the_same_logits(model):
    prompt = toks(24, 1)
    full, _ = run(model, prompt)
    pc = PromptCache(BIG)
    # The stored caches hold more positions than the entry (offset 30 > 12): trimmed on insert.
    _, caches = run(model, prompt[:12] + toks(18, 2))
    assert pc.insert(prompt[:12], caches)
    hit = pc.lookup(prompt)
    assert hit.length == 12 and all(c.offset == 12 for c in hit.caches)
    rest, _ = run(model, prompt[12:], hit.caches)
    assert_close(rest, full[12:])  # a prefill in two chunks vs one: equal to within rounding


@pytest.mark.numerics
def test_longer_entry_is_trimmed_and_whole_prompt_never_returned(model):
    prompt = toks(16, 3)
    full, caches = run(model, prompt + toks(4, 4))
    pc = PromptCache(BIG)
    pc.insert(prompt + toks(4, 4), caches, drafter=_Drafter(10))
    hit = pc.lookup(prompt)  # the entry is longer than the prompt: keep one token to run
    assert hit.length == len(prompt) - 1 and hit.drafter is None
    last, _ = run(model, prompt[-1:], hit.caches)
    assert_close(last[-1], full[len(prompt) - 1])
    pc.insert(prompt, caches, drafter=_Drafter(10))
    assert pc.lookup(prompt).length == len(prompt) - 1  # an exact entry too
    assert pc.lookup(prompt[:1]) is None and pc.lookup([]) is None


@pytest.mark.numerics
def test_diverging_entry_shares_its_common_prefix(model):
    a, b = toks(10, 5), toks(10, 6)
    full, _ = run(model, a + b)
    _, caches = run(model, a + toks(7, 7))
    pc = PromptCache(BIG)
    pc.insert(a + toks(7, 7), caches)
    hit = pc.lookup(a + b)
    assert hit.length == 10 + int(b[0] == toks(7, 7)[0])
    rest, _ = run(model, (a + b)[hit.length:], hit.caches)
    assert_close(rest, full[hit.length:])


def test_hits_are_copies(model):
    prompt = toks(12, 8)
    _, caches = run(model, prompt)
    pc = PromptCache(BIG)
    pc.insert(prompt, caches, drafter=_Drafter(1))
    first = pc.lookup(prompt + [1])
    ref = [np.array(c.keys) for c in first.caches]
    run(model, [5, 6, 7], first.caches)  # grows the hit's caches
    second = pc.lookup(prompt + [2])
    second.caches[0].trim(4)
    second.caches[0].update_and_fetch(mx.zeros((1, 2, 3, 16)), mx.zeros((1, 2, 3, 16)))  # writes in place
    second.caches[1].keys[...] = 0
    third = pc.lookup(prompt + [3])
    assert all(c.offset == 12 for c in third.caches)
    assert all(np.array_equal(np.array(c.keys), r) for c, r in zip(third.caches, ref))  # copies: bit-exact
    assert not any(h is s for h in third.caches for s in first.caches + second.caches)
    # The caller's caches are not the stored ones either.
    caches[0].keys[...] = 0
    assert np.array_equal(np.array(pc.lookup(prompt + [4]).caches[0].keys), ref[0])


def test_longest_prefix_wins(model):
    p = toks(20, 9)
    _, caches = run(model, p)
    pc = PromptCache(BIG)
    for n in (4, 12, 8):
        pc.insert(p[:n], caches, drafter=_Drafter(n))
    pc.insert(toks(15, 10), caches)  # unrelated
    hit = pc.lookup(p[:16])
    assert hit.length == 12 and hit.drafter.tag == 12
    assert pc.lookup(p[:10]).length == 9  # the 12-entry, trimmed, beats the whole 8-entry
    hit = pc.lookup(p[:9])
    assert hit.length == 8 and hit.drafter.tag == 8  # equal lengths: the entry used whole wins
    assert pc.lookup([(p[0] + 1) % 256] + p[1:]) is None


def test_equal_hits_go_to_the_most_recent_entry():
    pc = PromptCache(BIG)
    for s in ([0, 1, 2], [0, 1, 3], [0, 1, 4]):
        pc.insert(s, fake_caches(s, 0))
    pc.lookup([0, 5])  # touches [0, 1, 4], the most recent
    assert pc.keys()[-1] == (0, 1, 4)
    pc.insert([0, 1, 2], fake_caches([0, 1, 2], 0))
    pc.lookup([0, 1, 7])
    assert pc.keys() == [(0, 1, 3), (0, 1, 4), (0, 1, 2)]


def test_byte_bound_and_lru_eviction(model):
    p = toks(16, 11)
    _, caches = run(model, p)
    one = PromptCache(BIG)
    one.insert(p[:8], caches)
    per = one.nbytes  # 8 positions: 2 layers x (K + V) x 2 heads x 16 dims x 4 bytes x 8
    assert per == 2 * 2 * 2 * 16 * 4 * 8
    pc = PromptCache(3 * per)
    a, b, c, d = ([t] + p[1:8] for t in (1, 2, 3, 4))
    for s in (a, b, c):
        pc.insert(s, caches)
    assert len(pc) == 3 and pc.nbytes == 3 * per
    assert pc.lookup(a + [0]).length == 8  # a is now the most recent
    pc.insert(d, caches)
    assert pc.keys() == [tuple(x) for x in (c, a, d)] and pc.nbytes == 3 * per  # b evicted
    pc.insert(c, caches)  # replacing an identical key does not grow the total
    assert pc.keys() == [tuple(x) for x in (a, d, c)] and pc.nbytes == 3 * per
    assert len(pc) == 3 and len(pc) == 3 and pc.keys() == [tuple(x) for x in (a, d, c)]  # no side effects
    pc.clear()
    assert len(pc) == 0 and pc.nbytes == 0 and pc.lookup(a + [0]) is None


def test_oversize_entry_is_not_stored(model):
    p = toks(16, 12)
    _, caches = run(model, p)
    pc = PromptCache(2 * 2 * 2 * 16 * 4 * 8)
    assert pc.insert(p[:8], caches)
    assert not pc.insert(p[:9], caches)
    assert not pc.insert(p[:4], caches, drafter=_Drafter(0, nbytes=1 << 20))
    assert pc.keys() == [tuple(p[:8])] and pc.lookup(p).length == 8
    assert not PromptCache(0).insert(p[:1], caches)


def test_rejects_what_it_cannot_store(model):
    _, caches = run(model, toks(4, 13))
    pc = PromptCache(BIG)
    with pytest.raises(ValueError):
        pc.insert(toks(5, 13), caches)  # offset 4 < 5 tokens
    with pytest.raises(TypeError):
        pc.insert([1], [RotatingKVCache(max_size=8)])
    with pytest.raises(ValueError):
        PromptCache(-1)
    assert not pc.insert([], caches) and len(pc) == 0


class _Drafter:
    def __init__(self, tag, nbytes=16):
        self.tag, self.nbytes = tag, nbytes


# -- random sequences against a reference model of the cache ---------------------------------
D = 2  # head dim of the fake caches; key[..., p, :] = token at p, so contents are checkable


def fake_caches(tokens, extra):
    k = mx.array(np.repeat(np.array(tokens + [99] * extra, np.float32)[None, None, :, None], D, axis=3))
    c = KVCache()
    c.update_and_fetch(k, k * 2)
    return [c]


def entry_bytes(n, drafter):
    return 2 * n * D * 4 + (drafter.nbytes if drafter else 0)


def reference_lookup(ref, q):
    best, best_key = (0, False), None
    for key in reversed(ref):
        lcp = 0
        while lcp < min(len(key), len(q)) and key[lcp] == q[lcp]:
            lcp += 1
        n = min(lcp, len(q) - 1)
        if (n, n == len(key)) > best:
            best, best_key = (n, n == len(key)), key
    return best, best_key


seqs = st.lists(st.integers(0, 3), min_size=0, max_size=7)
ops = st.lists(st.tuples(st.booleans(), seqs, st.integers(0, 3), st.sampled_from([None, 8, 40])), max_size=25)


@settings(max_examples=100)  # ~0.3 s; 20 examples miss tie-breaks
@given(ops, st.sampled_from([0, 40, 100, 300]))
def test_random_sequences_keep_the_invariants(ops, max_bytes):
    pc, ref = PromptCache(max_bytes), OrderedDict()  # ref: key -> (bytes, drafter), LRU first
    for is_insert, tokens, extra, dbytes in ops:
        drafter = _Drafter(tuple(tokens), dbytes) if dbytes is not None else None
        if is_insert:
            size = entry_bytes(len(tokens), drafter)
            stored = pc.insert(tokens, fake_caches(tokens, extra), drafter) if tokens else pc.insert([], [])
            assert stored == (bool(tokens) and size <= max_bytes)
            if stored:
                ref.pop(tuple(tokens), None)
                ref[tuple(tokens)] = (size, drafter)
                while sum(b for b, _ in ref.values()) > max_bytes:
                    ref.popitem(last=False)
        else:
            hit = pc.lookup(tokens)
            (n, whole), key = reference_lookup(ref, tokens)
            if n == 0:
                assert hit is None
            else:
                assert hit.length == n < len(tokens)
                ref.move_to_end(key)
                assert hit.drafter is (ref[key][1] if whole else None)
                (c,) = hit.caches
                assert c.offset == n == c.keys.shape[2]
                assert np.array(c.keys)[0, 0, :, 0].tolist() == tokens[:n]  # a true prefix of the query
                assert np.array_equal(np.array(c.values), 2 * np.array(c.keys))
        assert pc.keys() == list(ref)
        assert pc.nbytes == sum(b for b, _ in ref.values()) <= max_bytes
