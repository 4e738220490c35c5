"""Where the request's own context drafts better than SmolLM2's EAGLE-3 head, replayed offline on the
very answers (gmlx/drafters/context_lookup.py's numbers): greedy float32 answers to 12 code and 12
chat questions (bench_matrix's 4 a kind and the 8 of gmlx_training/replay_smollm2_eagle3.py; none
in the head's training), each read once by the target with the streams the head reads, so that at
every answer position both proposals are known: the head's first draft (teacher-forced, as its
trainer scores it) and prompt lookup's (the longest recurring suffix of 1-4 tokens, its most
recent occurrence, what followed it).

Printed and written (bench_results/<stamp>_context_lookup.json): per kind, the head's first-draft
agreement; per least suffix length m, how often a suffix of >= m tokens recurs, how often its next
token is the target's then, where it is right and the head wrong (and the reverse), and how many
tokens its continuation runs on. Then a simulated clock over the same answers: tokens per plain
step's time for the head's K = 1 every round, and for it with lookup rounds of L drafts where a
suffix of >= m recurs, at verify costs `--costs` (plain-step multiples of a 1..8-token forward;
default: measured here with probe.measure, SmolLM2 float32, 2026-12-06) plus `--overhead` a round.

Run: ``python benchmarks/replay_context_lookup.py [--max-tokens 128]``
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gmlx  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
import numpy as np

from gmlx import Engine, EngineConfig, SamplingParams
from gmlx.gguf.smollm2 import converted
from gmlx.machine import describe
from gmlx.models.loading import load
from gmlx.weights import SMOLLM2_EAGLE3
from gmlx_training.replay_smollm2_eagle3 import EXTRA_CHAT_ASKS, EXTRA_CODE_ASKS, head_model
from gmlx_training.smollm2_data import Taps, teacher_forced
from gmlx_training.train_smollm2_eagle3 import batch_of, unroll, windows

from bench_matrix import CHAT_ASKS, CODE_ASKS
from common import command_line, write_result

COSTS = (1.0, 1.08, 1.43, 1.43, 1.65, 1.85, 2.0, 2.17)  # forwards of 1..8 tokens / one token (probe.measure)


def answers(lm, max_tokens: int) -> dict[str, list[dict]]:
    """Per kind, per question: the prompt + greedy answer and the head's first draft at each position."""
    model, rows, to_sub = head_model(SMOLLM2_EAGLE3, lm)
    taps = Taps(lm.target, True)
    eng = Engine(lm, EngineConfig(speculative=False, prompt_cache_bytes=0))
    out = {}
    for kind, asks in (("code", CODE_ASKS + EXTRA_CODE_ASKS), ("chat", CHAT_ASKS + EXTRA_CHAT_ASKS)):
        out[kind] = []
        for q in asks:
            p = list(lm.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True))
            toks = p + list(eng.generate(p, SamplingParams(max_tokens=max_tokens, seed=0)).tokens)
            row = teacher_forced(lm.target, [toks], taps)[0]
            shard = {k: row[k] for k in ("tokens", "hidden", "argmax", "aux")}
            shard |= {"starts": np.array([0, len(toks)]), "prompt_len": np.array([len(p)])}
            b = batch_of(windows([shard], len(toks) + 8, 1, to_sub), np.arange(1))  # one window: position = index
            g1 = unroll(model, lm.target.embed_tokens, b, 1)[0]
            sub = np.array(mx.argmax(model.norm(g1) @ rows.T, axis=-1)[0])  # sync: offline scoring
            # the head at position t (token t+1 pending) drafts token t+2, in the draft vocabulary
            ok = [bool(to_sub[toks[t + 2]] >= 0 and sub[t] == to_sub[toks[t + 2]]) for t in range(len(toks) - 2)]
            out[kind].append({"tokens": toks, "prompt": len(p), "head_ok": ok})
    eng.close()
    return out


def lookup(ctx: list[int], n_min: int, n_max: int = 4) -> tuple[int, list[int]]:
    """(the longest recurring suffix's length, what followed its most recent occurrence)."""
    end = len(ctx)
    for n in range(min(n_max, end - 1), n_min - 1, -1):
        for s in range(end - n - 1, -1, -1):
            if ctx[s:s + n] == ctx[end - n:]:
                return n, ctx[s + n:]
    return 0, []


def positions(recs: list[dict]) -> dict:
    """Per least suffix length m: recurrence, rightness, against the head, run length."""
    n = head = 0
    by_m = {m: dict(recurs=0, right=0, right_head_wrong=0, wrong_head_right=0, run=0) for m in (1, 2, 3, 4)}
    for r in recs:
        toks = r["tokens"]
        for i in range(r["prompt"], len(toks) - 1):  # token i pending, token i+1 next
            head_ok = r["head_ok"][i - 1]
            m, cont = lookup(toks[:i + 1], 1)
            run = next((j for j, c in enumerate(cont) if i + 1 + j >= len(toks) or toks[i + 1 + j] != c), len(cont))
            n, head = n + 1, head + head_ok
            for least, s in by_m.items():
                if m >= least:
                    s["recurs"] += 1
                    s["right"] += run > 0
                    s["right_head_wrong"] += run > 0 and not head_ok
                    s["wrong_head_right"] += run == 0 and head_ok
                    s["run"] += run
    return {"positions": n, "head_first_draft": head / n,
            "by_least_suffix": {m: {"recurs": s["recurs"] / n, "right_when_recurs": s["right"] / max(1, s["recurs"]),
                                    "right_head_wrong": s["right_head_wrong"] / n,
                                    "wrong_head_right": s["wrong_head_right"] / n,
                                    "mean_run": s["run"] / max(1, s["recurs"])} for m, s in by_m.items()}}


def simulate(recs: list[dict], least: int | None, drafts: int, costs, overhead: float) -> float:
    """Tokens per plain step's time: the head K = 1 every round, or a lookup round of `drafts` where a
    suffix of >= `least` tokens recurs (None: never)."""
    tokens = time = 0.0
    for r in recs:
        toks, i = r["tokens"], r["prompt"]
        while i < len(toks) - 1:
            m, cont = lookup(toks[:i + 1], least) if least else (0, [])
            if m:
                k = min(drafts, len(toks) - 1 - i)
                d = (cont * drafts)[:k]  # a loop copies itself on (gmlx/drafters/ngram.py)
                a = next((j for j in range(k) if toks[i + 1 + j] != d[j]), k)
            else:
                k, a = 1, int(r["head_ok"][i - 1])
            time, tokens, i = time + costs[k] + overhead, tokens + a + 1, i + a + 1
    return tokens / time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--costs", type=float, nargs=8, default=list(COSTS), metavar="C")
    ap.add_argument("--overhead", type=float, default=0.04, help="a speculative round's host work, in plain steps")
    ap.add_argument("--out", type=Path, default=Path("bench_results"))
    a = ap.parse_args()
    data = answers(load(converted("float32")), a.max_tokens)
    result = {"machine": describe(), "command": command_line("replay_context_lookup.py", a), "kinds": {}}
    for kind, recs in data.items():
        cell = positions(recs)
        cell["simulated"] = {"head K=1": simulate(recs, None, 1, a.costs, a.overhead)} | {
            f"lookup m>={m} L={L}": simulate(recs, m, L, a.costs, a.overhead) for m in (2, 3, 4) for L in (1, 3, 7)}
        result["kinds"][kind] = cell
        print(kind, f"{cell['positions']} positions, head first draft {cell['head_first_draft']:.3f}")
        for m, s in cell["by_least_suffix"].items():
            print(f"  suffix >= {m}: recurs {s['recurs']:.3f}, right then {s['right_when_recurs']:.3f}, right where the"
                  f" head is wrong {s['right_head_wrong']:.3f}, wrong where it is right {s['wrong_head_right']:.3f},"
                  f" runs {s['mean_run']:.2f}")
        print("  simulated, tokens per plain step's time:", {k: round(v, 3) for k, v in cell["simulated"].items()})
    print(write_result(a.out, "context_lookup", result))


if __name__ == "__main__":
    main()
