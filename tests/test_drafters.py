"""The engine's oracle for every drafter kind: whatever drafts, every stream equals its solo plain
stream (greedy and seeded T > 0), through preempt, gate, capture and resume."""

import numpy as np
import pytest

from drafter_fixtures import draft_lm, random_assistant
from engine_helpers import check_solo, drive
from gmlx import Engine, EngineConfig, SamplingParams
from gmlx.config import Switches
from gmlx.drafters.select import select_drafter
from gmlx.engine.oracle import run_scalar
from numerics import same_stream

KINDS = ["draft-self", "draft-random", "draft-shipped", "assistant-random", "assistant"]


LM_WITHOUT_EOS = True  # budgets (and cancels) alone end these requests: see conftest.lm


@pytest.fixture(scope="module")
def drafts(lm, tmp_path_factory):
    """kind -> a drafter instance (the engine and the scalar loop take any protocol implementation)."""
    out = {k: select_drafter(lm, "draft", draft_lm(k, lm, tmp_path_factory)) for k in KINDS if k.startswith("draft")}
    out["assistant-random"] = random_assistant(lm)
    out["assistant"] = select_drafter(lm, "assistant")  # the trained one shipped with the model
    return out


def make_engine(lm, drafts, kind, cap, **cfg):
    config = EngineConfig(width_cap=cap, **cfg)
    return Engine(lm, config, switches=Switches(preempt=True, resume=True), drafter=drafts[kind])


def P(i, n, temp):
    if temp == "greedy" or (temp == "mixed" and i % 2 == 0):
        return SamplingParams(max_tokens=n, seed=i)
    return SamplingParams(max_tokens=n, temperature=0.8, top_p=0.95, seed=1000 + i)


# (arrival step, prompt index, max_tokens): a scalar start, a preempt, admissions into the batch.
# Request 0's budget outlasts the others' by enough that, whatever its drafter accepted in its scalar
# rounds (the shipped head is retrained from time to time), it is still running when the batch
# narrows under the cap again: the resume and its capture round happen.
SCHEDULE = [(0, 9, 48), (4, 10, 14), (4, 11, 22), (7, 12, 18), (12, 13, 16)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("temp", ["greedy", "mixed"])
@pytest.mark.parametrize("cap", [0, 2])
def test_schedule_equals_solo(lm, prompts, drafts, kind, temp, cap):
    eng = make_engine(lm, drafts, kind, cap, resume_min_remaining=2)
    arrivals = {}
    for i, (at, p, n) in enumerate(SCHEDULE):
        arrivals.setdefault(at, []).append((i, prompts[p], P(i, n, temp)))
    run = drive(eng, arrivals)
    assert check_solo(lm, run) <= 1
    tr = run.transitions()
    kinds = [e.round for _, e in run.rounds()]
    assert "preempt" in tr and "speculative" in kinds and "scalar" in kinds, (tr, kinds)
    if cap == 2:
        assert "gate" in tr and "resume" in tr, tr  # gated over the cap, re-armed by a capture round
    spec = [row for _, e in run.rounds() if e.round == "speculative" for row in e.rows]
    if kind == "draft-self" and temp == "greedy":
        # the target drafting for itself greedily: every draft must be accepted, in every row,
        # which holds only if the draft cache is rolled back and merged exactly
        assert all(a == d for _, d, a, _ in spec), spec
    eng.close()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("temp", [0.0, 0.8])
def test_scalar_equals_plain(lm, prompts, drafts, kind, temp):
    drafter = drafts[kind]
    for i in range(3):
        params = SamplingParams(max_tokens=32, temperature=temp, seed=i)
        spec = run_scalar(lm, prompts[20 + i], params, drafter=drafter)
        plain = run_scalar(lm, prompts[20 + i], params, speculative=False)
        same_stream(lm, prompts[20 + i], plain.tokens, spec.tokens, params)
        if kind == "draft-self" and temp == 0.0:
            assert spec.stats.num_drafted == spec.stats.num_accepted > 0


def test_draft_model_with_another_tokenizer_is_refused(lm, tmp_path):
    import json

    from drafter_fixtures import random_draft_dir
    from gmlx.errors import GmlxError
    from gmlx.models.loading import load

    d = random_draft_dir(tmp_path / "other")
    tok = json.loads((d / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    by_id = {i: t for t, i in vocab.items()}
    used = lm.tokenizer.encode("def f(x):\n    return x")
    a, b = by_id[used[-1]], by_id[used[-2]]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # same size, two ids exchanged
    (d / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(GmlxError, match="tokenizer"):
        Engine(lm, EngineConfig(drafter="draft"), draft_model=load(d))


def test_draft_state_follows_the_batch(lm, prompts, drafts):
    """Per-row draft-model KV widens on admission and shrinks on retirement, with the batch."""
    eng = make_engine(lm, drafts, "draft-self", 0)
    lens = []

    def watch(run):
        b = eng.batch
        if b.draft is not None:
            assert b.drafter.width(b.draft) == len(b.rows)
            lens.append(np.array(b.draft.cache[0].lengths))

    arrivals = {0: [(i, prompts[i], P(i, 12 + 8 * i, "greedy")) for i in range(3)],
                1: [(9, prompts[9], P(9, 10, "greedy"))]}
    run = drive(eng, arrivals, before_step=watch)
    check_solo(lm, run)
    assert lens and max(len(x) for x in lens) == 4
    eng.close()


def test_single_sequence_drafter_is_held_to_width_one(lm, prompts):
    """A drafter that serves one row at a time: the cap is clamped to 1 whatever is asked (with a
    notice saying so), so no batch of two or more ever drafts; the streams are unchanged."""
    from gmlx.drafters.mtp import MTPDrafter

    class OneRow(MTPDrafter):
        max_width = 1

    eng = Engine(lm, EngineConfig(width_cap=0), switches=Switches(), drafter=OneRow(lm.head, lm.target.hidden_size))
    assert eng.cap_in_force.cap == 1 and any("lowered to 1" in n for n in eng.notices), eng.notices
    arrivals = {0: [(0, prompts[9], P(0, 30, "greedy"))], 3: [(1, prompts[10], P(1, 10, "mixed"))]}
    run = drive(eng, arrivals)
    check_solo(lm, run)
    rounds = [e for _, e in run.rounds()]
    assert any(e.round == "scalar" and any(d for _, d, _, _ in e.rows) for e in rounds)  # it does draft alone
    assert not any(e.round == "speculative" and e.width > 1 for e in rounds)
    eng.close()
