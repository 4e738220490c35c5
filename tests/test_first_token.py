"""A lone request's first token (gmlx/decode/plain.py FIRST_TOKEN_OUT, scalar.py FIRST_TOKEN_PLAIN): it comes
from a plain step and leaves the engine before anything else is dispatched; a request that will draft
drafts from its second round on (a re-arm: the drafter reads the prompt and that step there), a plain
one dispatches each next step ahead from its second round on. Tokens never move: every stream equals
its solo plain decode, greedy and seeded, plain and speculative, the control on and off, each rule
forced both ways; the round that re-arms is not timed (its period holds the drafter's first read)."""

import pytest

from engine_helpers import P, check_solo, drive
from gmlx import Engine, EngineConfig
from gmlx.config import Switches
from gmlx.decode import plain, scalar
from gmlx.policy import control

LM_WITHOUT_EOS = True  # budgets alone end these requests

ENGINES = {"plain": (EngineConfig(speculative=False), Switches(control=False)),
           "control": (EngineConfig(width_cap=0), Switches(control=True)),
           "no_control": (EngineConfig(width_cap=0), Switches(control=False))}


def _lone(lm, prompt, params, kind: str, monkeypatch, out: bool = True, plain_first: bool = True):
    """One request alone on an engine of `kind`, the rules as given. Returns its rounds' drafts, and per
    step whether a round was in flight after it and how many tokens the request had then; its stream
    checked against its solo plain decode."""
    monkeypatch.setattr(plain, "FIRST_TOKEN_OUT", out)
    monkeypatch.setattr(scalar, "FIRST_TOKEN_PLAIN", plain_first)
    control.forget(lm.target)
    config, switches = ENGINES[kind]
    eng = Engine(lm, config, switches=switches)
    after: list[tuple[bool, int, bool]] = []  # (in flight, tokens so far, the last round re-armed) per step

    def look(run):
        if run.step_no:
            row = eng.scalar.row
            after.append((eng.scalar.in_flight, len(row.tokens) if row is not None else -1, eng.scalar.switched))

    run = drive(eng, {0: [("a", prompt, params)]}, before_step=look)
    check_solo(lm, run)
    eng.close()
    control.forget(lm.target)
    return [d for *_, d, _e in run.rounds_of("a")], after


@pytest.mark.parametrize("params", [P(40), P(40, seed=9, t=0.8)], ids=["greedy", "seeded"])
@pytest.mark.parametrize("kind", list(ENGINES))
@pytest.mark.parametrize("out", [True, False], ids=["first_out", "before"])
def test_the_first_token_leaves_before_anything_else_is_dispatched(lm, prompts, monkeypatch, params, kind, out):
    drafted, after = _lone(lm, prompts[5], params, kind, monkeypatch, out=out)
    first = next(i for i, (_, n, _) in enumerate(after) if n > 0)
    assert after[first][1] == 1 or not out and kind != "plain"  # one token: a plain step's (before: a round's)
    assert after[first][0] is not out  # nothing dispatched behind it (before: the next round was)
    if kind == "plain":
        assert not any(drafted)
        assert all(flying for flying, n, _ in after[first + 1:] if 0 < n < params.max_tokens - 1)  # pipelined on
        assert after[first + 1][2] is out  # the round after it started cold: not timed (ScalarLane.switched)
        return
    assert drafted[0] == 0 if out else drafted[0] > 0  # its first round drafted (before) or ran plain
    if out:  # drafts from its second round: the re-arm, not timed (ScalarLane.switched)
        assert drafted[1] > 0 and after[first + 1][2], (drafted, after)


@pytest.mark.parametrize("params", [P(40), P(40, seed=9, t=0.8)], ids=["greedy", "seeded"])
def test_a_first_round_that_drafts_from_the_prompt_is_still_exact(lm, prompts, monkeypatch, params):
    """FIRST_TOKEN_PLAIN off (gmlx before it): the first round drafts; its token still leaves first."""
    drafted, after = _lone(lm, prompts[5], params, "control", monkeypatch, plain_first=False)
    assert drafted[0] > 0 and all(d > 0 for d in drafted[:3]), drafted


def test_a_request_with_a_predicted_output_drafts_it_from_its_first_round(lm, prompts, monkeypatch):
    """A prediction's drafts cost no drafter work and do not re-arm: its first round verifies them."""
    from engine_helpers import solo

    predicted = solo(lm, prompts[5], P(40))
    drafted, _ = _lone(lm, prompts[5], P(40, prediction=lm.tokenizer.decode(predicted)), "control", monkeypatch)
    assert drafted[0] > 0, drafted


def test_smollm2_a_lone_request_takes_its_first_token_plain_and_drafts_from_the_second(smollm2, monkeypatch):
    """The same on the real model with its shipped EAGLE-3 head, the control on (the user's path)."""
    lm = smollm2.load("float32")
    drafted, after = _lone(lm, lm.tokenizer.encode("Write a Python function that adds two numbers."), P(24),
                           "control", monkeypatch)
    first = next(i for i, (_, n, _) in enumerate(after) if n > 0)
    assert after[first][:2] == (False, 1) and drafted[0] == 0 and drafted[1] > 0, (drafted, after)


@pytest.mark.parametrize("out", [True, False], ids=["first_out", "before"])
def test_in_a_batch_a_rows_first_token_leaves_before_the_next_step_is_dispatched(lm, prompts, monkeypatch, out):
    """Plain batch rounds (two requests together, a third joining later): the round that gives a row its
    first token dispatches no lookahead; the round after it starts cold and is not timed (Lanes.cold)."""
    from gmlx.policy.admission import Round

    monkeypatch.setattr(plain, "FIRST_TOKEN_OUT", out)
    eng = Engine(lm, EngineConfig(speculative=False), switches=Switches(control=False))
    seen = []  # per step: (rows' token counts, a lookahead in flight, the next plain round cold)

    def look(run):
        if run.step_no:
            seen.append(([len(r.tokens) for r in eng.live_rows()], eng.batch.lookahead is not None,
                         eng.lanes.cold(Round.PLAIN)))

    run = drive(eng, {0: [("a", prompts[1], P(30)), ("b", prompts[2], P(30, seed=3, t=0.8))],
                      6: [("c", prompts[3], P(20))]}, before_step=look)
    check_solo(lm, run)
    eng.close()
    firsts = [i for i, (counts, _, _) in enumerate(seen) if 1 in counts and len(counts) > 1]
    assert len(firsts) >= 2, seen  # the pair's first round, and the newcomer's
    for i in firsts:
        assert seen[i][1] is not out and seen[i][2] is out, seen[i]
