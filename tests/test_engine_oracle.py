"""The engine's oracle: whatever the schedule, cap or switches, every request's tokens equal
its solo plain stream (docs/design.md §3: the stream depends only on model, prompt, params and seed).

Each case drives `Engine.step()` in this thread on a fixed arrival schedule, then compares every
stream with `run_scalar(..., speculative=False)` tie-aware (a divergence is only allowed where
the target's top-2 margin is below tolerance, and such ties must be rare). Each case also checks
that the schedule really exercised what it is meant to (preempt, gate, resume, drafting), so a
pass is never vacuous.
"""

import pytest

from engine_helpers import check_solo, drive, engine, solo, total_emitted, with_eos
from gmlx import Engine, EngineConfig, SamplingParams
from gmlx.config import Switches
from gmlx.engine.oracle import run_scalar
from doubles import visible_window
from numerics import compare_tokens, same_stream

LM_WITHOUT_EOS = True  # budgets (and cancels) alone end these requests: see conftest.lm


# label: (arrival step, prompt index, max_tokens)
SCHEDULES = {
    "together": [(0, 0, 14), (0, 1, 22), (0, 2, 30), (0, 3, 18)],
    "staggered": [(0, 4, 24), (2, 5, 16), (4, 6, 28), (6, 7, 12), (8, 8, 20)],
    # one long request, then waiters after a few scalar rounds: the preempt case
    "join_late": [(0, 9, 40), (4, 10, 14), (4, 11, 22), (4, 12, 18)],
    # bursts mid-run, eight requests in all
    "bursts": [(0, 13, 30), (3, 14, 12), (3, 15, 20), (6, 16, 16), (10, 17, 14), (10, 18, 24), (10, 19, 12),
               (10, 20, 18)],
}

def params_for(i: int, max_tokens: int, temp: str) -> SamplingParams:
    """Per-request params: greedy, T = 0.8 with top-p 0.95, or a mix with different seeds/temperatures."""
    if temp == "greedy":
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, seed=i)
    if temp == "t08":
        return SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.95, seed=1000 + i)
    kind = i % 3  # "mixed"
    if kind == 0:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, seed=i)
    if kind == 1:
        return SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.95, seed=2000 + i)
    return SamplingParams(max_tokens=max_tokens, temperature=1.1, top_k=30, seed=3000 + 7 * i)


def arrivals_for(prompts, schedule: str, temp: str):
    arr = {}
    for i, (at, p, n) in enumerate(SCHEDULES[schedule]):
        arr.setdefault(at, []).append((i, prompts[p], params_for(i, n, temp)))
    return arr


def check_run(lm, run, cap: int):
    ties = check_solo(lm, run)
    assert ties <= 1, f"{ties} tie divergences in {len(run.streams)} requests: ties must be rare"
    for label, stream in run.streams.items():
        rec = stream.wait(1)
        # the per-round events account for every token exactly once
        assert total_emitted(run, label) == len(rec.tokens) == rec.stats["num_generated"]
        assert len(rec.tokens) <= run.reqs[label].params.max_tokens
    for _, e in run.rounds():
        if e.round == "speculative" and cap:
            assert e.width <= cap, f"a batch of width {e.width} drafted over cap {cap}"
        if e.round in ("plain", "plain_last", "capture"):
            assert all(d == 0 for _, d, _, _ in e.rows), "a plain or capture round drafted"
        if e.round == "capture":
            assert all(n <= 1 for *_, n in e.rows)
    return ties


def expected_transitions(run, schedule: str, cap: int, preempt: bool, resume: bool):
    """The schedule really exercised its transitions (guards against vacuous passes)."""
    tr = run.transitions()
    kinds = [e.round for _, e in run.rounds()]
    assert tr[0] == "start_scalar" or (tr[0] == "form_batch" and schedule == "together")
    if schedule in ("join_late", "bursts", "staggered"):
        assert ("preempt" in tr) == preempt, tr
    if "preempt" not in tr and schedule != "together":
        assert "form_batch" in tr
    if cap == 1:
        assert "gate" in tr
    if cap == 0:
        assert "gate" not in tr and "speculative" in kinds
    if not resume:
        assert "resume" not in tr
        # no resume: nothing after a gate may capture (preempt-within-cap captures happen before it)
        first_gate = tr.index("gate") if "gate" in tr else len(tr)
        assert "capture" not in tr[first_gate:], tr


BASE = [(s, c) for s in SCHEDULES for c in (0, 1, 2, 4)]


@pytest.mark.parametrize("schedule,cap", BASE, ids=[f"{s}-cap{c}" for s, c in BASE])
def test_schedules_mixed_sampling(lm, prompts, schedule, cap):
    run = drive(engine(lm, cap), arrivals_for(prompts, schedule, "mixed"))
    check_run(lm, run, cap)
    expected_transitions(run, schedule, cap, True, True)


SWITCHES = [(s, c, p, r) for s in ("join_late", "bursts") for c in (1, 2) for p, r in
            ((False, True), (True, False), (False, False))]


@pytest.mark.parametrize("schedule,cap,preempt,resume", SWITCHES,
                         ids=[f"{s}-cap{c}-P{int(p)}R{int(r)}" for s, c, p, r in SWITCHES])
def test_switches(lm, prompts, schedule, cap, preempt, resume):
    run = drive(engine(lm, cap, preempt=preempt, resume=resume), arrivals_for(prompts, schedule, "mixed"))
    check_run(lm, run, cap)
    expected_transitions(run, schedule, cap, preempt, resume)


TEMP_CASES = [("together", 2, "greedy"), ("join_late", 2, "greedy"), ("bursts", 4, "greedy"),
              ("together", 0, "t08"), ("join_late", 1, "t08"), ("bursts", 2, "t08")]


@pytest.mark.parametrize("schedule,cap,temp", TEMP_CASES, ids=[f"{s}-cap{c}-{t}" for s, c, t in TEMP_CASES])
def test_uniform_sampling(lm, prompts, schedule, cap, temp):
    run = drive(engine(lm, cap), arrivals_for(prompts, schedule, temp))
    check_run(lm, run, cap)
    expected_transitions(run, schedule, cap, True, True)


@pytest.mark.parametrize("cap", [0, 2])
def test_one_token_prompt_in_batch(lm, prompts, cap):
    """A one-token prompt has no prefill and nothing to teacher-force the drafter on: it must still
    decode its solo stream, whether it forms the batch, joins an armed batch or joins a gated one."""
    one = lm.tokenizer.encode("def")[:1]
    p = lambda i, n, t=0.0: SamplingParams(max_tokens=n, temperature=t, top_p=0.95, seed=40 + i)
    arrivals = {
        0: [("one_a", one, p(0, 16)), ("b", prompts[21], p(1, 20, 0.8))],
        3: [("one_c", one, p(2, 18, 0.8)), ("d", prompts[22], p(3, 12))],
        6: [("one_e", [prompts[23][0]], p(4, 14))],
    }
    run = drive(engine(lm, cap), arrivals)
    check_run(lm, run, cap)
    if cap == 0:
        assert any(e.round == "speculative" for _, e in run.rounds())
    # a batch made of one-token prompts only (no KV at all before its first round)
    run = drive(engine(lm, cap), {0: [("f", one, p(5, 10)), ("g", [prompts[24][0]], p(6, 9, 0.8))],
                                  2: [("h", [prompts[25][0]], p(7, 8))]})
    check_run(lm, run, cap)


def test_env_cap_flipped_between_rounds(lm, prompts, monkeypatch):
    """GMLX_MTP_WIDTH_CAP is re-read every round (width_cap=None): flipping it live gates and
    re-arms the batch, and no stream changes."""
    caps = [0, 1, 3, 2, 1, 0, 4, 1, 2]
    seen = []

    def flip(run):
        cap = caps[(run.step_no // 3) % len(caps)]
        monkeypatch.setenv("GMLX_MTP_WIDTH_CAP", str(cap))
        seen.append(cap)

    # resume_min_remaining=2: re-arm often in a short run
    eng = Engine(lm, EngineConfig(width_cap=None, resume_min_remaining=2), switches=Switches(preempt=True, resume=True))
    run = drive(eng, arrivals_for(prompts, "bursts", "mixed"), before_step=flip)
    check_solo(lm, run)
    tr = run.transitions()
    assert tr.count("gate") >= 2 and tr.count("resume") >= 1, tr
    for (step, e) in run.rounds():
        cap = seen[step]
        if e.round == "speculative":
            assert cap == 0 or e.width <= cap, (step, cap, e.width)


@pytest.mark.parametrize("k", [1, 5])
def test_other_draft_lengths(lm, prompts, k):
    """The batch loop's per-row rollback with k = 1 (no head entries to trim) and k = 5."""
    run = drive(engine(lm, 0, num_draft_tokens=k), arrivals_for(prompts, "join_late", "mixed"))
    check_run(lm, run, 0)
    assert any(e.round == "speculative" and all(d == k for _, d, _, _ in e.rows) for _, e in run.rounds())


def test_stop_strings_inside_a_batch(lm, prompts):
    """A stop string ends a batched row at the token that completes it (the text cut as solo),
    while the rows around it go on; budgets and stops are decided by the same emission code."""
    base = SamplingParams(max_tokens=40, seed=7)
    solo_row = run_scalar(lm, prompts[24], base, speculative=False)
    solo_text = solo_row.text
    stop = visible_window(solo_text, len(solo_text) // 3)
    assert stop.strip(), "fixture text too short"
    sp = SamplingParams(max_tokens=40, seed=7, stop=(stop,))
    ref = run_scalar(lm, prompts[24], sp, speculative=False)
    for cap in (0, 1):
        arrivals = {0: [("x", prompts[25], SamplingParams(max_tokens=30, seed=1))],
                    2: [("s", prompts[24], sp),
                        ("y", prompts[26], SamplingParams(max_tokens=20, temperature=0.8, seed=2))]}
        run = drive(engine(lm, cap), arrivals)
        check_solo(lm, run)
        rec = run.streams["s"].wait(1)
        if same_stream(lm, prompts[24], ref.tokens, rec.tokens, sp).equal:  # else a near-tie
            assert rec.finish_reason == "stop" and rec.text == ref.text and len(rec.tokens) < 40
        assert stop not in rec.text
        text = "".join(p.text for p in run.streams["s"])  # the streamed pieces add up to the final text
        assert text == rec.text


def random_case(prompts, seed: int, max_tokens=(12, 40)):
    import random

    rng = random.Random(seed)
    n = rng.randint(1, 8)
    cap = rng.choice([0, 1, 2, 3, 4])
    preempt, resume = rng.random() < 0.75, rng.random() < 0.75
    arrivals = {}
    for i in range(n):
        at = 0 if i == 0 else rng.choice([0, 1, 2, 3, 5, 8, 12, 16])
        t = rng.choice([0.0, 0.0, 0.8, 1.0])
        sp = SamplingParams(max_tokens=rng.randint(*max_tokens), temperature=t, top_p=0.95 if t else 1.0,
                            top_k=rng.choice([0, 20]), seed=rng.randrange(1 << 20))
        prompt = prompts[rng.randrange(len(prompts))][: rng.randint(1, 64)]
        arrivals.setdefault(at, []).append((i, prompt, sp))
    return cap, preempt, resume, arrivals


@pytest.mark.parametrize("seed", range(10))
def test_random_schedules(lm, prompts, seed):
    cap, preempt, resume, arrivals = random_case(prompts, seed)
    run = drive(engine(lm, cap, preempt=preempt, resume=resume), arrivals)
    check_run(lm, run, cap)
    if not resume:
        assert "resume" not in run.transitions()
    if not preempt:
        assert "preempt" not in run.transitions()


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(100, 160))
def test_random_schedules_long(lm, prompts, seed):
    cap, preempt, resume, arrivals = random_case(prompts, seed, max_tokens=(16, 96))
    run = drive(engine(lm, cap, preempt=preempt, resume=resume), arrivals)
    check_run(lm, run, cap)


@pytest.mark.parametrize("schedule", ["together", "bursts"])
def test_speculation_off(lm, prompts, schedule):
    """EngineConfig(speculative=False): the plain code path everywhere (no drafting, no capture)."""
    run = drive(engine(lm, 0, speculative=False), arrivals_for(prompts, schedule, "mixed"))
    check_run(lm, run, 0)
    assert {e.round for _, e in run.rounds()} <= {"scalar", "scalar_last", "plain", "plain_last"}
    assert all(d == 0 for _, e in run.rounds() for _, d, _, _ in e.rows)
    assert "capture" not in run.transitions() and "gate" not in run.transitions()


@pytest.mark.parametrize("cap", [0, 1])
def test_eos_inside_a_batch(lm, prompts, cap):
    """EOS ends a batched row without being emitted, mid speculative round or in a gated round,
    while the other rows go on (the EOS id is chosen from a's solo stream so that it does occur)."""
    sp_a = SamplingParams(max_tokens=40, temperature=0.8, top_p=0.95, seed=11)
    ref = solo(lm, prompts[28], sp_a)
    eos = ref[len(ref) // 2]
    lm2 = with_eos(lm, {eos})
    cut = solo(lm2, prompts[28], sp_a)
    assert len(cut) < 40 and cut == ref[: ref.index(eos)]
    arrivals = {0: [("x", prompts[29], SamplingParams(max_tokens=30, seed=1))],
                2: [("a", prompts[28], sp_a),
                    ("y", prompts[30], SamplingParams(max_tokens=24, temperature=0.8, seed=2))]}
    run = drive(engine(lm2, cap), arrivals)
    check_solo(lm2, run)
    rec = run.streams["a"].wait(1)
    if same_stream(lm2, prompts[28], cut, rec.tokens, sp_a).equal:  # else a near-tie
        assert rec.finish_reason == "stop"


def test_engine_thread_with_concurrent_submitters(lm, prompts):
    """The same oracle through the engine's own thread, with requests submitted from several
    threads at unpredictable times: the timing changes the schedule, never the streams."""
    import threading
    import time

    eng = Engine(lm, EngineConfig(width_cap=2), switches=Switches(preempt=True, resume=True))
    reqs = [(prompts[27 + i], params_for(i, 10 + 4 * i, "mixed")) for i in range(6)]
    streams = [None] * len(reqs)

    def worker(idx):
        for i in idx:
            time.sleep(0.02 * i)
            streams[i] = eng.submit(reqs[i][0], reqs[i][1])

    threads = [threading.Thread(target=worker, args=(range(j, len(reqs), 3),)) for j in range(3)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for (prompt, sp), s in zip(reqs, streams):
            pieces = [p.token for p in s if p.token >= 0]
            rec = s.wait(60)
            assert pieces == rec.tokens  # the streamed tokens are the final record's
            c = compare_tokens(lm, prompt, solo(lm, prompt, sp), rec.tokens, sp)
            assert c.ok, c
    finally:
        eng.close()
