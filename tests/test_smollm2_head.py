"""The drafters gmlx ships for SmolLM2-135M-Instruct (gmlx/weights/smollm2/: an MTP head and an
EAGLE-3 head, the engine's default): found beside the conversion of the known GGUF file, exact
(greedy and seeded streams equal plain decoding, tie-aware), and really drafting (a fair share
of their drafts accepted)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from gmlx import Engine, EngineConfig, SamplingParams
from gmlx.config import Switches
from gmlx.policy import control
from gmlx.heads.draft_vocab import NEVER, BoundVocabMTPHead
from gmlx.gguf.smollm2 import EAGLE3_DIR, HEAD_DIR, shipped_eagle3_dir, shipped_head_dir
from gmlx.engine.oracle import compare_streams

CHAT = "Write a Python function that checks whether a number is even."


def test_the_shipped_head_loads_with_the_conversion(smollm2):
    lm = smollm2.load("float32")
    assert shipped_head_dir(lm.path) == HEAD_DIR
    assert lm.drafter_kind == "mtp" and isinstance(lm.head, BoundVocabMTPHead)
    assert (HEAD_DIR / "mtp_head.safetensors").stat().st_size <= 10 << 20
    g = mx.random.normal((1, 2, lm.target.hidden_size))
    full, sub = lm.head.logits(g), lm.head.sub_logits(g)
    assert full.shape == (1, 2, lm.target.vocab_size)
    # Outside the draft vocabulary nothing is ever drafted; inside, the logits are the target's rows.
    ids = np.array(lm.head.ids)
    outside = np.setdiff1d(np.arange(lm.target.vocab_size), ids)[:100]
    assert (np.array(full)[..., outside] == NEVER).all()
    ref = lm.target.lm_head(g)[..., mx.array(ids)]
    assert mx.allclose(sub, ref, atol=1e-3, rtol=1e-4).item()
    assert np.isin(np.array(mx.argmax(full, axis=-1)), ids).all()


def test_a_directory_not_from_the_known_file_gets_no_head(tmp_path):
    assert shipped_head_dir(tmp_path) is None and shipped_eagle3_dir(tmp_path) is None


def test_the_engine_drafts_with_the_eagle3_head_by_default(smollm2):
    """No drafter asked for (and `--drafter eagle3` without a path): the shipped EAGLE-3 head, read
    through its checkpoint loader; `--drafter mtp` keeps the MTP head; no speculation, no head."""
    lm = smollm2.load("q")
    assert shipped_eagle3_dir(lm.path) == EAGLE3_DIR
    assert (EAGLE3_DIR / "model.safetensors").stat().st_size <= 12 << 20
    for config in (EngineConfig(), EngineConfig(drafter="eagle3")):
        eng = Engine(lm, config)
        assert eng.drafter.kind == "eagle3" and eng.lm.target.entering == (2, 15, 27)
        eng.close()
    eng = Engine(lm, EngineConfig(drafter="mtp"))
    assert eng.drafter.kind == "mtp" and eng.lm is lm
    eng.close()
    assert Engine(lm, EngineConfig(speculative=False)).drafter is None


def test_engines_through_the_eagle3_view_share_what_the_control_learnt(smollm2):
    """Each engine with the EAGLE-3 head sees the target through a new view; the online control
    still files its figures under the one target, so the next engine (the next bench cell, a
    plain baseline's rounds) continues from them instead of exploring again from nothing."""
    lm = smollm2.load("q")
    control.forget(lm.target)
    on = Switches(control=True)
    first, second = (Engine(lm, EngineConfig(), switches=on) for _ in range(2))
    assert first.lm.target is not second.lm.target  # two views ...
    assert first.spec.control.at(3) is second.spec.control.at(3)  # ... one set of figures
    control.record_plain(lm.target, 3, 0.004)  # what a plain engine on the model records
    assert first.spec.control.at(3).plain.by_k[0][-1] == 0.004
    for eng in (first, second):
        eng.close()
    control.forget(lm.target)


def test_engines_through_the_eagle3_view_share_one_cost_probe(smollm2, monkeypatch):
    """The load probe's figures are filed under the target too: the second engine with the head
    (the next bench run, the next `Engine()`) does not measure again — a probe is ~1.2 s of
    SmolLM2's first speculative round, which every bench run of every speculative arm paid."""
    from gmlx.decode import probe
    from gmlx.policy.costs import Costs

    monkeypatch.delenv("GMLX_ROUND_COSTS", raising=False)  # the suite pins the prior: measure here
    lm = smollm2.load("q")
    calls = []
    monkeypatch.setattr(probe, "measure", lambda *a, **k: calls.append(a) or Costs((1.0, 1.1, 1.2, 1.3), 0.05))
    engines = [Engine(lm, EngineConfig()) for _ in range(2)]
    assert engines[0].lm.target is not engines[1].lm.target
    costs = [probe.round_costs(e.lm.target, e.drafter, 3) for e in engines]
    assert len(calls) <= 1 and costs[0] is costs[1]
    for eng in engines:
        eng.close()


@pytest.mark.parametrize("dtype, n_prompts, kind", [
    ("q", 1, "eagle3"),  # what `--model smollm2` loads: the file's 4-bit blocks (verify through the twin)
    ("q", 1, "mtp"),
    pytest.param("float32", 2, "eagle3", marks=pytest.mark.slow),  # code and chat, fp32
    pytest.param("float32", 2, "mtp", marks=pytest.mark.slow),
])
def test_streams_equal_plain_and_drafts_are_accepted(smollm2, dtype, n_prompts, kind):
    """Greedy and seeded T=0.8 streams with each head equal plain decoding; greedy drafts are accepted."""
    lm = smollm2.load(dtype)
    tok = lm.tokenizer
    prompts = [tok.encode("def fibonacci(n):\n"),
               list(tok.apply_chat_template([{"role": "user", "content": CHAT}], add_generation_prompt=True))]
    plain, spec = Engine(lm, EngineConfig(speculative=False)), Engine(lm, EngineConfig(speculative=True, drafter=kind))
    assert spec.drafter is not None and spec.drafter.kind == kind
    assert lm.target.hidden_size == 576  # not the packed width of a quantized embedding (144 words)
    drafted = accepted = 0
    for prompt in prompts[:n_prompts]:
        for params in (SamplingParams(max_tokens=14, temperature=0.0, seed=0),
                       SamplingParams(max_tokens=14, temperature=0.8, seed=3)):
            ref, got = plain.generate(prompt, params), spec.generate(prompt, params)
            c = compare_streams(lm, prompt, ref.tokens, got.tokens, params)
            assert c.ok, (dtype, params.temperature, c, ref.tokens, got.tokens)
            if params.temperature == 0:
                drafted += got.stats["num_drafted"]
                accepted += got.stats["num_accepted"]
    plain.close()
    spec.close()
    assert drafted > 0 and accepted / drafted > 0.2, (dtype, accepted, drafted)


@pytest.mark.parametrize("kind", [None, pytest.param("mtp", marks=pytest.mark.slow)])
def test_schedule_through_every_transition_equals_solo(smollm2, kind):
    """The real model with its shipped heads (None: the default, EAGLE-3) through scalar -> preempt -> batch -> gate (a third
    row over cap 2) -> resume -> capture, greedy and seeded: every stream equals its solo plain
    decode (tie-aware)."""
    from engine_helpers import P, check_solo, drive, engine

    lm = smollm2.load("float32")
    tok = lm.tokenizer
    code = tok.encode("def fibonacci(n):\n")
    chat = list(tok.apply_chat_template([{"role": "user", "content": CHAT}], add_generation_prompt=True))
    eng = engine(lm, 2, resume_min_remaining=2, num_draft_tokens=3, drafter=kind)
    # "a" long enough to outlast the gate however much its head accepts while it runs alone and in the
    # batch (18 tokens did until the fifth EAGLE-3 run accepted more: it then finished before a resume).
    run = drive(eng, {0: [("a", code, P(40, seed=1))], 3: [("b", chat, P(6, seed=2, t=0.8))],
                      5: [("c", code[:4], P(5, seed=3))]})
    check_solo(lm, run)
    tr = run.transitions()
    assert {"preempt", "gate", "resume"} <= set(tr), tr
    eng.close()
