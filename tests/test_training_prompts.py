"""SmolLM2's drafter data prompts (gmlx_training/smollm2_prompts.py, chat_topics.py): the general
chat prompts widen the chat side without touching what earlier runs used, and the matrix
benchmark's own questions stay held out of training."""

from __future__ import annotations

import ast
from pathlib import Path

from gmlx_training import chat_topics, self_ask
from gmlx_training.smollm2_prompts import build

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_matrix.py"


def _lists(path: Path, names: tuple[str, ...]) -> list[str]:
    """The string lists a module assigns to `names` (read, not imported: those modules load models)."""
    tree = ast.parse(path.read_text())
    return [s for node in tree.body if isinstance(node, ast.Assign)
            and getattr(node.targets[0], "id", "") in names for s in ast.literal_eval(node.value)]


def _bench_asks() -> list[str]:
    """CHAT_ASKS and CODE_ASKS as bench_matrix.py defines them."""
    return _lists(BENCH, ("CHAT_ASKS", "CODE_ASKS"))


def test_general_prompts_add_to_the_chat_side():
    old, new = build(3, 40), build(3, 40, general=True)
    assert new["train"]["code"] == old["train"]["code"]
    assert set(old["train"]["chat"]) < set(new["train"]["chat"])  # everything earlier runs asked, and more
    added = set(new["train"]["chat"]) - set(old["train"]["chat"])
    held = set(new["val"]["chat"]) - set(old["val"]["chat"])
    assert len(added) > 300 and held and not added & held  # every 10th goes to the held-out split


def test_the_benchmark_questions_are_held_out():
    asks = _bench_asks()
    assert len(asks) == 8
    data = build(0, 40, general=True)
    prompts = {p for split in data.values() for kind in split.values() for p in kind}
    assert not prompts & set(asks)
    words = ("vaccin", "exercise", "rainbow", "leaves")  # the chat asks' subjects
    assert not [p for p in chat_topics.general(__import__("random").Random(1)) if any(w in p.lower() for w in words)]


def test_self_asked_questions_are_cleaned_and_keep_the_benchmark_held_out():
    """The model's reply to a meta-prompt gives its question (quoted, or the first question or
    request) without labels, framing or numbering; one on the benchmark's subjects (or too short
    to be a question) is dropped."""
    assert self_ask.question('\n**Question:** "How do owls see at night?"\nThey have...') == "How do owls see at night?"
    assert self_ask.question("1. Write a function that reverses a list of words.") == \
        "Write a function that reverses a list of words."
    assert self_ask.question("A programmer might ask: What is a generator in Python?") == "What is a generator in Python?"
    assert self_ask.question("Teacher: What is a castle made of?") == "What is a castle made of?"
    assert self_ask.question("Why?") is None and self_ask.question("") is None
    for ask in _bench_asks():  # each benchmark question, as the model might ask it
        assert self_ask.question(ask) is None, ask
    metas = self_ask.meta_prompts(__import__("random").Random(0), 40)
    assert metas == self_ask.meta_prompts(__import__("random").Random(0), 40) and len(set(metas)) > 30
    assert sum(m.startswith(tuple(a.split("{}")[0] for a in self_ask.CODE_ASK)) for m in metas) == 10


REPLAY = Path(__file__).resolve().parents[1] / "gmlx_training" / "replay_smollm2_eagle3.py"


def test_the_replays_extended_questions_are_held_out():
    """replay_smollm2_eagle3 --extended's 8 more questions a kind: none is a training prompt (for several
    seeds), and none names a subject, concept, task, topic or activity the training templates fill in."""
    from gmlx_training import smollm2_prompts

    extra = _lists(REPLAY, ("EXTRA_CODE_ASKS", "EXTRA_CHAT_ASKS"))
    assert len(extra) == 16 and not set(extra) & set(_bench_asks())
    for seed in (0, 7, 12):
        data = build(seed, 40, general=True)
        assert not {p for split in data.values() for kind in split.values() for p in kind} & set(extra)
    fills = [t.lower() for t in chat_topics.SUBJECTS + smollm2_prompts.CONCEPTS + smollm2_prompts.TASKS
             + smollm2_prompts.TOPICS + smollm2_prompts.ACTIVITIES]
    assert not [(q, t) for q in extra for t in fills if t in q.lower()]
    assert not {q.lower() for q in extra} & {q.lower() for q in chat_topics.QUESTIONS + chat_topics.ASKS}
