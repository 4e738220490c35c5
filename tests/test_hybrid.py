"""Hybrid targets speculate: exact per-row rollback of recurrent state (gmlx/recurrent.py).

Tiny random checkpoints in the real layouts (tests/native_checkpoints.py, written with mlx-lm's
own classes): "qn" Qwen3-Next (MoE), "q35" Qwen3.5 (dense, more value heads than key heads), and
"q35moe" Qwen3.5-MoE, each with its native MTP head. What is checked:

- the cache: gmlx's capture forward is mlx-lm's forward (bit-exact on the same shapes), and a
  trim after a verify leaves every layer where a plain forward of the kept prefix would, per
  row in a ragged batch; right-padded prefill, filter/extend/lift/extract, the journal's reach;
- the loops: greedy and seeded streams equal plain decoding (and greedy equals mlx-lm's
  generate_step), with drafts forced to every acceptance length (a scripted drafter, per row in
  a batch with rows of different acceptance), the target as its own draft model (every draft
  accepted: the draft side rolls back exactly too), a disagreeing hybrid draft model;
- the transitions: preempt, gate, capture and resume with hybrid rows; the prompt cache reuses
  a hybrid sequence only whole.
Streams are compared tie-aware (tests/numerics.py); no tie is expected and any is counted.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import ArraysCache

from engine_helpers import check_solo, drive, engine, solo, speculates, with_eos
from gmlx import Engine, EngineConfig, SamplingParams
from gmlx.config import Switches
from gmlx.models.forward import prefill
from gmlx.decode.scalar import ScalarLane
from gmlx.drafters.draft_model import DraftModelDrafter
from gmlx.drafters.mtp import MTPDrafter
from gmlx.model_cache import extract_row, lift_caches, make_ragged_cache, recurrent_layers, trim_rows
from gmlx.models import family
from gmlx.models.loading import load
from gmlx.models.gated_delta import install
from gmlx.recurrent import RecurrentCache
from gmlx.engine.oracle import decode_alone, make_row, run_scalar
from doubles import ScriptedDrafter
from native_checkpoints import qwen3_5_checkpoint, qwen3_next_checkpoint
from numerics import assert_close, same_stream

PROMPT = [5, 17, 300, 42, 7, 99, 1000, 3, 64, 1500]
PROMPTS = [PROMPT, [9, 8, 7, 600, 5, 4], [1200, 33, 33, 1, 77, 640, 2, 19, 1000, 3, 5, 6, 31], [44, 45]]
FAMILIES = ["qn", "q35", "q35moe"]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    return {"qn": qwen3_next_checkpoint(root / "qn")[0], "q35": qwen3_5_checkpoint(root / "q35")[0],
            "q35moe": qwen3_5_checkpoint(root / "q35moe", moe=True)[0],
            "qn_other": qwen3_next_checkpoint(root / "qn_other", seed=5)[0],
            "q35_other": qwen3_5_checkpoint(root / "q35_other", seed=5)[0]}


@pytest.fixture(scope="module")
def lms(ckpts):
    return {name: with_eos(load(p), []) for name, p in ckpts.items()}


@pytest.fixture(autouse=True)
def _fresh_solo_streams():
    """engine_helpers.solo caches streams by prompt and params, not by model: these tests decode
    the same prompts on several models."""
    import engine_helpers

    engine_helpers._SOLO.clear()
    yield
    engine_helpers._SOLO.clear()


def _other(name: str) -> str:
    return "qn_other" if name == "qn" else "q35_other"


def _rec_states(caches) -> list:
    return [a for c in caches if isinstance(c, (RecurrentCache, ArraysCache)) for a in c.cache]


# -- the cache ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", FAMILIES)
def test_hybrids_can_roll_back(lms, name):
    lm = lms[name]
    assert lm.can_rollback and speculates(lm) and lm.rollback_blockers == ()
    assert lm.drafter_kind == "native-mtp:qwen3_next"
    assert len(recurrent_layers(lm.target.model)) == 3  # 3 Gated DeltaNet layers of 4, found from the model
    kinds = [type(c).__name__ for c in lm.target.make_cache()]
    assert kinds == ["RecurrentCache"] * 3 + ["KVCache"]


@pytest.mark.parametrize("name", FAMILIES)
def test_capture_forward_is_mlx_lms_forward(lms, name):
    """The capture forward (gmlx) and mlx-lm's own forward, on the same shapes: equal outputs and
    states (bit-identical on the CPU, where mlx-lm's gated-delta step runs the same ops; within
    the rounding of other kernels where it runs a fused kernel), from an empty state and from a
    written one."""
    _, layer, _ = recurrent_layers(lms[name].target.model)[0]
    mixer = layer.linear_attn
    base = type(mixer).__mro__[1]
    x = mx.random.normal((2, 7, 32), key=mx.random.key(3))
    ref_c, ours_c = ArraysCache(2), RecurrentCache(2)
    for part in (x[:, :3], x[:, 3:]):
        ref = base.__call__(mixer, part, None, ref_c)
        ours = mixer(part, None, ours_c)
        assert_close(ours, ref)
        for a, b in zip(ref_c.cache, ours_c.cache):
            assert_close(b, a)
    assert_close(mixer(x, None, ArraysCache(2)), base.__call__(mixer, x, None, ArraysCache(2)))


@pytest.mark.parametrize("name", FAMILIES)
def test_trim_leaves_every_layer_at_the_kept_prefix(lms, name):
    """A verify of 6 positions trimmed by n (0..6) leaves each recurrent layer's state (and the
    next forward's logits) where a plain forward of the kept prefix does."""
    model = lms[name].target.model
    toks = mx.array([PROMPT + [11, 12]], dtype=mx.int32)
    for n in range(7):
        keep = 12 - n
        ref_c = model.make_cache()
        model(toks[:, :keep], cache=ref_c)
        c = lms[name].target.make_cache()
        model(toks[:, :6], cache=c)
        model(toks[:, 6:12], cache=c)
        for layer in c:
            layer.trim(n)
        assert [layer.offset for layer in c] == [keep] * 4
        for a, b in zip(_rec_states(ref_c), _rec_states(c)):
            assert_close(b, a, msg=f"state after trimming {n}", recurrent=True)
        nxt = mx.array([[777]], dtype=mx.int32)
        assert_close(model(nxt, cache=c), model(nxt, cache=ref_c), msg=f"logits after trimming {n}", recurrent=True)


@pytest.mark.parametrize("name", ["qn", "q35"])
def test_trim_rows_per_row_in_a_ragged_batch(lms, name):
    """Three rows of different lengths lifted into one batch, a verify of 5, each row trimmed by
    its own count: each row equals its own plain forward of its kept tokens."""
    target = lms[name].target
    model = target.model
    rows = [PROMPTS[0], PROMPTS[1], PROMPTS[2]]
    singles = []
    for p in rows:
        c = target.make_cache()
        prefill(target, c, [p], 512, want_hidden=False)
        singles.append(c)
    batch = lift_caches(singles)
    ext = mx.array([[21, 22, 23, 24, 25]] * 3, dtype=mx.int32)
    target(ext, batch)
    ns = np.array([0, 3, 5])
    trim_rows(batch, ns)
    for b, p in enumerate(rows):
        ref_c = model.make_cache()
        model(mx.array([p + [21, 22, 23, 24, 25][: 5 - ns[b]]], dtype=mx.int32), cache=ref_c)
        row = extract_row(batch, b)
        assert row[0].offset == len(p) + 5 - ns[b]
        for a, s in zip(_rec_states(ref_c), _rec_states(row)):
            assert_close(s, a, msg=f"row {b}")


@pytest.mark.parametrize("name", ["qn", "q35moe"])
def test_right_padded_prefill_stops_each_row_at_its_length(lms, name):
    """A batch prefill of ragged prompts (right-padded, in chunks shorter than the longest) and a
    per-row trim of the padding: each row's recurrent state is its own prompt's."""
    target = lms[name].target
    bodies = [p[:-1] for p in PROMPTS]
    cache = make_ragged_cache(target.model, len(bodies))
    prefill(target, cache, bodies, 4, want_hidden=True)
    longest = max(len(b) for b in bodies)
    trim_rows(cache, [longest - len(b) for b in bodies])
    assert cache[0].lengths is None  # mlx-lm's `lengths` is only set during the padded forward
    for b, body in enumerate(bodies):
        ref_c = target.model.make_cache()
        target.model(mx.array([body], dtype=mx.int32), cache=ref_c)
        for a, s in zip(_rec_states(ref_c), _rec_states(extract_row(cache, b))):
            assert_close(s, a, msg=f"row {b}")


def test_membership_and_reach(lms):
    """filter/extend keep each row's state; one-token steps stay reachable up to `span`; a trim
    past what the journal holds is refused, never silently wrong."""
    target = lms["qn"].target
    c = make_ragged_cache(target.model, 2)
    prefill(target, c, [PROMPTS[0], PROMPTS[1]], 512, want_hidden=False)
    trim_rows(c, [0, len(PROMPTS[0]) - len(PROMPTS[1])])
    rows = [extract_row(c, 0), extract_row(c, 1)]
    more = make_ragged_cache(target.model, 1)
    prefill(target, more, [PROMPTS[2]], 512, want_hidden=False)
    for x, y in zip(c, more):
        x.extend(y)
    for x in c:
        x.filter([2, 0])
    for got, want in ((extract_row(c, 0), extract_row(more, 0)), (extract_row(c, 1), rows[0])):
        for a, b in zip(_rec_states(want), _rec_states(got)):
            assert mx.array_equal(a, b).item()
    rec = c[0]
    assert isinstance(rec, RecurrentCache)
    before = list(rec.cache)
    rec.span = 3
    for t in (31, 32, 33):
        target.logits(mx.array([[t], [t]], dtype=mx.int32), c)
    rec.trim_rows([3, 1])
    assert mx.array_equal(rec.cache[1][:1], before[1][:1]).item()
    with pytest.raises(ValueError, match="cannot go back"):
        rec.trim_rows([0, 5])


def test_unsupported_recurrent_layers_name_themselves():
    """A recurrent mixer gmlx cannot capture (mlx-lm's Mamba2) is a blocker with its name."""
    from mlx_lm.models import mamba2

    args = mamba2.ModelArgs(model_type="mamba2", num_heads=2, head_dim=8, vocab_size=64, hidden_size=16,
                            intermediate_size=16, state_size=8, num_hidden_layers=2, layer_norm_epsilon=1e-5,
                            conv_kernel=4, n_groups=1, use_bias=False, use_conv_bias=True, tie_word_embeddings=True,
                            time_step_limit=(0.0, float("inf")), time_step_rank=4)
    model = mamba2.Model(args)
    why = family.rollback_blockers(model)
    assert why and "Mamba2Block" in why[0] and "Gated DeltaNet" in why[0]
    assert install(model) == why


# -- the loops ---------------------------------------------------------------------------------
def _forcing_script(ref: list[int], prompt_len: int, schedule: list[int], vocab: int):
    """Drafts that are the reference stream's next a tokens, then a wrong one: acceptance a =
    schedule[n] in the script's n-th round (the script sees the first draft's absolute position)."""
    rounds: dict[int, int] = {}

    def script(pos: int, k: int) -> list[int]:
        i = pos - prompt_len
        a = min(schedule[rounds.setdefault(pos, len(rounds)) % len(schedule)], k)
        nxt = ref[i: i + k + 1] + [0] * (k + 1)
        if a == k:
            return nxt[:k]
        return nxt[:a] + [(nxt[a] + 1) % vocab] + [(t + 7) % vocab for t in nxt[a + 1: k]]

    return script


def _lane(lm, drafter, k: int) -> ScalarLane:
    return ScalarLane(lm.target, drafter, k, adaptive=False, may_go_plain=False)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("temp,seed", [(0.0, 0), (0.8, 3)])
def test_scalar_loop_every_acceptance_length(lms, name, temp, seed):
    """Drafts forced to accept 0..k (k = 4) in turn: the stream is the plain one, and every
    acceptance length really happened."""
    lm, k = lms[name], 4
    params = SamplingParams(temperature=temp, top_p=0.95 if temp else 1.0, max_tokens=40, seed=seed)
    ref = run_scalar(lm, PROMPT, params, speculative=False).tokens
    script = _forcing_script(ref, len(PROMPT), [0, 1, 2, 3, 4, 2, 0, 4, 1, 3], lm.target.vocab_size)
    drafter = ScriptedDrafter(lm.head, lm.target, script)
    row = decode_alone(_lane(lm, drafter, k), make_row(lm, PROMPT, params))
    c = same_stream(lm, PROMPT, ref, row.tokens, params)
    assert c.equal
    hist = row.stats.acceptance_histogram
    assert len(hist) == k + 1 and all(hist), hist


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_streams_equal_mlx_lm_generate_step(lms, name):
    """Greedy: mlx-lm's generate_step, gmlx plain, gmlx speculating with the native MTP head."""
    lm = lms[name]
    params = SamplingParams(temperature=0.0, max_tokens=24, seed=0)
    theirs = [int(t) for t, _ in generate_step(mx.array(PROMPT), lm.target.model, max_tokens=24)]
    plain = run_scalar(lm, PROMPT, params, speculative=False).tokens
    spec = run_scalar(lm, PROMPT, params, speculative=True, k=3)
    same_stream(lm, PROMPT, theirs, plain, params)
    assert same_stream(lm, PROMPT, theirs, spec.tokens, params).equal
    assert spec.stats.num_drafted > 0


@pytest.mark.parametrize("name", ["qn", "q35"])
@pytest.mark.parametrize("which", ["self", "other"])
@pytest.mark.parametrize("temp,seed", [(0.0, 0), (0.8, 5)])
def test_scalar_loop_with_a_hybrid_draft_model(lms, name, which, temp, seed):
    """The target as its own draft model (a hybrid draft side: greedy, every draft accepted, so
    its rollback after the verify is exact), and a disagreeing hybrid draft model."""
    lm = lms[name]
    draft = lm if which == "self" else lms[_other(name)]
    params = SamplingParams(temperature=temp, top_p=0.95 if temp else 1.0, max_tokens=30, seed=seed)
    ref = run_scalar(lm, PROMPT, params, speculative=False).tokens
    drafter = DraftModelDrafter(draft.target, path=None)
    row = decode_alone(_lane(lm, drafter, 3), make_row(lm, PROMPT, params))
    assert same_stream(lm, PROMPT, ref, row.tokens, params).equal
    assert row.stats.num_drafted > 0
    if which == "self" and temp == 0.0:
        assert row.stats.num_accepted == row.stats.num_drafted
    if which == "other":
        assert row.stats.num_accepted < row.stats.num_drafted


@dataclass
class _Scripted:
    inner: object
    rows: list


class RowScriptedDrafter(MTPDrafter):
    """The MTP head runs (its state evolves as in real drafting); each row's drafts follow its
    own script, keyed by the row's prompt: rows of one batch accept different counts."""

    def __init__(self, head, d_model: int, scripts: dict):
        super().__init__(head, d_model)
        self.scripts = scripts  # tuple(prompt) -> script(first_position, k)

    def start(self, rows, pres):
        return _Scripted(super().start(rows, pres), list(rows))

    def merge(self, a, b):
        return _Scripted(super().merge(a.inner, b.inner), a.rows + b.rows)

    def filter(self, st, keep):
        return _Scripted(super().filter(st.inner, keep), [st.rows[i] for i in keep])

    def width(self, st):
        return super().width(st.inner)

    def draft(self, st, k, pick, target_cache):
        real = super().draft(st.inner, k, pick, target_cache)
        forced = [self.scripts[tuple(r.prompt)](int(p), k) for r, p in zip(st.rows, pick.first_positions)]
        return mx.array(forced, dtype=mx.int32) + 0 * real

    def commit(self, st, k, accepted, hidden, targets):
        super().commit(st.inner, k, accepted, hidden, targets)

    def capture(self, rows, hidden, targets):
        return _Scripted(super().capture(rows, hidden, targets), list(rows))


def _params(i: int, n: int) -> SamplingParams:
    if i % 2:
        return SamplingParams(max_tokens=n, temperature=0.8, top_p=0.95, seed=100 + i)
    return SamplingParams(max_tokens=n, temperature=0.0, seed=i)


SCHEDULES = [[0, 1, 2, 3], [3, 3, 0, 2, 1], [1, 0, 0, 3, 2, 3], [2, 3, 1, 0]]


@pytest.mark.parametrize("name", FAMILIES)
def test_batch_rows_with_different_acceptance(lms, name):
    """Four hybrid rows in one batch (cap 0: always speculating, k = 3), each forced through its
    own acceptance schedule: per-row rollback leaves every row on its solo plain stream."""
    lm = lms[name]
    reqs = [(PROMPTS[i], _params(i, 26 + 3 * i)) for i in range(4)]
    scripts = {tuple(p): _forcing_script(solo(lm, p, prm), len(p), SCHEDULES[i], lm.target.vocab_size)
               for i, (p, prm) in enumerate(reqs)}
    drafter = RowScriptedDrafter(lm.head, lm.target.hidden_size, scripts)
    eng = Engine(lm, EngineConfig(width_cap=0, num_draft_tokens=3), switches=Switches(preempt=True, resume=True),
                 drafter=drafter)
    run = drive(eng, {0: [(i, p, prm) for i, (p, prm) in enumerate(reqs)]})
    assert check_solo(lm, run) == 0
    hists = [run.streams[i].result.stats["acceptance_histogram"] for i in range(4)]
    assert all(len(h) == 4 and all(h) for h in hists), hists
    widths = {e.width for _, e in run.rounds() if e.round == "speculative"}
    assert max(widths) == 4 and len(widths) > 1  # rows finished at different rounds


@pytest.mark.parametrize("name", ["qn", "q35"])
@pytest.mark.parametrize("which", ["self", "other"])
def test_batch_loop_with_a_hybrid_draft_model(lms, name, which):
    lm = lms[name]
    draft = lm if which == "self" else lms[_other(name)]
    reqs = [(PROMPTS[i], _params(i, 20 + 2 * i)) for i in range(3)]
    eng = engine(lm, 0, speculative=True, num_draft_tokens=3, draft_model=draft)
    run = drive(eng, {0: [(i, p, prm) for i, (p, prm) in enumerate(reqs)]})
    assert check_solo(lm, run) == 0
    stats = [run.streams[i].result.stats for i in range(3)]
    assert all(s["num_drafted"] > 0 for s in stats)
    if which == "self":  # greedy drafts of the target itself: a greedy row accepts every one
        assert all(s["num_accepted"] == s["num_drafted"] for i, s in enumerate(stats) if i % 2 == 0)


# -- the transitions -----------------------------------------------------------------------------
@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("cap", [1, 2])
def test_transitions_preempt_gate_capture_resume(lms, name, cap):
    """One long request speculating alone, then waiters (preempt); over the cap the batch gates,
    drains and re-arms through a capture round: every stream equals its solo plain one."""
    lm = lms[name]
    arrivals = {0: [("long", PROMPTS[0], _params(0, 44))],
                3: [("w1", PROMPTS[1], _params(1, 8)), ("w2", PROMPTS[2], _params(2, 12))],
                5: [("w3", PROMPTS[3], _params(3, 10))]}
    eng = engine(lm, cap, speculative=True, num_draft_tokens=3)
    run = drive(eng, arrivals)
    assert check_solo(lm, run) == 0
    tr = run.transitions()
    assert tr[0] == "start_scalar" and "preempt" in tr and "gate" in tr and "resume" in tr, tr
    kinds = [e.round for _, e in run.rounds()]
    assert "capture" in kinds
    assert kinds[-1] in ("speculative", "capture")  # the long request re-armed after the waiters left


@pytest.mark.parametrize("name", ["qn", "q35"])
def test_prompt_cache_reuses_a_hybrid_sequence_only_whole(lms, name):
    """A retired hybrid request's state stands for its whole sequence: a prompt that extends it
    (the next turn) prefills only the rest and decodes the solo stream; a prompt that shares only
    part of it gets no hit (its recurrent state at that point was never kept)."""
    lm = lms[name]
    eng = engine(lm, 0, speculative=True, num_draft_tokens=3)
    first = SamplingParams(max_tokens=10, temperature=0.0, seed=0)
    r1 = drive(eng, {0: [("a", PROMPT, first)]}).streams["a"].result
    seq = PROMPT + r1.tokens
    assert len(eng.prompt_cache) == 1 and len(eng.prompt_cache.keys()[0]) == len(seq) - 1
    nxt = seq[:-1] + [8, 9, 10]
    run = drive(eng, {0: [("b", nxt, SamplingParams(max_tokens=12, temperature=0.8, seed=4))]})
    rec = run.streams["b"].result
    assert rec.stats["prefill_tokens"] == 2  # after the stored whole sequence: [8, 9] (10 is the bonus)
    assert check_solo(lm, run) == 0
    part = PROMPT[:6] + [500, 501]
    run = drive(eng, {0: [("c", part, first)]})
    assert run.streams["c"].result.stats["prefill_tokens"] == len(part) - 1
    assert check_solo(lm, run) == 0


@pytest.mark.parametrize("name", ["qn", "q35"])
def test_a_stop_mid_round_drops_the_flight_and_stores_only_a_consistent_state(lms, name):
    """A lone hybrid request ends at a stop while its next round is in flight: the flight's drafts
    are rolled back at retirement, the prompt cache keeps a state only where it stands for the
    stored tokens exactly, and a request that extends the sequence decodes its solo stream."""
    lm = lms[name]
    eng = engine(lm, 0, speculative=True, num_draft_tokens=3)
    full = solo(lm, PROMPT, SamplingParams(max_tokens=30, temperature=0.0, seed=0))
    stop = SamplingParams(max_tokens=30, temperature=0.0, seed=0, stop_fn=lambda toks, _text: len(toks) >= 9)
    rec = drive(eng, {0: [("a", PROMPT, stop)]}).streams["a"].result
    assert rec.tokens == full[:9] and rec.finish_reason == "stop"
    for key in eng.prompt_cache.keys():
        entry = eng.prompt_cache._entries[key]
        assert all(c.offset == len(key) for c in entry.caches if isinstance(c, RecurrentCache))
    nxt = PROMPT + full[:9] + [3, 4]
    run = drive(eng, {0: [("b", nxt, SamplingParams(max_tokens=10, temperature=0.0, seed=1))]})
    assert check_solo(lm, run) == 0


@pytest.mark.parametrize("cap", [1, 2])
def test_transitions_with_a_hybrid_draft_model(lms, cap):
    """Preempt, gate, capture (the draft model re-prefilled on each row) and resume, drafting with
    a disagreeing hybrid draft model: every stream equals its solo plain one."""
    lm = lms["q35"]
    arrivals = {0: [("long", PROMPTS[0], _params(0, 40))],
                3: [("w1", PROMPTS[1], _params(1, 8)), ("w2", PROMPTS[2], _params(2, 12))]}
    run = drive(engine(lm, cap, speculative=True, num_draft_tokens=3, draft_model=lms["q35_other"]), arrivals)
    assert check_solo(lm, run) == 0
    tr = run.transitions()
    assert "preempt" in tr and "gate" in tr and "resume" in tr, tr


def test_prompt_lookup_drafts_on_a_hybrid_target(lms):
    """The ngram drafter (host drafts, rows drafting different lengths, some none): a hybrid
    target now offers it, and its per-row rollback of padded columns keeps every stream exact."""
    from gmlx.drafters.select import available

    lm = lms["qn"]
    assert "ngram" in available(lm)
    rep = [5, 6, 7, 8] * 4 + [5, 6]
    reqs = [(rep, _params(0, 20)), (PROMPTS[1], _params(1, 14)), (rep[:9] + [40, 41], _params(2, 16))]
    run = drive(engine(lm, 0, speculative=True, drafter="ngram", num_draft_tokens=3),
                {0: [(i, p, prm) for i, (p, prm) in enumerate(reqs)]})
    assert check_solo(lm, run) == 0
    assert sum(run.streams[i].result.stats["num_drafted"] for i in range(3)) > 0


def test_cost_model_prior_includes_the_capture(lms, loaded_lm):
    """Before anything is measured, a hybrid target's verify costs the prior plus the capture's
    measured share (gmlx.models.gated_delta.CAPTURE_COST); a dense target's the prior alone."""
    from gmlx.decode.probe import round_costs
    from gmlx.drafters.select import select_drafter
    from gmlx.policy.costs import PRIOR
    from gmlx.models.gated_delta import CAPTURE_COST

    hybrid = round_costs(lms["q35"].target, select_drafter(lms["q35"]), 3)  # GMLX_ROUND_COSTS=prior (conftest)
    assert hybrid.source.startswith("prior")
    assert hybrid.verify[3] == pytest.approx(PRIOR.verify[3] * (1 + CAPTURE_COST[3])) and hybrid.verify[0] == 1.0
    dense = round_costs(loaded_lm.target, select_drafter(loaded_lm), 3)
    assert dense.verify == PRIOR.verify


def test_one_token_prompts(lms):
    """A one-token prompt has nothing to prefill (its recurrent state starts empty): alone in the
    scalar loop, preempted into a batch, and admitted into one."""
    lm = lms["q35"]
    arrivals = {0: [("one", [77], _params(0, 20))],
                2: [("w", PROMPTS[1], _params(1, 10)), ("one_b", [1500], _params(2, 8))]}
    run = drive(engine(lm, 0, speculative=True, num_draft_tokens=3), arrivals)
    assert check_solo(lm, run) == 0
    assert "preempt" in run.transitions()
