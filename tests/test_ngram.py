"""Prompt-lookup drafting (`--drafter ngram`): the matching rule against a brute-force reference,
per-row draft lengths and alignment through filter/merge, host-only drafting, the engine's oracle
with rows that draft different counts (0 included) in one round, the real model (SmolLM2) on a
prompt that repeats its context, the CLI and the drafter's registration."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine_helpers import P, check_solo, drive, engine, solo
from gmlx import Engine, EngineConfig, SamplingParams
from gmlx.drafters import ngram
from gmlx.drafters.ngram import NGramDrafter, lookup
from gmlx.drafters.select import available, cap_defaults, select_drafter
from gmlx.engine.oracle import compare_streams, run_scalar

LM_WITHOUT_EOS = True  # budgets alone end the engine tests' requests: see conftest.lm


@dataclass
class FakeRow:
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)


def reference(seq: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """By definition: longest suffix (n_max..n_min) with an earlier occurrence, its most recent
    occurrence, the up to k tokens after it."""
    end = len(seq)
    for n in range(min(n_max, end - 1), n_min - 1, -1):
        for i in range(end - 1, n - 1, -1):  # i: the position after the occurrence seq[i-n:i]
            if seq[i - n:i] == seq[end - n:]:
                span = seq[i:min(i + k, end)]  # fewer than k: the drafts go on into themselves
                return (span + [(span * k)[j] for j in range(len(span), k)])
    return []


def drafts_of(d: NGramDrafter, st, k: int) -> list[list[int]]:
    out = np.array(d.draft(st, k, None, []))
    return [list(map(int, row[:n])) for row, n in zip(out, d.draft_lengths(st))]


# ---- the matching rule ---------------------------------------------------------------------

def test_longest_suffix_wins_over_a_more_recent_shorter_one():
    # suffix [1, 2, 3]: the 3-gram occurred at 0 (followed by 7, 8); the 2-gram [2, 3] more
    # recently at 5 (followed by 9)
    d = NGramDrafter(n_min=2, n_max=3)
    st = d.start([FakeRow([1, 2, 3, 7, 8, 2, 3, 9, 1, 2, 3])], [None])
    assert drafts_of(d, st, 2) == [[7, 8]]


def test_most_recent_occurrence_and_truncation_at_the_end():
    d = NGramDrafter(n_min=2, n_max=2)
    st = d.start([FakeRow([5, 6, 1, 5, 6, 2, 4, 5, 6])], [None])
    assert drafts_of(d, st, 3) == [[2, 4, 5]]  # after the later [5, 6], not the first
    st = d.start([FakeRow([5, 6, 1, 2, 5, 6])], [None])
    assert drafts_of(d, st, 3) == [[1, 2, 5]]
    # fewer than k after it: the output repeats [1, 2, 5, 6], and the drafts go on repeating it
    # (as a lookup with each draft appended would find)
    assert drafts_of(d, st, 8) == [[1, 2, 5, 6, 1, 2, 5, 6]]


def test_a_loop_drafts_k_tokens():
    """A one-token loop (the micro model's output) drafts K tokens, not one: before, every row
    drafted one token a round whatever K the control chose."""
    d = NGramDrafter()
    st = d.start([FakeRow([3, 1, 4, 7, 7, 7])], [None])
    assert drafts_of(d, st, 3) == [[7, 7, 7]]
    st = d.start([FakeRow([3, 8, 9, 8, 9])], [None])
    assert drafts_of(d, st, 5) == [[8, 9, 8, 9, 8]]


def test_no_match_drafts_nothing():
    d = NGramDrafter()
    st = d.start([FakeRow([1, 2, 3, 4, 5])], [None])
    out = d.draft(st, 4, None, [])
    assert out.shape == (1, 4) and out.dtype == mx.int32
    assert d.draft_lengths(st).tolist() == [0] and np.array(out).tolist() == [[0, 0, 0, 0]]


def test_the_suffix_never_matches_itself():
    d = NGramDrafter(n_min=1, n_max=3)
    st = d.start([FakeRow([9])], [None])
    assert drafts_of(d, st, 3) == [[]]  # one token: nothing earlier
    st = d.start([FakeRow([4, 4])], [None])
    assert drafts_of(d, st, 3) == [[4, 4, 4]]  # [4] occurred at 0, followed by the last token: a loop


@given(st.lists(st.integers(0, 3), min_size=1, max_size=60), st.lists(st.integers(1, 5), max_size=12),
       st.integers(1, 6), st.integers(1, 3), st.integers(0, 2))
def test_incremental_index_equals_the_reference(seq, chunks, k, n_min, extra):
    """The row grows between drafts (each commit appends a round's verified tokens); every draft
    equals the brute-force rule on the whole sequence."""
    n_max = n_min + extra
    d = NGramDrafter(n_min=n_min, n_max=n_max)
    cut = max(1, len(seq) // 3)
    st_ = d.start([FakeRow(seq[:cut])], [None])
    rest, pos = seq[cut:], 0
    for c in chunks + [len(rest)]:
        assert drafts_of(d, st_, k) == [reference(seq[:cut + pos], k, n_min, n_max)]
        got = rest[pos:pos + c]
        if got:  # a round verifies at least its bonus
            d.commit(st_, k, np.array([len(got) - 1]), None, np.array([got]))
        pos += len(got)
    assert drafts_of(d, st_, k) == [reference(seq, k, n_min, n_max)]


def test_lookup_helper_agrees_with_reference():
    seq = [1, 2, 1, 2, 3, 1, 2, 1, 2]
    ix = ngram.RowIndex(list(seq))
    ix.sync(1, 4)
    for k in (1, 3, 9):
        assert lookup(seq, ix.after, k, 1, 4) == reference(seq, k, 1, 4)


# ---- a batch: per-row lengths, alignment, host only -----------------------------------------

ROWS = {"a": [1, 2, 3, 4, 1, 2], "b": [7, 8, 9], "c": [5, 6, 5, 6, 5, 6]}
WANT = {"a": [3, 4, 1], "b": [], "c": [5, 6, 5]}  # k = 3 (c: its loop repeated past the end)


def test_per_row_lengths_and_padding():
    d = NGramDrafter(n_min=2, n_max=4)
    st = d.start([FakeRow(ROWS[x]) for x in "abc"], [None] * 3)
    out = np.array(d.draft(st, 3, None, []))
    assert d.draft_lengths(st).tolist() == [3, 0, 3]
    assert out.tolist() == [[3, 4, 1], [0, 0, 0], [5, 6, 5]]


def test_filter_and_merge_keep_rows_aligned():
    d = NGramDrafter(n_min=2, n_max=4)
    rows = {x: FakeRow(list(ROWS[x])) for x in "abc"}
    st = d.start([rows["a"], rows["b"]], [None] * 2)
    drafts_of(d, st, 3)  # index built before the batch changes
    st = d.merge(st, d.start([rows["c"]], [None]))
    assert d.width(st) == 3
    assert drafts_of(d, st, 3) == [WANT["a"], WANT["b"], WANT["c"]]
    st = d.filter(st, [2, 0])  # the given order
    assert d.width(st) == 2 and drafts_of(d, st, 3) == [WANT["c"], WANT["a"]]
    d.commit(st, 3, np.array([0, 3]), None, np.array([[5, 0, 0, 0], [3, 4, 1, 2]]))  # each row its own tokens
    assert drafts_of(d, st, 3) == [reference(ROWS["c"] + [5], 3, 2, 4), [3, 4, 1]]
    st = d.merge(d.filter(st, [1]), d.capture([rows["b"]], None, np.array([[9]])))  # b re-armed after a gate
    assert drafts_of(d, st, 2) == [[3, 4], []]


class HostOnly:
    """Stands in for `mlx.core` inside the drafter: counts arrays made, fails on anything else."""

    int32 = mx.int32

    def __init__(self):
        self.made = 0

    def array(self, *a, **kw):
        self.made += 1
        return mx.array(*a, **kw)

    def __getattr__(self, name):
        raise AssertionError(f"the ngram drafter used mx.{name}")


def test_host_only_one_array_per_draft(monkeypatch):
    guard = HostOnly()
    monkeypatch.setattr(ngram, "mx", guard)
    d = NGramDrafter()
    rows = [FakeRow(list(ROWS[x])) for x in "abc"]
    st = d.merge(d.start(rows[:2], [None, None]), d.start(rows[2:], [None]))
    st = d.filter(st, [0, 1, 2])
    assert guard.made == 0
    out = d.draft(st, 3, None, [])
    assert guard.made == 1 and isinstance(out, mx.array)
    d.commit(st, 3, np.array([1, 0, 2]), None, np.zeros((3, 4), dtype=np.int32))
    d.capture(rows, None, np.zeros((3, 1), dtype=np.int32))
    assert guard.made == 1


# ---- registration ---------------------------------------------------------------------------

def test_registered_never_the_default(lm):
    assert "ngram" in available(lm)
    assert isinstance(select_drafter(lm, "ngram"), NGramDrafter)
    assert select_drafter(lm).kind == "assistant"  # the model's own default (config.json's speculative_drafter) stays
    assert EngineConfig(drafter="ngram").validated().drafter == "ngram"
    eng = Engine(lm, EngineConfig(drafter="ngram"))
    assert eng.speculative and eng.drafter.kind == "ngram" and not eng.drafter.needs_hidden
    assert cap_defaults(lm, eng.drafter)["model_default_source"] == "family default: ngram drafter"
    eng.close()
    plain = Engine(lm, EngineConfig(drafter="ngram", speculative=False))
    assert not plain.speculative
    plain.close()


# ---- the engine's oracle --------------------------------------------------------------------

@pytest.mark.parametrize("t", [0.0, 0.8])
def test_rows_with_different_draft_counts_equal_solo(lm, prompts, t):
    """Through scalar, preempt, a batch of two, gate (a third row over the cap) and resume, one
    row copies from its own loop while the others find nothing (0 drafts) in the same rounds:
    every stream equals its solo plain stream."""
    eng = engine(lm, 2, drafter="ngram", resume_min_remaining=2)
    arrivals = {0: [("loop", prompts[7], P(40, seed=1, t=t))],  # the model writes "#\n" over and over
                1: [("fresh", list(range(1000, 1009)), P(10, seed=2, t=t))],  # distinct ids: no match
                4: [("late", prompts[31], P(12, seed=4, t=t))]}
    run = drive(eng, arrivals)
    assert check_solo(lm, run) <= 1
    tr = run.transitions()
    assert "preempt" in tr and "gate" in tr and "resume" in tr, tr
    spec = [[d for _, d, _, _ in e.rows] for _, e in run.rounds() if e.round == "speculative"]
    assert any(len(set(ds)) > 1 and 0 in ds for ds in spec), spec  # mixed lengths in one round, 0 included
    # the loop's span ("#\n", 2 tokens) is shorter than K = 3: its drafts go on repeating it
    assert any(d == 3 for ds in spec for d in ds), spec
    if t == 0.0:
        assert sum(a for _, e in run.rounds() for _, _, a, _ in e.rows) > 0
    eng.close()


@pytest.mark.parametrize("t", [0.0, 0.8])
def test_scalar_lane_equals_plain(lm, prompts, t):
    """The scalar lane alone (coupled sampling is moot: the copies are not sampled)."""
    for i in (7, 20):
        params = SamplingParams(max_tokens=32, temperature=t, seed=i)
        spec = run_scalar(lm, prompts[i], params, drafter=NGramDrafter())
        assert compare_streams(lm, prompts[i], solo(lm, prompts[i], params), spec.tokens, params).ok
        if t == 0.0 and i == 7:
            assert spec.stats.num_accepted > 0


def test_scalar_round_without_a_match_decodes_one_token(lm, prompts):
    eng = engine(lm, 0, drafter="ngram")
    prompt = list(range(1000, 1012))  # 12 distinct ids: no earlier occurrence of any suffix
    run = drive(eng, {0: [("x", prompt, P(16, seed=0))]})
    check_solo(lm, run)
    first = run.rounds_of("x")[0]
    assert first[2] == "scalar" and first[4] == 0 and first[5] == 1
    eng.close()


# ---- the real model -------------------------------------------------------------------------

LIST = "apples, bananas, cherries, dates, elderberries, figs, grapes, honeydew"


def test_smollm2_repeats_a_list_with_accepted_drafts(smollm2):
    """SmolLM2 asked to repeat a list, beside a second request (one round alone, then a batch of
    two): greedy ngram streams equal the plain ones, and copies from the prompt are accepted."""
    lm = smollm2.load("float32")
    tok = lm.tokenizer
    chat = tok.apply_chat_template([{"role": "user", "content": f"Repeat this list exactly: {LIST}."}],
                                   add_generation_prompt=True)
    code = tok.encode(f"fruits = [{LIST}]\nfor fruit in fruits:\n")
    eng = Engine(lm, EngineConfig(drafter="ngram", width_cap=0))
    run = drive(eng, {0: [("list", chat, SamplingParams(max_tokens=20, seed=0))],
                      1: [("code", code, SamplingParams(max_tokens=8, seed=0))]})
    check_solo(lm, run)
    assert run.streams["list"].result.stats["num_accepted"] > 0
    assert any(e.round == "speculative" and e.width == 2 for _, e in run.rounds())
    eng.close()


# ---- the CLI --------------------------------------------------------------------------------

def test_cli_generate_and_doctor():
    from test_cli import PROMPT, run

    def gen(*args):
        r = run("generate", PROMPT, "--max-tokens", "24", "--seed", "3", "--json", "--temp", "0", *args)
        assert r.code == 0, r.stderr
        return json.loads(r.stdout)

    spec, plain = gen("--drafter", "ngram"), gen("--no-speculative")
    assert spec["speculative"] and spec["num_drafted"] > 0 and spec["tokens"] == plain["tokens"]
    r = run("doctor")
    assert r.code == 0 and "ngram" in r.stdout, r.stdout  # among the available drafters
    r = run("doctor", "--drafter", "ngram")
    assert r.code == 0 and "family default: ngram drafter" in r.stdout, r.stdout


def test_the_control_counts_a_round_under_the_k_it_asked_not_the_drafts_found(lm, monkeypatch):
    """Prompt lookup finds nothing for distinct ids: the rounds the control asked K drafts of
    draft none, and count under K (one token a round: what choosing K bought), in the scalar lane
    and in the batch lane; never as plain rounds. Keyed by the drafts found, a K=3 choice whose
    rows drafted one token each was credited the model's 4 tokens a round (the micro model)."""
    from gmlx.config import Switches
    from gmlx.policy import control

    control.forget(lm.target)
    seen = []
    real = control.Controller.observe

    def observe(self, width, k, seconds, rows, steady=True):
        seen.append((width, k, [d for d, _ in rows]))
        return real(self, width, k, seconds, rows, steady)

    monkeypatch.setattr(control.Controller, "observe", observe)
    eng = Engine(lm, EngineConfig(drafter="ngram", width_cap=0), switches=Switches(control=True))
    fresh = [list(range(1000 + 20 * i, 1012 + 20 * i)) for i in range(3)]  # distinct ids: no n-gram recurs
    run = drive(eng, {0: [("a", fresh[0], P(10))], 6: [("b", fresh[1], P(8)), ("c", fresh[2], P(8))]})
    check_solo(lm, run)
    kinds = {e.round for _, e in run.rounds()}
    assert {"scalar", "speculative"} <= kinds, kinds
    # rounds where no row found a draft (plain rounds too: k = 0), and those asked for drafts
    empty = [(w, k) for w, k, ds in seen if ds and not any(ds) and k > 0]
    assert any(w == 1 for w, _ in empty) and any(w > 1 for w, _ in empty), seen
    k1 = {k for w, k in empty if w == 1}
    assert all(eng.spec.control.at(1).spec.tokens_per_round(k) == 1.0 for k in k1), k1
    eng.close()
    control.forget(lm.target)
