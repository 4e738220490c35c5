"""The scalar loop against its oracles: plain decode, mlx-lm's generate_step, cache states."""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from numerics import assert_close, compare_tokens, same_stream

from gmlx.config import SamplingParams
from gmlx.engine.oracle import run_scalar
from doubles import ScriptedDrafter, visible_window



def mlx_lm_greedy(lm, prompt, n, eos):
    out = []
    for tok, _ in generate_step(mx.array(prompt), lm.target.model, max_tokens=n):
        if tok in eos:
            break
        out.append(tok)
    return out


@pytest.mark.parametrize("n_prompts, n_tokens", [(6, 48), pytest.param(20, 64, marks=pytest.mark.slow)])
def test_greedy_speculative_equals_plain_equals_mlx_lm(lm, prompts, n_prompts, n_tokens):
    params = SamplingParams(max_tokens=n_tokens, temperature=0.0, seed=0)
    ties = 0
    drafted = 0
    for prompt in prompts[:n_prompts]:
        spec = run_scalar(lm, prompt, params, k=3)
        plain = run_scalar(lm, prompt, params, speculative=False)
        ref = mlx_lm_greedy(lm, prompt, n_tokens, lm.eos_ids)
        c1 = compare_tokens(lm, prompt, plain.tokens, spec.tokens, params)
        c2 = compare_tokens(lm, prompt, ref, plain.tokens, params)
        assert c1.ok, (c1, plain.tokens, spec.tokens)
        assert c2.ok, (c2, ref, plain.tokens)
        ties += (not c1.equal) + (not c2.equal)
        drafted += spec.stats.num_drafted
    assert drafted > 0  # speculation really ran
    assert ties <= 2, f"{ties} tie divergences in {n_prompts} prompts"


@pytest.mark.parametrize("k", [1, 2, 4])
def test_greedy_other_k(lm, prompts, k):
    params = SamplingParams(max_tokens=32, seed=0)
    for prompt in prompts[:3]:
        spec = run_scalar(lm, prompt, params, k=k)
        plain = run_scalar(lm, prompt, params, speculative=False)
        assert compare_tokens(lm, prompt, plain.tokens, spec.tokens, params).ok


@pytest.mark.parametrize("seeds, n_prompts", [((1, 2), 3), pytest.param((1, 2, 3, 4), 8, marks=pytest.mark.slow)])
def test_seeded_sampling_speculative_equals_plain(lm, prompts, seeds, n_prompts):
    for seed in seeds:
        params = SamplingParams(max_tokens=48, temperature=0.8, top_p=0.95, seed=seed)
        for prompt in prompts[:n_prompts]:
            spec = run_scalar(lm, prompt, params, k=3)
            plain = run_scalar(lm, prompt, params, speculative=False)
            assert compare_tokens(lm, prompt, plain.tokens, spec.tokens, params).ok, (seed, prompt)


def test_different_seeds_give_different_streams(lm, prompts):
    streams = {tuple(run_scalar(lm, prompts[0], SamplingParams(max_tokens=24, temperature=1.0, seed=s)).tokens)
               for s in range(4)}
    assert len(streams) >= 3


def test_filters_hold_in_speculation(lm, prompts):
    for params in (SamplingParams(max_tokens=32, temperature=0.7, top_k=5, seed=4),
                   SamplingParams(max_tokens=32, temperature=1.2, min_p=0.1, seed=5)):
        spec = run_scalar(lm, prompts[1], params, k=3)
        plain = run_scalar(lm, prompts[1], params, speculative=False)
        assert compare_tokens(lm, prompts[1], plain.tokens, spec.tokens, params).ok


def test_one_token_prompt(lm):
    params = SamplingParams(max_tokens=16, seed=0)
    prompt = lm.tokenizer.encode("def")[:1]
    spec = run_scalar(lm, prompt, params, k=3)
    plain = run_scalar(lm, prompt, params, speculative=False)
    assert compare_tokens(lm, prompt, plain.tokens, spec.tokens, params).ok
    assert spec.stats.num_drafted > 0


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 9])
def test_budget_is_exact(lm, prompts, max_tokens):
    params = SamplingParams(max_tokens=max_tokens, seed=0)
    spec = run_scalar(lm, prompts[2], params, k=4, eos_ids=set())
    plain = run_scalar(lm, prompts[2], params, speculative=False, eos_ids=set())
    assert len(spec.tokens) == max_tokens and spec.finish_reason == "length"
    same_stream(lm, prompts[2], plain.tokens, spec.tokens, params)


def test_eos_mid_round_cuts_exactly(lm, prompts):
    params = SamplingParams(max_tokens=40, seed=0)
    ref = run_scalar(lm, prompts[3], params, speculative=False, eos_ids=set()).tokens
    for cut in (3, 7, 12):
        eos = {ref[cut]}
        first = ref.index(ref[cut])
        spec = run_scalar(lm, prompts[3], params, k=3, eos_ids=eos)
        if same_stream(lm, prompts[3], ref[:first], spec.tokens, params).equal:  # else a near-tie
            assert spec.finish_reason == "stop"


def test_stop_string_mid_round(lm, prompts):
    params = SamplingParams(max_tokens=48, seed=0)
    plain = run_scalar(lm, prompts[4], params, speculative=False, eos_ids=set())
    text = plain.text
    stop = visible_window(text, len(text) // 2)
    assert stop.strip(), "fixture text too short"
    p2 = SamplingParams(max_tokens=48, seed=0, stop=(stop,))
    spec = run_scalar(lm, prompts[4], p2, k=3, eos_ids=set())
    ref = run_scalar(lm, prompts[4], p2, speculative=False, eos_ids=set())
    assert ref.finish_reason == "stop" and ref.text == text[: text.find(stop)]  # plain both: exact
    if same_stream(lm, prompts[4], ref.tokens, spec.tokens, p2).equal:  # else a near-tie
        assert spec.finish_reason == "stop" and spec.text == ref.text
    assert stop not in spec.text


def _plain_caches(lm, tokens):
    cache = lm.target.make_cache()
    _, hidden = lm.target(mx.array([tokens], dtype=mx.int32), cache)
    return cache, hidden


@pytest.mark.numerics
@pytest.mark.parametrize("accept", [0, 1, 2, 3])
def test_rollback_restores_caches(lm, prompts, accept):
    """Force `accept` accepted drafts per round; after each round the target cache and the head
    cache hold what a plain run over the same tokens gives (to within rounding: verify forwards
    and one prefill have other shapes)."""
    k = 3
    prompt = prompts[5]
    params = SamplingParams(max_tokens=20, seed=0)
    ref = run_scalar(lm, prompt, params, speculative=False, eos_ids=set()).tokens
    full = list(prompt) + ref

    def script(first_position, kk):
        good = full[first_position : first_position + kk]
        return [t if j < accept else (t + 1) % lm.target.vocab_size for j, t in enumerate(good)]

    from gmlx.decode.scalar import ScalarLane
    from gmlx.engine.oracle import make_row

    row = make_row(lm, prompt, params, eos_ids=set())
    drafter = ScriptedDrafter(lm.head, lm.target, script)
    lane = ScalarLane(lm.target, drafter, k, adaptive=False)  # every round drafts k
    lane.start(row)
    seq = lane.seq
    import time

    while not row.is_done:
        res = lane.round(last=True)  # no round in flight: the caches are the round's own
        row.emit(res.tokens, time.perf_counter())
        if row.is_done:
            break
        sequence = list(prompt) + list(row.tokens)
        if res.drafted == k and sequence == full[: len(sequence)]:  # (off the script only after a near-tie)
            assert res.accepted == accept
        ref_cache, ref_hidden = _plain_caches(lm, sequence[:-1])
        for c, rc in zip(seq.cache, ref_cache):
            assert c.offset == rc.offset == len(sequence) - 1  # pending bonus: its KV is not cached
            assert_close(c.keys[..., : c.offset, :], rc.keys[..., : rc.offset, :], msg="target keys")
        hc = seq.draft.cache  # the head's ragged one-row cache
        n = int(hc.lengths[0])
        if n:
            from mlx_lm.models.cache import KVCache

            ref_h = KVCache()
            toks = mx.array([sequence[1 : n + 1]], dtype=mx.int32)
            lm.head(toks, ref_hidden[:, :n], ref_h)
            assert_close(hc.keys[..., :n, :], ref_h.keys[..., :n, :], msg="head keys")
    same_stream(lm, prompt, ref, row.tokens, params)
