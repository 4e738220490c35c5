"""The embedded model's shipped EAGLE-3 head (gmlx/weights/default_model/eagle3, trained by
`gmlx_training.train_smollm2_eagle3 --model embedded`): found by `--drafter eagle3` without a path,
read through the public checkpoint loader, and exact — every stream equals its solo plain decode,
greedy and seeded, alone and in a batch — with drafts accepted."""

from engine_helpers import P, check_solo, drive
from gmlx import Engine, EngineConfig
from gmlx.drafters.select import shipped_eagle3
from gmlx.weights import EMBEDDED_EAGLE3

LM_WITHOUT_EOS = True  # budgets alone end these requests: see conftest.lm


def test_drafter_eagle3_takes_the_shipped_head_and_the_default_stays_the_assistant_head(lm):
    assert shipped_eagle3(lm) == (EMBEDDED_EAGLE3, False)
    assert (EMBEDDED_EAGLE3 / "model.safetensors").stat().st_size <= 4 << 20  # small: fp16, no LM head
    eng = Engine(lm, EngineConfig(drafter="eagle3"))
    assert eng.drafter.kind == "eagle3" and eng.lm.target.entering == (2, 4, 5)
    eng.close()
    eng = Engine(lm, EngineConfig())
    assert eng.drafter.kind == "assistant"  # config.json's speculative_drafter
    eng.close()


def test_streams_equal_plain_alone_and_batched_and_drafts_are_accepted(lm, prompts):
    eng = Engine(lm, EngineConfig(drafter="eagle3", width_cap=0))
    run = drive(eng, {0: [("alone", prompts[0], P(40))],
                      1: [("b", prompts[1], P(32, seed=2, t=0.8)), ("c", prompts[2], P(32)),
                          ("d", prompts[3], P(32, seed=4, t=0.8))]})
    check_solo(lm, run)
    recs = [s.result for s in run.streams.values()]
    drafted = sum(r.stats["num_drafted"] for r in recs)
    assert drafted > 0 and sum(r.stats["num_accepted"] for r in recs) / drafted > 0.2
    eng.close()
