"""Live acceptance against held-out acceptance, on the very same streams: is the gap between the
EAGLE-3 head's held-out figures (the trainer's `agreement`) and what it accepts live a bug in the
live path or a harder set of questions?

For each of bench_matrix.py's questions (code and chat; none in the training data), SmolLM2 float32
answers greedily with the head drafting K = 3 every round (accepted drafts per round, live); then the
same prompt + answer is read by the target once (`smollm2_data.teacher_forced`, with the streams the
head reads) and scored as held-out data is (`train_smollm2_eagle3.agreement`: mean accepted drafts of
a 3-chain over the answer's positions). Then what a tree could add on the same positions
(`coverage`): how often the target's token is among the head's top k at t+2 (a depth-1 tree of k
branches accepts its first draft that often), and how often t+3 agrees once t+2 did (what a chain's
second draft adds).

Run: ``python -m gmlx_training.replay_smollm2_eagle3 [--head DIR] [--max-tokens 96] [--extended]``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gmlx import blas

blas.ensure_loaded()

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from gmlx import Engine, EngineConfig, SamplingParams  # noqa: E402
from gmlx.config import Switches  # noqa: E402
from gmlx.gguf.smollm2 import converted  # noqa: E402
from gmlx.heads.eagle3_checkpoint import load_eagle3_head  # noqa: E402
from gmlx.models.loading import load  # noqa: E402
from gmlx.weights import SMOLLM2_EAGLE3  # noqa: E402
from gmlx_training.smollm2_data import Taps, teacher_forced  # noqa: E402
from gmlx_training.train_smollm2_eagle3 import agreement, batch_of, unroll, windows  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_matrix import CHAT_ASKS, CODE_ASKS  # noqa: E402

# `--extended`: 8 more questions of each kind beside bench_matrix's 4, so that a head is judged on more than
# 4 answers a kind (the fourth and sixth runs' live verdicts rested on 4 x 96 tokens). Like those, none is
# in the training prompts: no topic, concept, task or question of gmlx_training/smollm2_prompts.py and
# chat_topics.py occurs in them (tests/test_training_prompts.py checks it).
EXTRA_CODE_ASKS = ["Write a Python function that rotates a list by k positions.",
                   "Write a Python function that returns the longest word in a sentence.",
                   "Write a Python class for a simple to-do list with add and remove methods.",
                   "Write a Python function that checks whether a year is a leap year.",
                   "Write a Python function that returns the sum of the digits of a number.",
                   "Write a Python function that finds the missing number in a list of 1 to n.",
                   "Write a Python class for a rectangle with area and perimeter methods.",
                   "Write a Python function that capitalizes the first letter of every word in a string."]
EXTRA_CHAT_ASKS = ["How do hot air balloons fly?", "Why do onions make people cry?", "What causes the northern lights?",
                   "How do submarines dive and come back up?", "Why do we get goosebumps?",
                   "What is the difference between a frog and a toad?",
                   "How do camels survive without water for so long?", "What makes popcorn pop?"]


def head_model(head: Path, lm):
    """The checkpoint as gmlx loads it for drafting (`load_eagle3_head`), in float32 as the trainer
    scores it: (its module, its LM-head rows, target id -> draft id)."""
    bound = load_eagle3_head(head, lm).head
    model = bound.module
    model.set_dtype(mx.float32, lambda d: mx.issubdtype(d, mx.floating))
    ids = np.array(bound.ids)  # sync: once, the draft vocabulary's target ids
    to_sub = np.full(lm.target.vocab_size, -1, dtype=np.int32)
    to_sub[ids] = np.arange(len(ids), dtype=np.int32)
    return model, bound.rows.astype(mx.float32), to_sub


def coverage(model, embed, rows, val: dict, ks: tuple[int, ...] = (1, 2, 4, 8), chunk: int = 8) -> dict:
    """Teacher-forced, answer positions only: the share where the target's greedy token is among the
    head's top k at t+2 (`top{k}`), and where t+3 agrees given that t+2 did (`t3_given_t2`)."""
    hits = dict.fromkeys(ks, 0.0)
    n = first = second = 0.0
    for i in range(0, len(val["x"]), chunk):
        b = batch_of(val, np.arange(i, min(i + chunk, len(val["x"]))))
        g1, g2 = unroll(model, embed, b, 2)
        S = g1.shape[1]
        lab1, lab2 = b["a"][:, 1 : 1 + S], b["a"][:, 2 : 2 + S]
        mask = b["valid"][:, 1 : 1 + S] * b["ans"]
        order = mx.argsort(-(model.norm(g1) @ rows.T), axis=-1)[..., : max(ks)]
        for k in ks:
            hits[k] += ((order[..., :k] == lab1[..., None]).any(-1) * mask).sum().item()  # sync: eval metric
        right = mask * b["valid"][:, 2 : 2 + S] * (order[..., 0] == lab1)
        second += ((mx.argmax(model.norm(g2) @ rows.T, axis=-1) == lab2) * right).sum().item()  # sync: eval metric
        first += right.sum().item()  # sync: eval metric
        n += mask.sum().item()  # sync: eval metric
    return {**{f"top{k}": h / n for k, h in hits.items()}, "t3_given_t2": second / first if first else 0.0}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head", type=Path, default=SMOLLM2_EAGLE3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--extended", action="store_true", help="12 questions a kind instead of bench_matrix's 4")
    a = ap.parse_args(argv)
    lm = load(converted("float32"))
    target = lm.target
    model, rows, to_sub = head_model(a.head, lm)
    taps = Taps(target, True)
    eng = Engine(lm, EngineConfig(drafter="eagle3", draft_model=str(a.head), num_draft_tokens=3, width_cap=0,
                                  prompt_cache_bytes=0), switches=Switches(control=False))
    more = (EXTRA_CODE_ASKS, EXTRA_CHAT_ASKS) if a.extended else ([], [])
    for kind, asks in (("code", CODE_ASKS + more[0]), ("chat", CHAT_ASKS + more[1])):
        accepted = rounds = 0
        replay = []
        for q in asks:
            p = list(lm.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True))
            r = eng.generate(p, SamplingParams(max_tokens=a.max_tokens, seed=0, ignore_eos=True))
            accepted, rounds = accepted + r.stats["num_accepted"], rounds + r.stats["num_rounds"]
            row = teacher_forced(target, [p + r.tokens], taps)[0]
            row["prompt_len"] = len(p)
            replay.append(row)
        shard = {k: np.concatenate([x[k] for x in replay]) for k in ("tokens", "hidden", "argmax", "aux")}
        shard |= {"starts": np.cumsum([0] + [len(x["tokens"]) for x in replay]),
                  "prompt_len": np.array([x["prompt_len"] for x in replay])}
        val = windows([shard], 128, 3, to_sub, [kind])
        ag = agreement(model, target.embed_tokens, rows, val, 3)
        print(f"{kind}: live {accepted / rounds:.3f} accepted drafts per round ({rounds} rounds, K = 3); held-out"
              f" scoring of the same answers {ag['accept_answer']:.3f}; agreement at t+2..t+4"
              f" {ag['t2']:.3f} {ag['t3']:.3f} {ag['t4']:.3f}", flush=True)
        cov = coverage(model, target.embed_tokens, rows, val)
        print(f"{kind}: the target's token among the head's top 1 / 2 / 4 / 8 at t+2 (answers)"
              f" {cov['top1']:.3f} / {cov['top2']:.3f} / {cov['top4']:.3f} / {cov['top8']:.3f};"
              f" t+3 agrees given t+2 did {cov['t3_given_t2']:.3f}", flush=True)
    eng.close()


if __name__ == "__main__":
    main()
