"""Questions SmolLM2 asks itself, for its drafter's data (`smollm2_data --self-ask N`).

Why: the EAGLE-3 head accepts fewer drafts live than held out — replaying the engine's own greedy
answers to bench_matrix's questions (`replay_smollm2_eagle3`), the fifth head accepted 0.44 drafts a
round on chat against 0.64 on the held-out split — and scoring the live streams the held-out way
gives the live figure, so the drafting path loses nothing: the held-out questions come from the
same templates as training (smollm2_prompts.py, chat_topics.py) and the benchmark's do not. Here the
model writes the questions (sampled, T = 0.7, from a few meta-prompts over the subjects of those
lists and some programming topics): phrasing and subject vary beyond the templates, and stay the
kind of text the model reads and writes.

Pure text: the caller generates (`smollm2_data.generate`) and keeps what `question` accepts.
bench_matrix's questions stay held out (`HELD_OUT`: their subjects; tests/test_training_prompts.py).
"""

from __future__ import annotations

import random
import re

from gmlx_training import chat_topics, smollm2_prompts

ASK = [
    "Write one question that a curious person might ask about {}. Reply with the question only.",
    "Write a question a student might ask a teacher about {}. Reply with the question only.",
    "Think of something a person might want to know about {}. Write it as one short question.",
    "Write one request that someone might give a helpful assistant about {}. Reply with the request only.",
]
CODE_ASK = [
    "Write one short programming task about {} that a beginner might ask for help with. Reply with the task only.",
    "Write a question a programmer might ask about {} in Python. Reply with the question only.",
]
CODE_SUBJECTS = [
    "strings", "lists", "dictionaries", "reading files", "sorting", "numbers", "dates and times", "classes",
    "recursion", "loops", "sets", "JSON", "regular expressions", "text processing", "matrices", "error handling",
    "command-line arguments", "random numbers", "web requests", "unit tests", "tuples", "generators", "queues",
]
# bench_matrix's CHAT_ASKS and CODE_ASKS, by subject: a self-asked question on them is dropped.
HELD_OUT = ("vaccin", "exercis", "rainbow", "leaves", "autumn", "second largest", "bank account", "chunk",
            "each character", "character count", "count the character")


def meta_prompts(rng: random.Random, n: int) -> list[str]:
    """n meta-prompts, a quarter of them for programming tasks."""
    general = (chat_topics.SUBJECTS + smollm2_prompts.CONCEPTS + smollm2_prompts.TOPICS
               + smollm2_prompts.ACTIVITIES)
    out = []
    for i in range(n):
        if i % 4 == 3:
            out.append(rng.choice(CODE_ASK).format(rng.choice(CODE_SUBJECTS)))
        else:
            out.append(rng.choice(ASK).format(rng.choice(general)))
    return out


VERBS = ("Write", "Explain", "Describe", "Give", "List", "Create", "Implement", "Show", "Tell", "Help", "Compare")


def question(reply: str) -> str | None:
    """The question (or request) in a model's reply to a meta-prompt: a quoted question if there
    is one (a 135M model often frames it: 'A curious person might ask: "..."'), else the first
    sentence that is one (ends with "?", or starts with an imperative and ends with "."), without a
    label or numbering; None when there is none, it is short or long, or on a held-out subject."""
    text = " ".join(x.strip() for x in reply.splitlines() if x.strip())
    text = re.sub(r"(\*\*)?\b(question|request|task)\s*\d*\s*:(\*\*)?", " ", text, flags=re.I)
    quoted = re.findall(r"[\"“]([A-Z][^\"”]{10,240}\?)[\"”]", text)
    if quoted:
        line = quoted[0]
    else:
        sentences = re.findall(r"(?:^|(?<=[.!?:]\s))(?:\d+[.)]\s*)?([A-Z][^.!?]*[.?])", text)
        line = next((x for x in sentences if x.endswith("?") or x.startswith(VERBS)), "")
    line = re.sub(r"^[^.?!]{0,40}\b(might|may|would|could|can) ask,?:?\s*", "", line.strip())
    line = re.sub(r"^(teacher|student|professor|q|a)\s*:\s*", "", line, flags=re.I).strip()
    if not 12 <= len(line) <= 240 or not re.search(r"[A-Za-z]{3}", line):
        return None
    if any(w in line.lower() for w in HELD_OUT):
        return None
    return line
