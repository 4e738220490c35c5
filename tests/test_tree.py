"""Tree verification in the scalar lane (gmlx/decode/tree_verify.py, gmlx/drafters/token_tree.py): several
draft paths verified as rows of one forward over the request's shared prefix K/V, acceptance
walking the tree along the target's own tokens, only the accepted path kept. The tree never
changes a token: greedy and seeded streams equal solo plain decoding (tie-aware), also when a
scripted tree forces acceptance along a non-first branch (and a switch of branch mid-path)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from engine_helpers import P, matches_solo, solo
from gmlx import Engine, EngineConfig, SamplingParams
from gmlx.config import Switches
from gmlx.decode.tree_verify import EXPLORE_EVERY, MIN_ROUNDS, TreeChoice, TreeScalarLane, walk
from gmlx.drafters.ngram import NGramDrafter
from gmlx.drafters.select import select_drafter
from gmlx.drafters.token_tree import TreeProposer
from gmlx.errors import ConfigError
from gmlx.engine.oracle import make_row

import mlx.core as mx  # after gmlx

LM_WITHOUT_EOS = True
K = 3


def tree_lane(lm, drafter=None, branches=2, **kw) -> TreeScalarLane:
    return TreeScalarLane(lm.target, drafter or select_drafter(lm, "mtp"), K, may_go_plain=False, tree="always",
                          branches=branches, **kw)


def run_tree(lm, prompt, params, lane=None):
    lane = lane or tree_lane(lm)
    row = make_row(lm, prompt, params)
    results = []
    lane.start(row)
    seq = lane.seq
    while not row.is_done:
        res = lane.round()
        results.append(res)
        row.take(res, time.perf_counter())
    # only the accepted paths entered the cache: it holds every token but the pending bonus
    expected = len(row.prompt) + len(row.tokens) - 1
    assert all(c.offset in (expected, expected + 1) for c in seq.cache), ([c.offset for c in seq.cache], expected)
    lane.clear()
    return row, results, lane


# -- the acceptance walk ---------------------------------------------------------------------------
def test_walk_follows_the_target_along_any_branch():
    drafts = np.array([[5, 6, 7], [5, 8, 9]])
    # row 0's target: 5, then 8 (not its draft 6); row 1 (same prefix 5) continues 8, 9, then 4
    targets = np.array([[5, 8, 1, 1], [5, 8, 9, 4]])
    path, a, tokens = walk(drafts, targets, np.array([3, 3]))
    assert (path, a, tokens) == (1, 3, [5, 8, 9, 4])


def test_walk_takes_the_token_from_the_followed_path_and_respects_lengths():
    drafts = np.array([[1, 2, 3], [4, 5, 0]])
    targets = np.array([[9, 9, 9, 9], [4, 5, 6, 7]])
    # row 0's target at depth 0 is 9: no path drafted 9, so nothing is accepted, bonus 9 (row 0's)
    assert walk(drafts, targets, np.array([3, 2])) == (0, 0, [9])
    targets = np.array([[4, 0, 0, 0], [4, 5, 0, 7]])
    # row 1 drafted only 2 tokens: its padding 0 is never accepted even though the target says 0
    assert walk(drafts, targets, np.array([3, 2])) == (1, 2, [4, 5, 0])
    # a FAULT (-1) target is never accepted and is the bonus
    assert walk(drafts, np.array([[-1, 0, 0, 0], [4, 5, 6, 7]]), np.array([3, 2])) == (0, 0, [-1])


def test_the_choice_runs_the_faster_and_measures_both_again():
    c = TreeChoice("auto")
    shapes = []
    for _ in range(2 * MIN_ROUNDS):  # measuring: alternating, paired under the same load
        tree = c.pick()
        shapes.append(tree)
        c.observe(tree, 3 if tree else 2, 0.012 if tree else 0.010)  # tree 250 tok/s, chain 200
    assert shapes.count(True) == shapes.count(False) == MIN_ROUNDS
    assert c.pick() is True  # measured faster
    for _ in range(EXPLORE_EVERY):
        c.observe(True, 2, 0.5)  # (figures outside the measuring phase do not decide)
    assert c.measuring == 2 * MIN_ROUNDS and not c.figures[True]  # both measured again
    for _ in range(2 * MIN_ROUNDS):
        tree = c.pick()
        c.observe(tree, 2, 0.013 if tree else 0.010)  # now the tree is slower
    assert c.pick() is False and c.pick() is False
    assert TreeChoice("never").pick() is False and TreeChoice("always").pick() is True
    with pytest.raises(ValueError):
        TreeChoice("sometimes")


def test_the_switch_is_parsed_strictly():
    assert Switches.from_env({}).tree is False
    assert Switches.from_env({"GMLX_TREE": "on"}).tree is True
    assert Switches.from_env({"GMLX_TREE": "0"}).tree is False
    with pytest.raises(ConfigError):
        Switches.from_env({"GMLX_TREE": "maybe"})


# -- streams ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("t", [0.0, 0.8])
def test_tree_streams_equal_plain_decoding(lm, prompts, t):
    for i, prompt in enumerate(prompts[:3]):
        params = P(40, seed=11 + i, t=t)
        row, results, lane = run_tree(lm, prompt, params)
        matches_solo(lm, prompt, params, row.tokens)
        assert lane.tree_rounds >= len(results) - 1
        assert sum(r.accepted for r in results) > 0


class ScriptedTree(TreeProposer):
    """Runs the real tree drafting (so the drafter's state evolves as it would), then replaces
    the drafts: path 0 agrees with the reference only at depth 0 (wrong at depth 1), path 1 is
    the reference's continuation, path 2 (if any) is wrong from depth 0."""

    def __init__(self, ref, prompt_len, vocab):
        super().__init__()
        self.ref, self.n0, self.vocab = ref, prompt_len, vocab

    def propose(self, drafter, st, k, branches, rs, rs_rows, position):
        real, lengths = super().propose(drafter, st, k, branches, rs, rs_rows, position)
        i = position - self.n0
        good = (list(self.ref[i:i + k]) + [0] * k)[:k]
        bad = [(x + 1) % self.vocab for x in good]
        rows = [[good[0]] + bad[1:], good, bad][:branches]
        forced = mx.array(rows, dtype=mx.int32)
        return forced + 0 * real[:len(rows), :k], np.full(len(rows), k, dtype=np.int64)


@pytest.mark.parametrize("t, branches", [(0.0, 2), (0.8, 3)])
def test_acceptance_along_a_non_first_branch(lm, prompts, t, branches):
    prompt, params = prompts[0], P(30, seed=5, t=t)
    ref = solo(lm, prompt, params)
    lane = tree_lane(lm, branches=branches)
    lane.proposer = ScriptedTree(ref, len(prompt), lm.target.vocab_size)
    row, results, _ = run_tree(lm, prompt, params, lane)
    matches_solo(lm, prompt, params, row.tokens)
    # every full round accepted all k drafts: along path 1, switching from path 0 after depth 0
    full = [r for r in results[:-1] if r.drafted == K]
    assert full and all(r.accepted == K for r in full), [(r.drafted, r.accepted) for r in results]


@pytest.mark.parametrize("t", [0.0, 0.8])
def test_pruned_trees_equal_plain_decoding(lm, prompts, t):
    """Confidence pruning: a depth-1 branch below min_q is dropped; a one-path round is the chain
    (on the cache itself, trimmed after), mixed with two-path rounds in one request."""
    prompt, params = prompts[3], P(40, seed=4, t=t)
    lane = tree_lane(lm, min_q=0.2)
    row, results, lane = run_tree(lm, prompt, params, lane)
    matches_solo(lm, prompt, params, row.tokens)
    assert lane.tree_rounds and lane.paths < 2 * lane.tree_rounds  # some rounds were pruned to one path


def test_ngram_trees_equal_plain_decoding(lm, prompts):
    prompt = prompts[1] * 2  # repeats: prompt lookup finds matches
    for t in (0.0, 0.8):
        params = P(30, seed=3, t=t)
        row, results, lane = run_tree(lm, prompt, params, tree_lane(lm, NGramDrafter(), branches=3))
        matches_solo(lm, prompt, params, row.tokens)


def test_the_engine_runs_trees_when_switched_on(lm, prompts):
    eng = Engine(lm, EngineConfig(num_draft_tokens=K, drafter="mtp"), switches=Switches(tree=True))
    assert isinstance(eng.scalar, TreeScalarLane)
    eng.scalar.choice.mode = "always"
    params = P(24, seed=9, t=0.8)
    rec = eng.generate(prompts[2], params)
    eng.close()
    matches_solo(lm, prompts[2], params, rec.tokens)
    assert eng.scalar.tree_rounds > 0
    assert not isinstance(Engine(lm, EngineConfig(num_draft_tokens=K, drafter="mtp"), switches=Switches()).scalar, TreeScalarLane)


# -- the real model ---------------------------------------------------------------------------------
@pytest.mark.parametrize("t", [0.0, 0.7])
def test_smollm2_tree_streams_equal_plain_decoding(smollm2, t):
    lm = smollm2.load("float32")
    prompt = lm.tokenizer.encode("Write a Python function that checks whether a number is even.")
    params = SamplingParams(max_tokens=32, temperature=t, top_p=0.95 if t else 1.0, seed=21, ignore_eos=True)
    row, results, lane = run_tree(lm, prompt, params)
    matches_solo(lm, prompt, params, row.tokens)
    assert lane.tree_rounds > 0
    ref = solo(lm, prompt, params)
    lane = tree_lane(lm)
    lane.proposer = ScriptedTree(ref, len(prompt), lm.target.vocab_size)
    row, results, _ = run_tree(lm, prompt, params, lane)
    matches_solo(lm, prompt, params, row.tokens)
    full = [r for r in results[:-1] if r.drafted == K]
    assert full and all(r.accepted == K for r in full)


def test_a_tree_request_preempted_into_the_batch_keeps_its_stream(lm, prompts):
    """A lone request decoding trees is preempted by a waiter mid-flight (its tree round is read
    first, only the accepted path's K/V in its cache) and finishes in the batch loop."""
    from engine_helpers import check_solo, drive

    eng = Engine(lm, EngineConfig(num_draft_tokens=K, drafter="mtp"), switches=Switches(tree=True))
    eng.scalar.choice.mode = "always"
    arrivals = {0: [("a", prompts[0], P(40, seed=1, t=0.8))], 6: [("b", prompts[1], P(20, seed=2))]}
    run = drive(eng, arrivals)
    assert eng.scalar.tree_rounds > 0 and "preempt" in " ".join(map(str, run.transitions())).lower()
    check_solo(lm, run)
    eng.close()
