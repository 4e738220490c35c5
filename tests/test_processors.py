"""Logits processors and logprobs, exact under speculation (gmlx/processors.py).

- the vectorised per-position processing of a verify block equals mlx-lm's processors applied
  position by position to the committed tokens plus the drafts before that position;
- the scalar loop (speculating) equals plain decoding, and greedy plain decoding equals mlx-lm's
  generate_step with make_logits_processors of the same settings, logprobs included;
- the batch loop (armed, gated with its lookahead, preempted, capture rounds) equals solo plain
  decoding, tokens tie-aware and logprobs within 1e-3;
- min_tokens holds EOS back; requests without processors take the sampler's plain path.
"""

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors

from engine_helpers import check_solo, drive, engine, with_eos
from gmlx.config import SamplingParams
from gmlx.processors import Context, apply, build, processed
from gmlx.sampling import RowSampling
from gmlx.engine.oracle import run_scalar
from numerics import compare_tokens

LM_WITHOUT_EOS = True  # budgets alone end these requests: see conftest.lm

SETTINGS = [
    dict(repetition_penalty=1.3),
    dict(presence_penalty=1.0, presence_context_size=8),
    dict(frequency_penalty=0.7, frequency_context_size=3),
    dict(logit_bias={10: 5.0, 25: -100.0}),
    dict(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=-0.5, repetition_context_size=2,
         logit_bias={7: 2.5}),
]
MLX_KEYS = ("repetition_penalty", "repetition_context_size", "presence_penalty", "presence_context_size",
            "frequency_penalty", "frequency_context_size", "logit_bias")


def mlx_processors(kw: dict):
    return make_logits_processors(**{k: v for k, v in kw.items() if k in MLX_KEYS})


# ---- the vectorised block against mlx-lm's processors, position by position ---------------------
@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("seed", range(6))
def test_block_equals_mlx_lm_per_position(seed, offset):
    rng = np.random.default_rng(seed)
    V, B = 40, 3
    L = 1 if offset else int(rng.integers(1, 6))
    m = offset + L - 1  # device tokens: drafts (verify) or the lookahead's pending token
    params, rows, kws = [], [], []
    for b in range(B):
        kw = dict(repetition_penalty=float(rng.choice([0.0, 1.2, 1.7])),
                  repetition_context_size=int(rng.choice([0, 1, 2, 5, 20])),
                  presence_penalty=float(rng.choice([0.0, 0.8, -1.5])), presence_context_size=int(rng.choice([1, 3, 20])),
                  frequency_penalty=float(rng.choice([0.0, 0.6, 2.0])), frequency_context_size=int(rng.choice([0, 2, 7])),
                  logit_bias={int(t): float(rng.normal() * 3) for t in rng.choice(V, 3, replace=False)} if b else None)
        kws.append(kw)
        params.append(SamplingParams(**kw).validated())
        n_prompt, n_gen, n_pending = int(rng.integers(1, 8)), int(rng.integers(0, 6)), int(rng.integers(0, 3))
        toks = rng.integers(0, V // 4, size=n_prompt + n_gen + n_pending).tolist()  # a small alphabet: repeats
        rows.append((SimpleNamespace(rid=b, prompt=toks[:n_prompt], tokens=toks[n_prompt:n_prompt + n_gen],
                                     eos_ids=frozenset()), toks[n_prompt + n_gen:], toks))
    dev = rng.integers(0, V // 4, size=(B, max(m, 1)))[:, :m] if m else None
    logits = mx.array(rng.normal(size=(B, L, V)).astype(np.float32) * 4)
    first = np.array([len(all_toks) + offset for _, _, all_toks in rows])
    ctx = Context([r for r, _, _ in rows], first, mx.array(dev) if dev is not None else None, offset,
                  [p for _, p, _ in rows])
    got = np.array(apply(logits, build(params), ctx))
    for b in range(B):
        procs = mlx_processors({k: v for k, v in kws[b].items() if v is not None})
        for j in range(L):
            seen = rows[b][2] + (dev[b, : offset + j].tolist() if dev is not None else [])
            want = logits[b, j][None]
            for p in procs:
                want = p(mx.array(seen), want)
            np.testing.assert_allclose(got[b, j], np.array(want[0]), rtol=1e-6, atol=1e-5,
                                       err_msg=f"row {b} position {j}: {kws[b]}")


def test_no_processors_is_the_plain_path():
    rs = RowSampling.from_params([SamplingParams(seed=1)], [1])
    assert rs.proc is None
    x = mx.zeros((1, 2, 5))
    assert processed(x, rs, [None], [3], mx.zeros((1, 1))) is x
    assert build([SamplingParams(repetition_penalty=1.0)]) is None  # 1 = off: no work either


# ---- the scalar loop: speculative == plain == mlx-lm -------------------------------------------
def mlx_lm_stream(lm, prompt, n, kw):
    toks, lps = [], []
    for tok, lp in generate_step(mx.array(prompt), lm.target.model, max_tokens=n, logits_processors=mlx_processors(kw)):
        toks.append(tok)
        lps.append(lp[tok].item())
    return toks, lps


@pytest.mark.parametrize("kw", SETTINGS, ids=lambda kw: "+".join(k for k in kw if not k.endswith("size")))
def test_scalar_greedy_equals_plain_and_mlx_lm(lm, prompts, kw):
    n = 32
    drafted = 0
    for prompt in prompts[:2]:
        params = SamplingParams(max_tokens=n, seed=0, logprobs=3, **kw)
        spec = run_scalar(lm, prompt, params, k=3)
        plain = run_scalar(lm, prompt, params, speculative=False)
        ref, ref_lps = mlx_lm_stream(lm, prompt, n, kw)
        c1 = compare_tokens(lm, prompt, plain.tokens, spec.tokens, params)
        c2 = compare_tokens(lm, prompt, ref, plain.tokens, params)
        assert c1.ok and c2.ok, (c1, c2)
        drafted += spec.stats.num_drafted
        if c2.equal:
            np.testing.assert_allclose([t.logprob for t in plain.logprobs], ref_lps, atol=1e-3)
        if c1.equal:
            np.testing.assert_allclose([t.logprob for t in spec.logprobs], [t.logprob for t in plain.logprobs],
                                       atol=1e-3)
            assert [t.top for t in spec.logprobs][0][0][0] == spec.tokens[0]  # greedy: the best is the chosen
            assert all(len(t.top) == 3 for t in spec.logprobs)
    assert drafted > 0


@pytest.mark.parametrize("kw", SETTINGS[:3] + SETTINGS[4:], ids=["rep", "pres", "freq", "all"])
def test_scalar_seeded_equals_plain(lm, prompts, kw):
    for prompt in prompts[2:4]:
        params = SamplingParams(max_tokens=32, temperature=0.8, top_p=0.95, seed=11, logprobs=0, **kw)
        spec = run_scalar(lm, prompt, params, k=3)
        plain = run_scalar(lm, prompt, params, speculative=False)
        c = compare_tokens(lm, prompt, plain.tokens, spec.tokens, params)
        assert c.ok, c
        if c.equal:
            np.testing.assert_allclose([t.logprob for t in spec.logprobs], [t.logprob for t in plain.logprobs],
                                       atol=1e-3)
            assert all(t.top == () for t in spec.logprobs)


def test_penalties_change_the_stream(lm, prompts):
    """Not vacuous: a strong repetition penalty changes the greedy stream of a repetitive prompt."""
    changed = 0
    for prompt in prompts[:4]:
        base = run_scalar(lm, prompt, SamplingParams(max_tokens=32, seed=0), speculative=False)
        pen = run_scalar(lm, prompt, SamplingParams(max_tokens=32, seed=0, repetition_penalty=2.0),
                         speculative=False)
        changed += base.tokens != pen.tokens
    assert changed >= 2


# ---- the batch loop: every round kind against solo plain decoding ------------------------------
def batch_params(i: int, n: int) -> SamplingParams:
    kw = SETTINGS[i % len(SETTINGS)] if i % 3 else {}  # every third request has no processor
    t = 0.0 if i % 2 == 0 else 0.9
    return SamplingParams(max_tokens=n, temperature=t, top_p=0.95 if t else 1.0, seed=500 + i, logprobs=2, **kw)


def check_logprobs(lm, run):
    """Where a stream equals its solo plain decode, so do its logprobs (within 1e-3), top ones too."""
    for label, stream in run.streams.items():
        req, rec = run.reqs[label], stream.result
        ref = run_scalar(lm, req.prompt, req.params, speculative=False)
        if ref.tokens == rec.tokens:
            assert len(rec.logprobs) == len(rec.tokens)
            np.testing.assert_allclose([t.logprob for t in rec.logprobs], [t.logprob for t in ref.logprobs],
                                       atol=1e-3, err_msg=str(label))
            np.testing.assert_allclose([[v for _, v in t.top] for t in rec.logprobs],
                                       [[v for _, v in t.top] for t in ref.logprobs], atol=1e-3)


@pytest.mark.parametrize("cap", [0, 1, 2])
def test_batch_loop_equals_solo_plain(lm, prompts, cap):
    """cap 0: armed speculative rounds; cap 1: gated plain rounds with their lookahead; cap 2:
    gate and re-arm through capture rounds. A lone request first (scalar), waiters preempt it."""
    arrivals = {0: [(0, prompts[30], batch_params(0, 44))],
                3: [(i, prompts[30 + i], batch_params(i, 14 + 3 * i)) for i in (1, 2, 3)],
                7: [(i, prompts[30 + i], batch_params(i, 10 + 2 * i)) for i in (4, 5)]}
    run = drive(engine(lm, cap, resume_min_remaining=2), arrivals)
    ties = check_solo(lm, run)
    assert ties <= 1
    kinds = {e.round.value for _, e in run.rounds()}
    assert "speculative" in kinds, kinds
    if cap:
        assert "plain" in kinds
    if cap == 2:
        assert "capture" in kinds  # re-armed after the gate
    check_logprobs(lm, run)


# ---- min_tokens ----------------------------------------------------------------------------------
def test_min_tokens_holds_eos_back(lm, prompts):
    prompt = prompts[5]
    free = run_scalar(lm, prompt, SamplingParams(max_tokens=24, seed=0), speculative=False)
    eos = free.tokens[3]  # a token the greedy stream emits early: call it EOS
    stops = run_scalar(lm, prompt, SamplingParams(max_tokens=24, seed=0), speculative=False, eos_ids={eos})
    assert len(stops.tokens) == free.tokens.index(eos)
    for speculative in (False, True):
        held = run_scalar(lm, prompt, SamplingParams(max_tokens=24, seed=0, min_tokens=12),
                          speculative=speculative, eos_ids={eos})
        assert len(held.tokens) >= 12 and eos not in held.tokens[:12]
    spec = run_scalar(lm, prompt, SamplingParams(max_tokens=24, seed=0, min_tokens=12), eos_ids={eos})
    plain = run_scalar(lm, prompt, SamplingParams(max_tokens=24, seed=0, min_tokens=12), speculative=False,
                       eos_ids={eos})
    assert spec.tokens == plain.tokens or compare_tokens(with_eos(lm, {eos}), prompt, plain.tokens, spec.tokens,
                                                         SamplingParams(max_tokens=24, seed=0, min_tokens=12)).ok


# ---- SmolLM2 with its shipped head: both loops --------------------------------------------------
def test_smollm2_penalties_and_logprobs_both_loops(smollm2):
    """The real model: penalties, logit_bias and logprobs give the same tokens and logprobs
    (within 1e-3) with speculation as without, in the scalar loop and in a speculating batch."""
    lm = with_eos(smollm2.load("float32"), ())
    chat = [lm.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
            for q in ("List three colours.", "Write a haiku about rain.", "What is 7 times 8?")]
    kws = [dict(repetition_penalty=1.3, logit_bias={28: 3.0}), dict(presence_penalty=0.8, frequency_penalty=0.4),
           dict(repetition_penalty=1.1, repetition_context_size=4, frequency_penalty=1.0)]
    temps = [0.0, 0.7, 0.0]
    ps = [SamplingParams(max_tokens=20, temperature=t, seed=9 + i, logprobs=2, **kw)
          for i, (t, kw) in enumerate(zip(temps, kws))]
    spec = run_scalar(lm, chat[0], ps[0], k=3)
    plain = run_scalar(lm, chat[0], ps[0], speculative=False)
    c = compare_tokens(lm, chat[0], plain.tokens, spec.tokens, ps[0])
    assert c.ok and spec.stats.num_drafted > 0
    if c.equal:
        np.testing.assert_allclose([t.logprob for t in spec.logprobs], [t.logprob for t in plain.logprobs], atol=1e-3)
    run = drive(engine(lm, 0), {0: [(i, chat[i], ps[i]) for i in range(3)]})
    assert check_solo(lm, run) <= 1
    assert any(e.round.value == "speculative" for _, e in run.rounds())
    check_logprobs(lm, run)
