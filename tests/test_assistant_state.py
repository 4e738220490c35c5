"""The KV-sharing assistant's inputs are right at every draft, whatever brought the row there: an
admission (prefill), a verify with any acceptance, a preempt, a gate and the capture round that
re-arms. At each draft call, for every row of sequence x_0..x_{n-1}, the shared K/V the drafter
reads must equal the target layer's K/V of a fresh solo forward over x_0..x_{n-2}, its pending
hidden must be that forward's last hidden state, and its pending token the bonus x_{n-1}."""

import mlx.core as mx
import pytest
from drafter_fixtures import random_assistant
from engine_helpers import check_solo, drive, solo, with_eos
from numerics import assert_close

from gmlx import Engine, EngineConfig, SamplingParams
from gmlx.config import Switches
from gmlx.policy.admission import Mode
from gmlx.drafters.assistant import shared_kv


def _solo_inputs(lm, seq, layer):
    cache = lm.target.make_cache()
    _, hidden = lm.target(mx.array([seq[:-1]], dtype=mx.int32), cache)
    k, v = cache[layer].keys, cache[layer].values
    return k[..., : len(seq) - 1, :], v[..., : len(seq) - 1, :], hidden[:, -1:]


@pytest.mark.numerics
def test_shared_kv_and_pending_inputs_at_every_draft(lm, prompts):
    lm = with_eos(lm, ())
    drafter = random_assistant(lm)
    eng = Engine(lm, EngineConfig(width_cap=2, resume_min_remaining=2), switches=Switches(), drafter=drafter)
    checked = {"rows": 0, "modes": set()}
    real_draft = drafter.draft

    def checked_draft(st, k, pick, target_cache):
        rows = [eng.scalar.seq.row] if eng.mode is Mode.SCALAR else eng.batch.rows
        keys, values, lengths = shared_kv(target_cache[drafter.layer])
        for b, row in enumerate(rows):
            # The row's sequence up to this draft's position (its stream is its solo stream, checked
            # below); the scalar lane drafts the next round before the engine emits this one's tokens.
            seq = (list(row.prompt) + solo(lm, row.prompt, row.params))[: int(pick.first_positions[b])]
            rk, rv, rh = _solo_inputs(lm, seq, drafter.layer)
            n = len(seq) - 1
            assert lengths[b] == n
            # the engine's K/V and hidden came from batched verify forwards, the reference's from
            # one solo prefill: equal to within rounding
            assert_close(keys[b : b + 1, :, :n], rk, msg="keys")
            assert_close(values[b : b + 1, :, :n], rv, msg="values")
            assert_close(st.hidden[b : b + 1], rh, msg="hidden")
            assert int(st.tokens[b, 0].item()) == seq[-1]  # sync: test check
            checked["rows"] += 1
        checked["modes"].add(eng.mode.value)
        real = real_draft(st, k, pick, target_cache)
        # Force chosen acceptance counts (0..k, by position) so that every commit path is taken:
        # the first j drafts are the row's own solo tokens, the rest are wrong.
        forced = []
        for b, row in enumerate(rows):
            ref, done = solo(lm, row.prompt, row.params), int(pick.first_positions[b]) - len(row.prompt)
            nxt = (ref[done : done + k] + [0] * k)[:k]
            j = done % (k + 1)
            forced.append([t if i < j else (t + 1) % lm.target.vocab_size for i, t in enumerate(nxt)])
        return mx.array(forced, dtype=mx.int32) + 0 * real

    drafter.draft = checked_draft
    P = lambda n, s, t=0.0: SamplingParams(max_tokens=n, seed=s, temperature=t)  # noqa: E731
    arrivals = {0: [("a", prompts[30], P(40, 0))], 3: [("b", prompts[31], P(10, 1, 0.8))],
                6: [("c", prompts[32], P(12, 2)), ("d", prompts[33], P(8, 3))], 14: [("e", prompts[34], P(9, 4))]}
    run = drive(eng, arrivals)
    check_solo(lm, run)
    tr = run.transitions()
    assert {"start_scalar", "preempt", "gate", "resume", "capture"} <= set(tr), tr
    assert checked["modes"] == {"scalar", "batched"} and checked["rows"] > 10, checked
    accepted = {a for _, e in run.rounds() for _, d, a, _ in e.rows if d}
    assert accepted >= {0, 1, 2}, accepted
    eng.close()
