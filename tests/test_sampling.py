"""Position-keyed sampling: distribution, coupling, filters against mlx-lm's, determinism."""

import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from gmlx.config import SamplingParams
from gmlx.sampling import RowSampling, filter_logprobs, gumbel_noise, sample

LOGITS = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0], dtype=np.float32)
N = 20000


def _freqs(logits, params, n=N, position=17):
    """Sample position `position` under n different seeds in one batch."""
    rs = RowSampling.from_params([params] * n, list(range(n)))
    lg = mx.broadcast_to(mx.array(logits)[None, None], (n, 1, len(logits)))
    toks = np.array(sample(lg, rs, mx.full((n, 1), position, dtype=mx.int32)))[:, 0]
    return np.bincount(toks, minlength=len(logits)) / n


def _chi2_ok(freqs, probs, n=N):
    keep = probs > 0
    assert np.all(freqs[~keep] == 0), "a filtered token was sampled"
    chi2 = float(np.sum((freqs[keep] * n - probs[keep] * n) ** 2 / (probs[keep] * n)))
    df = int(keep.sum()) - 1
    crit = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}[df]  # p = 0.001
    return chi2 < crit, chi2


def _softmax(x):
    e = np.exp(x - x[np.isfinite(x)].max())
    e[~np.isfinite(x)] = 0
    return e / e.sum()


@pytest.mark.parametrize("temp", [0.5, 1.0, 1.7])
def test_sampled_frequencies_match_softmax(temp):
    freqs = _freqs(LOGITS, SamplingParams(temperature=temp))
    ok, chi2 = _chi2_ok(freqs, _softmax(LOGITS / temp))
    assert ok, chi2


def test_filtered_frequencies_match_filtered_softmax():
    lp = LOGITS - np.log(np.exp(LOGITS).sum())
    # top_k = 3: renormalised over the three largest
    masked = np.where(np.arange(8) < 3, lp, -np.inf)
    ok, chi2 = _chi2_ok(_freqs(LOGITS, SamplingParams(temperature=0.9, top_k=3)), _softmax(masked / 0.9))
    assert ok, chi2
    # top_p = 0.6: smallest prefix reaching 60 % of the mass
    p = np.exp(lp)
    keep = np.cumsum(p) - p < 0.6
    masked = np.where(keep, lp, -np.inf)
    ok, chi2 = _chi2_ok(_freqs(LOGITS, SamplingParams(temperature=1.0, top_p=0.6)), _softmax(masked))
    assert ok, chi2


def test_greedy_is_argmax():
    rs = RowSampling.from_params([SamplingParams()], [0])
    assert sample(mx.array(LOGITS)[None, None], rs, mx.array([[3]])).item() == 0


def test_noise_depends_only_on_seed_and_position():
    a = gumbel_noise(mx.array([5, 9], dtype=mx.uint32), mx.array([[3, 4], [3, 4]]), 64)
    b = gumbel_noise(mx.array([9], dtype=mx.uint32), mx.array([[4]]), 64)
    np.testing.assert_array_equal(np.array(a[1, 1]), np.array(b[0, 0]))  # integer hashing, one log kernel: exact
    assert not np.allclose(np.array(a[0, 0]), np.array(a[1, 0]))
    assert not np.allclose(np.array(a[0, 0]), np.array(a[0, 1]))


def test_coupled_drafts_accepted_more_than_independent():
    """Draft distribution q close to target p: shared noise accepts far more often than
    independent draws (whose acceptance is sum p*q)."""
    q_logits = LOGITS + np.array([0.3, -0.2, 0.1, 0.0, -0.1, 0.2, 0.0, 0.0], dtype=np.float32)
    n = 4000
    params = SamplingParams(temperature=1.0)
    rs = RowSampling.from_params([params] * n, list(range(n)))
    pos = mx.full((n, 1), 11, dtype=mx.int32)
    t = np.array(sample(mx.broadcast_to(mx.array(LOGITS)[None, None], (n, 1, 8)), rs, pos))
    d = np.array(sample(mx.broadcast_to(mx.array(q_logits)[None, None], (n, 1, 8)), rs, pos))
    coupled = float((t == d).mean())
    independent = float(np.sum(_softmax(LOGITS) * _softmax(q_logits)))
    assert coupled > independent + 0.3, (coupled, independent)


@given(
    top_p=st.sampled_from([1.0, 0.9, 0.5, 0.2]),
    min_p=st.sampled_from([0.0, 0.05, 0.3]),
    top_k=st.sampled_from([0, 1, 3, 6]),
    seed=st.integers(0, 1000),
)
def test_filters_match_mlx_lm(top_p, min_p, top_k, seed):
    """Our per-row filters equal mlx-lm's scalar filters applied in its order (top-p, min-p, top-k)."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(1, 1, 32)).astype(np.float32) * 2
    lp = mx.array(logits) - mx.logsumexp(mx.array(logits), axis=-1, keepdims=True)
    ref = lp
    if 0 < top_p < 1:
        ref = apply_top_p(ref, top_p)
    if min_p > 0:
        ref = apply_min_p(ref, min_p)
    if top_k > 0:
        ref = apply_top_k(ref, top_k)
    params = SamplingParams(temperature=1.0, top_p=top_p, min_p=min_p, top_k=top_k)
    ours = filter_logprobs(lp, RowSampling.from_params([params], [0]))
    np.testing.assert_array_equal(np.isfinite(np.array(ours)), np.isfinite(np.array(ref)))


def test_per_row_params_in_one_batch():
    params = [SamplingParams(), SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=0.5, seed=3)]
    rs = RowSampling.from_params(params, [0, 1, 3])
    lg = mx.broadcast_to(mx.array(LOGITS)[None, None], (3, 1, 8))
    toks = np.array(sample(lg, rs, mx.zeros((3, 1), dtype=mx.int32)))[:, 0]
    assert toks[0] == 0 and toks[1] == 0  # greedy, and top-k 1
    solo = sample(mx.array(LOGITS)[None, None], RowSampling.from_params([params[2]], [3]), mx.zeros((1, 1), mx.int32))
    assert toks[2] == solo.item()


def test_validation_rejects_bad_params():
    from gmlx.errors import InvalidRequest

    for bad in (dict(max_tokens=0), dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1),
                dict(min_p=2.0), dict(seed=-1), dict(stop=("",))):
        with pytest.raises(InvalidRequest):
            SamplingParams(**bad).validated()
    assert SamplingParams().validated().seed is not None
    assert math.isfinite(SamplingParams(temperature=0.5).validated().temperature)
