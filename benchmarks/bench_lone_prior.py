"""A lone request's control (or, with --concurrency c, a batch's), variants side by side: code
and chat requests alternating in one process, one (or c) at a time, as shipped (the online control
on) with one rule of the control changed per variant, beside plain and, optionally, fixed K = 1.
Every control variant shares the one pool (the control's figures are kept per target), so they
differ only in the rule.

Variants (`--variants`):
- light / heavy: a new request's own acceptance estimate starts from the pool's rates worth
  LONE_PRIOR_ROUNDS rounds (light, shipped) or at the pool's full weight (heavy, ~33 rounds at
  DECAY: gmlx before 20ea531) — gmlx/policy/figures.py.
- noretry: a K measured once is not measured again when stale (RETRY_AFTER out of reach) —
  gmlx/policy/width_control.py. (A first-rounds rule — a lone request's first 8 rounds at K = 1,
  tried even when plain was in force — ran here as first / nofirst / caponly at 59066af, three
  runs, and was reverted: no effect beyond the noise.)
- notries: a lone request tries no untried (or stale) deeper K on its hope (its deeper drafts
  credited as always agreeing): LONE_TRY_WITHIN infinite, deeper K's run only when predicted best.
- notry / ceil1notry: no K = 1 try for a new lone request where plain is in force (LONE_TRY off:
  gmlx before d7463a1), alone or with ceil1's ceiling. (A hold rule — K = 1 kept while predicted
  at least 1.0x, past STAY and the doubt — ran as `hold` at df7e1d8: code -1.6 %, chat +0.6 % per
  repeat; not kept.)
- ceil1: the control with one draft at most at width 1, as after `gmlx sweep-cap --write` here
  (it recommends "a lone request: K = 1" for SmolLM2 float32 on this CPU).
- k1 / k2 / k3: K = 1 (2, 3) every round, the control off (K = 1: the best fixed K on SmolLM2
  float32 at c = 1).
- norearm / sure: a lone request the control sends plain drops its drafter and decodes plain to
  its end, and a try stays only if its gain is sure (norearm: gmlx before thresholds.REARM_MIN and
  width_control.LONE_POINT); or it re-arms but the doubt is kept (sure).
- nosoon: a lone request sent plain at a gain near 1 (within its acceptance's standard error)
  waits out the exploration's back-off instead of trying again after EXPLORE_SOON rounds.
- (keepmargin, at 04c011a: a lone request's try kept at STAY once paired, not MARGIN; reverted:
  code -2 %, chat +0 %, 20261205T002446Z.)
- nolookup: the lone request never drafts from its own context (gmlx before
  gmlx/drafters/context_lookup.py, 2026-12-06 late); speconly: only while the control has it
  speculate (a request it has plain re-arms for no context round).
- nosteady: the lone request's cost ratios from the periods next to a plain / speculative boundary alone
  (gmlx before gmlx/policy/pairs.py's steady samples, 2026-12-07).
- off: the default drafter with the control off (the scalar lane's own rule: K per round from
  the request's acceptance and the load probe's costs).
- 2026-12-05: noshadow (no shadow rounds while plain: gmlx/decode/shadow.py), switchtimed (a scalar
  round that switches kind timed like any other), scaled (a lone request's tokens per round the
  width's scaled by its acceptance over the pool's), prior4 (its prior worth 4 rounds), within9 (it
  tries a deeper K whose hope is within 0.9 of the best, as a batch width does) — each the rule
  before that session's change (prior4: a lighter prior, not kept).
(A batch width's acceptance-shift reset — the pooled figures reset when its last 16 row-rounds'
acceptance sat 3 standard deviations off the pooled rate — ran as `noshift` at 73bbc36 with
--concurrency 2: no effect, and it never fired where chat requests followed code ones; reverted.)

Greedy, EOS ignored, c = 1 (each repeat: one code request, then one chat request, each arm; the
arm order alternates between repeats); with --concurrency c, each arm runs c code requests together,
then c chat requests. Speedups: medians of per-repeat ratios to plain, of the aggregate rate (first
submit to last end: prefill included) and of the decode after each request's first token ("decode":
what `gmlx generate` reports as a request's tokens/s; common.decode_rate).
`--fresh`: each arm's run is a kind's prompts in turn, one at a time, from nothing learnt (the
control's figures forgotten before the first: a fresh process), as bench_cpu_fused.py runs them.

Run: ``python benchmarks/bench_lone_prior.py --model smollm2-f32 --repeats 16 --max-tokens 48``
``... --concurrency 2 --variants light,k1`` (a batch of chat requests after one of code ones),
(light, heavy), ``... --variants noretry,k1``, ``... --variants light,ceil1,k1``,
``... --variants light,notry,ceil1,ceil1notry,k1``, ``... --fresh --variants light,notries,ceil1,k1``.
Writes bench_results/<utc>_lone_prior.json and .md (<utc>_batch_mixed.* with --concurrency above 1).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
from dataclasses import replace
from pathlib import Path
from unittest.mock import patch

import gmlx  # noqa: F401  (OpenBLAS before mlx)

from gmlx import EngineConfig
from gmlx.config import Switches
from gmlx.engine.cap_watch import CapWatch
from gmlx.engine.speculation import Speculation
from gmlx.machine import describe
from gmlx.decode import shadow
from gmlx.drafters.context_lookup import ContextLookup
from gmlx.drafters.prediction import PredictionDrafter
from gmlx.policy import control, thresholds, width_control

from bench_matrix import ARMS, model, prompt_sets
from common import command_line, ratio, run_burst, write_result


@contextlib.contextmanager
def _both(a, b):
    with a, b:
        yield


VARIANTS = {  # name: (what it is, the patch it runs under)
    "light": ("prior worth 8 rounds", lambda: patch.object(control, "LONE_PRIOR_ROUNDS", control.LONE_PRIOR_ROUNDS)),
    "heavy": ("prior at the pool's weight", lambda: patch.object(control, "LONE_PRIOR_ROUNDS", None)),
    "prior4": ("prior worth 4 rounds", lambda: patch.object(control, "LONE_PRIOR_ROUNDS", 4.0)),
    # K's other than the best are measured again once stale (RETRY_AFTER speculative rounds) when
    # their hope could win (TRY_WITHIN of the best): never, here (the first measurement stands)
    # a lone request tries an untried (or stale) K whose hope is within 0.9 of the best's gain, as a
    # batch width does (gmlx before thresholds.LONE_TRY_WITHIN), not only one whose hope reaches it
    "within9": ("lone tries within 0.9", lambda: patch.object(width_control, "LONE_TRY_WITHIN", 0.9)),
    # ... or none (deeper K's chosen on their prediction alone; measured 2026-12-06, not kept; shipped since
    # early dispatch, 2026-12-06 later: `tries6` is the rule before, its tries and a lone choice held 6 rounds)
    "notries": ("no lone tries on hope", lambda: patch.object(width_control, "LONE_TRY_WITHIN", float("inf"))),
    "tries3": ("lone tries on hope", lambda: patch.object(width_control, "LONE_TRY_WITHIN", 1.0)),
    "notries6": ("lone choices held 6 rounds", lambda: patch.object(width_control, "LONE_MIN_EVIDENCE", 6)),
    "tries6": ("lone tries on hope, choices held 6 rounds", lambda: _both(
        patch.object(width_control, "LONE_TRY_WITHIN", 1.0), patch.object(width_control, "LONE_MIN_EVIDENCE", 6))),
    # ... or, on hope, only a K this width has not measured yet (once per process), never again when stale
    "untriedonly": ("lone tries on hope only untried", lambda: _both(
        patch.object(width_control, "LONE_TRY_WITHIN", 1.0), patch.object(
            width_control.WidthControl, "_hopes", lambda self, max_k, costs, acc, nearby, lone, drains: {
                k: self.gain(k, costs, acc, nearby, lone, hope=True)[0] * drains[k] for k in range(1, max_k + 1)
                if len(self.spec.by_k.get(k, ())) < width_control.MIN_SAMPLES
                or not lone and self.spec_rounds - self.last_run.get(k, 0) > width_control.RETRY_AFTER}))),
    # (with --concurrency) a plain batch width's shadow rounds stop after 8 rounds predicting no gain, not 24
    "span8": ("shadows stopped after 8 rounds", lambda: patch.object(width_control, "SHADOW_SPAN", 8)),
    # ... or, stopped, explored by a try whatever K is predicted, not by shadows again (before 2026-12-06 later)
    "noagain": ("stopped shadows' exploration tries", lambda: patch.object(width_control, "SHADOW_AGAIN", False)),
    "noretry": ("stale K's not measured again", lambda: patch.object(width_control, "RETRY_AFTER", 10 ** 9)),
    # what `gmlx sweep-cap --write` records on this CPU for SmolLM2 float32 ("a lone request: K = 1"):
    # the control on, its ceiling at width 1 one draft (the user config's K per width, as CapWatch reads it)
    "ceil1": ("control, K ceiling 1 (as sweep-cap --write)",
              lambda: patch.object(CapWatch, "k_for", lambda self, width, k_for=CapWatch.k_for:
                              min(1, k_for(self, width)) if width == 1 else k_for(self, width))),
    # a new lone request where plain is in force: plain (notry: gmlx before LONE_TRY), alone or
    # with ceil1's ceiling
    "notry": ("no K=1 try for a new request", lambda: patch.object(width_control, "LONE_TRY", False)),
    "ceil1notry": ("ceil1, no K=1 try", lambda: _both(VARIANTS["ceil1"][1](), VARIANTS["notry"][1]())),
    "k1": ("K=1 every round, control off", contextlib.nullcontext),
    "k2": ("K=2 every round, control off", contextlib.nullcontext),
    "k3": ("K=3 every round, control off", contextlib.nullcontext),
    # a lone request sent plain drops its drafter and stays plain, and a try stays only if its gain
    # is sure (gmlx before this rule: thresholds.REARM_MIN, width_control.LONE_POINT)
    "norearm": ("no re-arm, doubt kept", lambda: _both(patch.object(thresholds, "REARM_MIN", 10 ** 9),
                                                       patch.object(width_control, "LONE_POINT", False))),
    "sure": ("re-arm, doubt kept", lambda: patch.object(width_control, "LONE_POINT", False)),
    "off": ("the default drafter, control off", contextlib.nullcontext),
    # the lone request's rounds never draft from its own context (gmlx before gmlx/drafters/context_lookup.py)
    "nolookup": ("no context lookup", lambda: patch.object(ContextLookup, "propose", lambda self, *a: [])),
    # ... or only while the control has it speculate (a request it has plain re-arms for none: 2026-12-06 late)
    "speconly": ("context lookup only while speculating", lambda: patch.object(
        PredictionDrafter, "context_recurs", lambda self, *a: False)),
    # a lone request sent plain at a gain near 1 waits out the back-off (64 plain rounds, doubling)
    # instead of exploring after EXPLORE_SOON (width_control.acceptance_doubt)
    "nosoon": ("no soon re-try", lambda: patch.object(width_control, "acceptance_doubt", lambda acc: 0.0)),
    # the lone request's cost ratios from boundary pairs alone, no steady samples (gmlx before 2026-12-07)
    "nosteady": ("boundary pairs only", lambda: patch.object(width_control, "STEADY_PAIRS", False)),
    # a lone request sent plain keeps no shadow rounds: its acceptance is the one it had when it
    # went plain (gmlx before gmlx/decode/shadow.py)
    "noshadow": ("no shadow rounds", lambda: patch.object(shadow, "SHADOW_EVERY", 10 ** 9)),
    # a lone request's round that switches kind (goes plain, re-arms, changes K) timed like any other
    # (gmlx before ScalarLane.switched): its period holds both kinds' dispatch work
    "switchtimed": ("switching rounds timed", lambda: patch.object(
        Speculation, "observe", lambda self, *a, observe=Speculation.observe, **kw:
        observe(self, *a[:6], **{**kw, "scalar_switched": False}))),
    # a lone request's tokens per round at k: the width's measured ones scaled by its acceptance over
    # the pool's (gmlx before 2026-12-05), not its own acceptance's model alone
    "scaled": ("pooled tokens per round scaled", lambda: patch.object(
        width_control.WidthControl, "_seen", lambda self, k, acc, lone, seen=width_control.WidthControl._seen:
        (seen(self, k, acc, False) * acc.emitted(k) / self.acceptance.emitted(k)) if lone else seen(self, k, acc, lone))),
}
FIXED_K = {f"k{k}": (EngineConfig(num_draft_tokens=k, width_cap=0), Switches(control=False)) for k in (1, 2, 3)}
OFF = (EngineConfig(width_cap=0, prompt_cache_bytes=0), Switches(control=False))  # the lane's own K per round (its acceptance, the probe's costs)


DRAFTER: str | None = None  # --drafter: every arm's drafter kind (None: the model's default)


def one(lm, arm: str, prompts: list[list[int]], max_tokens: int, fresh: bool = False) -> dict:
    config, switches = (FIXED_K[arm] if arm in FIXED_K else OFF if arm == "off" else
                        ARMS["plain" if arm == "plain" else "default"][:2])
    if DRAFTER is not None and arm != "plain":
        config = replace(config, drafter=DRAFTER)
    if fresh:  # nothing learnt: a fresh process's first request(s)
        control.forget(lm.target)
    with contextlib.nullcontext() if arm == "plain" else VARIANTS[arm][1]():
        return run_burst(lm, prompts, max_tokens, config, switches)


def fresh_loop(lm, arm: str, prompts: list[list[int]], max_tokens: int) -> dict:
    """--fresh: each of `prompts` in turn, one at a time, from nothing learnt (a fresh process's
    first requests, as bench_cpu_fused.py runs them); the runs' tokens and tokens/s together."""
    runs, seconds = [], 0.0
    for i, p in enumerate(prompts):
        runs.append(one(lm, arm, [p], max_tokens, fresh=i == 0))
        seconds += runs[-1]["tokens"] / runs[-1]["tok_s"]
    drafted = [r["acc"] for r in runs if r["acc"] is not None]
    decode_s, decode_tokens = sum(r["decode_s"] for r in runs), sum(r["decode_tokens"] for r in runs)
    return {"tok_s": sum(r["tokens"] for r in runs) / seconds, "acc": statistics.mean(drafted) if drafted else None,
            "out": [t for r in runs for t in r["out"]], "decode_tok_s": decode_tokens / decode_s}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-f32")
    ap.add_argument("--repeats", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=1, help="requests submitted together")
    ap.add_argument("--variants", default="light,heavy", help=f"of {', '.join(VARIANTS)}")
    ap.add_argument("--fresh", action="store_true", help="each run starts with nothing learnt (the control's"
                    " figures forgotten), and runs all of a kind's prompts in turn, one at a time")
    ap.add_argument("--extended", action="store_true", help="12 questions a kind (bench_matrix's 4 and the 8"
                    " of gmlx_training/replay_smollm2_eagle3.py), not 4")
    ap.add_argument("--drafter", default=None, help="every arm's drafter kind (default: the model's own)")
    ap.add_argument("--out", type=Path, default=Path("bench_results"))
    a = ap.parse_args()
    global DRAFTER
    DRAFTER = a.drafter
    if a.fresh and a.concurrency != 1:
        ap.error("--fresh runs one request at a time (c = 1)")
    lm = model(a.model)
    pools = prompt_sets(lm, a.model)
    if a.extended:
        from gmlx_training.replay_smollm2_eagle3 import EXTRA_CHAT_ASKS, EXTRA_CODE_ASKS

        chat = lambda text: list(lm.tokenizer.apply_chat_template([{"role": "user", "content": text}],  # noqa: E731
                                                                  add_generation_prompt=True))
        pools = {"code": pools["code"] + [chat(q) for q in EXTRA_CODE_ASKS],
                 "chat": pools["chat"] + [chat(q) for q in EXTRA_CHAT_ASKS]}
    arms = ["plain", *a.variants.split(",")]
    unknown = [v for v in arms[1:] if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variant {unknown[0]!r}: one of {', '.join(VARIANTS)}")
    for arm in arms:  # warm-up: kernels, the probe, the allocator
        one(lm, arm, pools["code"][:1], 8)
    reps = {kind: {arm: [] for arm in arms} for kind in pools}
    for rep in range(a.repeats):
        order = arms if rep % 2 == 0 else list(reversed(arms))
        # c = 1: each kind, every arm; a batch: each arm, its code burst then its chat burst (each
        # arm's chat batch starts where code left the pooled figures)
        runs = ([(kind, arm) for kind in pools for arm in order] if a.concurrency == 1
                else [(kind, arm) for arm in order for kind in pools])
        for kind, arm in runs:
            pool = pools[kind]
            r = (fresh_loop(lm, arm, pool, a.max_tokens) if a.fresh else
                 one(lm, arm, [pool[(rep + i) % len(pool)] for i in range(a.concurrency)], a.max_tokens))
            reps[kind][arm].append(r)
            print(f"rep {rep} {kind} {arm:7s} {r['tok_s']:6.1f} tok/s acc {r['acc']}", flush=True)
    cells = []
    for kind, by_arm in reps.items():
        plain = by_arm["plain"]
        cell = {"kind": kind,
                "same_tokens": {arm: all(x["out"] == p["out"] for x, p in zip(by_arm[arm], plain)) for arm in arms},
                "tok_s": {arm: statistics.median(x["tok_s"] for x in by_arm[arm]) for arm in arms},
                "speedup": {arm: ratio(by_arm, arm, "plain") for arm in arms},
                # ... of the decode after each request's first token (what `gmlx generate` reports)
                "decode_speedup": {arm: ratio(by_arm, arm, "plain", "decode_tok_s") for arm in arms},
                "drafted_share": {arm: sum(x["acc"] is not None for x in by_arm[arm]) / len(plain) for arm in arms},
                "per_rep": {arm: [round(x["tok_s"] / p["tok_s"], 3) for x, p in zip(by_arm[arm], plain)]
                            for arm in arms}}
        cells.append(cell)
    result = {"machine": describe(), "command": command_line("bench_lone_prior.py", a), "cells": cells}
    path = write_result(a.out, "lone_prior" if a.concurrency == 1 else "batch_mixed", result)
    lines = [f"`{result['command']}`", "",
             "| prompts | plain tok/s | " + " | ".join(f"{v} ({VARIANTS[v][0]})" for v in arms[1:]) + " | same tokens |",
             "|---|---|" + "---|" * len(arms)]
    for c in cells:
        lines.append(f"| {c['kind']} | {c['tok_s']['plain']:.1f} | " + " | ".join(
            f"{c['speedup'][v]:.2f}x, decode {c['decode_speedup'][v]:.2f}x (drafted in {c['drafted_share'][v]:.0%})"
            for v in arms[1:])
            + f" | {all(c['same_tokens'].values())} |")
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
