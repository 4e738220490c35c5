"""The online control compared without this machine's noise: the engine on SmolLM2 float32 with a
simulated clock, so that every round costs what a table of round periods measured on this CPU
says (by width and K), and the control's decisions — made on that clock — are compared arm by arm.

Why: on this shared 2-core VM a run's rate moves 3-15 % from one repeat to the next, more than
most of the control's rules are worth, so a rule measured in wall time is often a coin toss. Here
the tokens, the acceptance and every decision are the engine's own (the real model and its shipped
EAGLE-3 head, greedy, the control unchanged); only the clock is modelled, so a run is exactly
reproducible and two rules differ by what they decide alone. What it is not: a measurement of
speed. The table is one machine's, the host work outside a round is folded into its period, and a
rule chosen here must still show in an interleaved wall-time run (`--wall`).

The clock: each round advances it by the model's plain[width] x ratio[width][K] (TABLES; a capture
round by CAPTURE); prefill and transitions cost nothing (the same work in every arm). The engine's
round timing and the control's pairing read this clock; the load probe's figures are the table's.
Each arm starts from nothing measured (a fresh process). A closed loop keeps c requests in flight
over the prompts.

Run: ``python benchmarks/sim_control.py --kinds chat,code --concurrency 1,2,4 --max-tokens 64``
(``--wall N``: the same closed loops in wall time, N interleaved repeats, each arm a fresh process's
state, to confirm a rule; ``--jitter 0.08 --seeds 6``: each simulated period jittered by this machine's
round-to-round noise, reproducibly — round i of every arm draws the same factor for a seed;
``--measure 1,2,4`` times the table's rounds on this machine).
Writes bench_results/<utc>_sim_control.json and .md.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import types
from collections import Counter, deque
from pathlib import Path

import numpy as np

import gmlx  # noqa: F401  (OpenBLAS before mlx)
from gmlx import Engine, EngineConfig, SamplingParams
from gmlx.config import Switches
from gmlx.decode import batch_shadow, scalar, scalar_start
from gmlx.engine import engine as engine_mod, lanes, speculation
from gmlx.gguf.smollm2 import converted
from gmlx.machine import describe
from gmlx.models.loading import load
from gmlx.policy import control, figures, width_control
from gmlx.policy import pairs as pairs_mod
from gmlx.policy.admission import Round
from gmlx.policy import costs as costs_mod
from gmlx.policy.costs import Costs

from bench_matrix import prompt_sets
from common import closed_loop as run_closed_loop, command_line, write_result

# A round's period (start to next start), ms, by width bucket: plain, and K drafts as a ratio to it.
# With gmlx's small-M kernel (docs/cpu_kernel.md): `--measure 1,2,4` here on 2026-12-05 (round
# durations, control off, K fixed, 4 interleaved repeats of 40 tokens); the period's host work
# outside a round (~1 ms at width 1 now: 30-34 tok/s plain end to end) is left out. Width 8:
# extrapolated — its speculative rounds verify 16-32 rows, past the kernel's 8, as width 4's K = 2 / 3.
# With the models' norms and rotary embeddings fused too (gmlx/models/cpu_fused.py), `--measure 1,2,4`
# on 2026-12-06 (the rows before it: "smollm2-f32-unfused" below; width 8 unchanged, extrapolated):
# Width 1 re-measured on 2026-12-06 later (`--measure 1`, three runs, medians: plain 25.8 / 27.5 / 29.1 ms,
# K = 1 1.241 / 1.166 / 1.303, K = 2 1.575 / 1.479 / 1.613, K = 3 1.620 / 1.692 / 1.700), after the rotary angles
# were computed once per forward; it was plain 28.2, K = 1 / 2 / 3 1.34 / 1.50 / 1.71 (a K = 1 round's steps
# in engine traces that session: 1.16-1.28x).
# With early dispatch (gmlx/models/early_dispatch.py: every forward's layers start computing as they are
# built), `--measure 1,2,4` on 2026-12-06 at 11:30, medians of three runs at width 1 (plain 27.1 / 26.7 / 26.9 ms,
# K = 1 1.057 / 1.100 / 1.113, K = 2 1.382 / 1.485 / 1.426, K = 3 1.478 / 1.560 / 1.575) and of two at widths 2 and 4
# (plain 25.4 / 26.6 and 35.5 / 36.3 ms: the batch's plain steps gained the most); width 8 unchanged, extrapolated.
# Before it: "smollm2-f32-noearly" below.
PLAIN = {1: 26.9, 2: 26.0, 4: 35.9, 8: 58.0}
RATIO = {1: {1: 1.10, 2: 1.43, 3: 1.56}, 2: {1: 1.55, 2: 1.99, 3: 2.40}, 4: {1: 1.68, 2: 3.31, 3: 3.18},
         8: {1: 2.40, 2: 3.00, 3: 3.40}}
NOEARLY = ({1: 27.5, 2: 31.0, 4: 42.3, 8: 58.0},
           {1: {1: 1.24, 2: 1.58, 3: 1.69}, 2: {1: 1.41, 2: 1.82, 3: 2.10}, 4: {1: 1.60, 2: 2.76, 3: 2.56},
            8: {1: 2.40, 2: 3.00, 3: 3.40}})
UNFUSED = ({1: 30.6, 2: 39.2, 4: 44.6, 8: 58.0},
           {1: {1: 1.33, 2: 1.56, 3: 1.88}, 2: {1: 1.38, 2: 1.69, 3: 1.88}, 4: {1: 1.54, 2: 2.46, 3: 2.45},
            8: {1: 2.40, 2: 3.00, 3: 3.40}})
# the load probe here (its figures on SmolLM2 with the kernel, 2026-12-05: a 48-token context; the
# forwards of the 6-16 tokens that widths 2 and 4 verify at K = 1-3, gmlx/decode/probe.py)
PROBE_NOEARLY = Costs(verify=(1.0, 1.07, 1.28, 1.34), draft=0.04, source="measured (simulated)",
                      rows=((1, 1.0), (2, 1.07), (3, 1.28), (4, 1.34), (6, 1.83), (8, 2.11), (12, 3.18), (16, 3.18)))
# ... and with early dispatch (2026-12-06 11:35, `gmlx.decode.probe.measure` three times, medians): its one-token
# forward is the faster, so the longer ones cost more of it
PROBE = Costs(verify=(1.0, 1.08, 1.40, 1.45), draft=0.067, source="measured (simulated)",
              rows=((1, 1.0), (2, 1.08), (3, 1.40), (4, 1.45), (6, 1.93), (8, 2.29), (12, 4.16), (16, 4.16)))
# 4-bit (its one-token steps through the float32 twin): `--model smollm2-q --measure 1,2,4`, as above.
# (4-bit: measured before the norms and rotary embeddings were fused)
Q_TABLE = ({1: 32.0, 2: 35.3, 4: 45.0, 8: 58.0},
           {1: {1: 1.20, 2: 1.46, 3: 1.66}, 2: {1: 1.41, 2: 1.81, 3: 1.97}, 4: {1: 1.52, 2: 2.54, 3: 2.51},
            8: {1: 2.40, 2: 3.00, 3: 3.40}},
           Costs(verify=(1.0, 1.02, 1.29, 1.30), draft=0.05, source="measured (simulated)",
                 rows=((1, 1.0), (2, 1.02), (3, 1.29), (4, 1.30), (6, 1.60), (8, 1.84), (12, 3.01), (16, 3.01))))
# Before the kernel (OpenBLAS, same commands, 2026-12-05 morning; ~8 ms of host work added to plain):
OPENBLAS = {"smollm2-f32": ({1: 63.0, 2: 69.0, 4: 79.0, 8: 105.0},
                            {1: {1: 1.15, 2: 1.35, 3: 1.50}, 2: {1: 1.21, 2: 1.39, 3: 1.44},
                             4: {1: 1.17, 2: 1.56, 3: 1.50}, 8: {1: 1.25, 2: 1.60, 3: 1.70}},
                            Costs(verify=(1.0, 1.10, 1.22, 1.32), draft=0.02, source="measured (simulated)")),
            "smollm2-q": ({1: 61.0, 2: 69.0, 4: 81.0, 8: 108.0},
                          {1: {1: 1.25, 2: 1.39, 3: 1.50}, 2: {1: 1.28, 2: 1.41, 3: 1.48},
                           4: {1: 1.16, 2: 1.55, 3: 1.54}, 8: {1: 1.25, 2: 1.60, 3: 1.70}},
                          Costs(verify=(1.0, 1.20, 1.33, 1.45), draft=0.02, source="measured (simulated)"))}
# The Intel Xeon of 2026-12-07 (family 6 model 207, 2 cores; the kernel prefetching, 12 rows, OpenBLAS on SkylakeX):
# `--measure 1,2,4` on a quiet machine (4 interleaved repeats); the probe is the one the engine measured at load and
# kept (gmlx/measured.py, SmolLM2 float32 with its EAGLE-3 head); width 8 as above, extrapolated.
XEON = ({1: 25.7, 2: 28.6, 4: 35.9, 8: 58.0},
        {1: {1: 1.181, 2: 1.382, 3: 1.544}, 2: {1: 1.326, 2: 1.744, 3: 2.063}, 4: {1: 1.622, 2: 2.171, 3: 2.976},
         8: {1: 2.40, 2: 3.00, 3: 3.40}},
        Costs(verify=(1.0, 1.07, 1.196, 1.30), draft=0.048, source="measured (simulated)",
              rows=((1, 1.0), (2, 1.07), (3, 1.196), (4, 1.30), (6, 1.68), (8, 1.93), (12, 2.57), (16, 3.50))))
TABLES = {"smollm2-f32": (PLAIN, RATIO, PROBE), "smollm2-f32-xeon": XEON, "smollm2-f32-noearly": (*NOEARLY, PROBE_NOEARLY),
          "smollm2-f32-unfused": (*UNFUSED, PROBE_NOEARLY), "smollm2-q": Q_TABLE} | {f"{m}-openblas": t
                                                                                     for m, t in OPENBLAS.items()}
# a gated batch's plain round with shadow rounds (gmlx/decode/batch_shadow.py): 0.99-1.02x of one
# without by round durations (`--shadow-cost 2,4`, 2026-12-05, before and with the kernel), but in wall
# time with the kernel a forced-plain float32 closed loop at c = 2 took 1.01-1.14x (4 repeats, median
# ~1.06; docs/cpu_kernel.md): the replays' and captures' work falls outside the rounds' durations.
SHADOW = 1.05
CAPTURE = 1.05  # a capture round: one verify position per row, with the hidden capture
# --switch: what a lone request's switch back to drafting costs in wall time (2026-12-06, SmolLM2 float32,
# chat, every timed period by its place in its run, docs/speculation.md): its first speculative round
# after plain ones ~1.23x a steady one (the drafter reads the plain steps' entries), the next six ~1.10x
# (30.8-32.0 ms against a steady 28.6). Off by default (the table's rounds are steady ones).
SWITCH = (1.23, 1.10, 1.10, 1.10, 1.10, 1.10, 1.10)

def _hopes_with(hope, lone_stale: bool = True):
    """WidthControl._hopes with its deeper positions credited by `hope(lone)` (True: as always agreeing,
    the shipped rule for both; False: at their own estimates) and, unless `lone_stale`, a lone request's
    stale K's not untried again: the gain each untried (or stale) K could have."""
    def hopes(self, max_k, costs, acc, nearby, lone, drains):
        return {k: self.gain(k, costs, acc, nearby, lone, hope=hope(lone))[0] * drains[k] for k in range(1, max_k + 1)
                if len(self.spec.by_k.get(k, ())) < width_control.MIN_SAMPLES
                or (lone_stale or not lone) and self.spec_rounds - self.last_run.get(k, 0) > width_control.RETRY_AFTER}
    return hopes


FIXED = dict(width_cap=0, prompt_cache_bytes=0)
ARMS = {"plain": (EngineConfig(speculative=False, **FIXED), Switches(control=False)),
        "default": (EngineConfig(prompt_cache_bytes=0), Switches(control=True)),
        "k1": (EngineConfig(num_draft_tokens=1, **FIXED), Switches(control=False)),
        "k2": (EngineConfig(num_draft_tokens=2, **FIXED), Switches(control=False)),
        "k3": (EngineConfig(num_draft_tokens=3, **FIXED), Switches(control=False))}
# The default with one rule changed: (module, name, value) patched for the arm's run.
VARIANTS = {"nofirst": [(width_control, "FIRST_K1", False)],  # a width's first tries at the prior's K
            "noretry": [(width_control, "RETRY_AFTER", 10 ** 9)],  # a K measured once is never retried
            "notries": [(width_control, "LONE_TRY_WITHIN", float("inf"))],  # a lone request tries no deeper K
            "tries10": [(width_control, "TRY_WITHIN", 1.0)],  # a batch tries a deeper K only if it could beat the best
            "geohope": [(width_control.WidthControl, "_hopes", _hopes_with(lambda lone: lone))],
            "within11": [(width_control, "LONE_TRY_WITHIN", 1.1)],  # ... only one whose hope is 10 % above the best
            "within125": [(width_control, "LONE_TRY_WITHIN", 1.25)],
            "noshadow": [(batch_shadow, "SHADOWS", False)],  # a gated batch measures nothing (before 2026-12-05)
            "keeponly": [(batch_shadow, "SHADOW_EVERY", 10 ** 9)],  # ... keeps its drafter for the resume, no records
            "ceil1": [(speculation.Speculation, "ceiling", lambda self, width: 1)],  # K ceiling 1 at every width
            "tryfirst": [(width_control, "SHADOW_FIRST", False)],  # a new batch width tries K = 1 on the prior
            "widthless": [(costs_mod.Costs, "at_width", lambda self, width: self)],  # width 1's costs at every width
            # a width's K ceiling keeps its verify within the kernel's rows (width x (K + 1) <= 8)
            "rowcap": [(speculation.Speculation, "ceiling", lambda self, width, _real=speculation.Speculation.ceiling:
                        min(_real(self, width), max(1, 8 // width - 1)))]}


def _untimed_shadow_variant():
    """A gated batch's shadowed plain rounds are not timed as plain ones (their period holds the replays)."""
    from gmlx.decode.batch import BatchLoop
    real_plain, real_observe, flag = BatchLoop.plain_round, speculation.Speculation.observe, [False]

    def plain_round(self, *a, **kw):
        flag[0] = self.shadow is not None
        return real_plain(self, *a, **kw)

    def observe(self, kind, *a, **kw):
        real_observe(self, kind, *a, **kw)
        if flag[0] and kind in (Round.PLAIN, Round.PLAIN_LAST):
            self._pending = None
        flag[0] = False
    return [(BatchLoop, "plain_round", plain_round), (speculation.Speculation, "observe", observe)]


def _shadowed_no_explore(self, width, records, _real=control.Controller.shadowed):
    """A gated width's shadow records count as its exploration: fresh K = 1 figures, so its plain
    run starts over (no try from plain; a resume only on the figures)."""
    _real(self, width, records)
    if records:
        self.at(width).plain_run = 0


# a batch width's tokens per round at every K from its per-position acceptance model, not the rounds that ran K
VARIANTS["modeltpr"] = [(width_control.WidthControl, "_seen", lambda self, k, acc, lone: acc.emitted(k))]


def _observe_calibrated(self, k, seconds, rows, ratio_lent=lambda: False, steady=True,
                        _real=width_control.WidthControl.observe):
    """The model's tokens per round at k, as predicted when each of k's rounds ran (for `calib`)."""
    if k and rows and steady:
        if not self.spec.tokens.get(k):
            self.__dict__.setdefault("pred", {}).pop(k, None)
        self.__dict__.setdefault("pred", {}).setdefault(k, deque(maxlen=2 * figures.WINDOW)).append(
            self.acceptance.emitted(k))
    _real(self, k, seconds, rows, ratio_lent, steady)


def _seen_calibrated(self, k, acc, lone, _real=width_control.WidthControl._seen):
    """k's tokens per round: the acceptance model now, times what k's rounds emitted over what the
    model predicted for them when they ran (a figure gathered when k looked good is not taken as now)."""
    real, pred = self.spec.tokens.get(k, ()), self.__dict__.get("pred", {}).get(k, ())
    n = min(len(real), len(pred))
    if lone or k < 2 or n < figures.MIN_SAMPLES:  # (K = 1's rounds and a gated width's shadow records: 1 + alpha)
        return _real(self, k, acc, lone)
    return acc.emitted(k) * sum(list(real)[-n:]) / sum(list(pred)[-n:])


VARIANTS["calib"] = [(width_control.WidthControl, "observe", _observe_calibrated),
                     (width_control.WidthControl, "_seen", _seen_calibrated)]


def _tries_where_k1_clear(self, best, gains, hopes, within, _real=width_control.WidthControl._neighbour_to_try):
    """A batch width tries a deeper K only while the best is predicted at least 10 % above plain."""
    if within == width_control.TRY_WITHIN and gains[best] < 1.10:
        return best
    return _real(self, best, gains, hopes, within)


VARIANTS["gatedtries"] = [(width_control.WidthControl, "_neighbour_to_try", _tries_where_k1_clear)]


VARIANTS["shexp"] = [(control.Controller, "shadowed", _shadowed_no_explore)]
# a width with nothing timed borrows the nearest timed width's ratio as it is (before 2026-12-05, later:
# scaled by the probe's rows' costs there over here, WidthControl.lift)
VARIANTS["nolift"] = [(width_control.WidthControl, "choose",
                       lambda self, max_k, costs, acceptance=None, nearby=None, *a, _real=width_control.WidthControl.choose,
                       **kw: _real(self, max_k, costs, acceptance, nearby[:2] if nearby else nearby, *a, **kw))]


# a plain width's shadows stopped at another level than thresholds.SHADOW_STOP (1.05; 0.9 before 2026-12-05)
VARIANTS |= {f"far{round(100 * v)}": [(width_control, "SHADOW_STOP", v)] for v in (0.9, 1.0, 99.0)}
VARIANTS["untimedshadow"] = _untimed_shadow_variant()
# the load probe's figures as the table's own rounds (a probe that timed whole rounds, drafts and host work included)
TRUE_PROBE = Costs(verify=(1.0, 1.20, 1.50, 1.57), draft=0.04, source="measured (simulated)",
                   rows=((1, 1.0), (2, 1.20), (3, 1.50), (4, 1.57), (6, 1.83), (8, 2.11), (12, 3.18), (16, 3.18)))
VARIANTS["trueprobe"] = [(mod, name, lambda *a, **kw: TRUE_PROBE) for mod, name in ((scalar, "round_costs"),
                                                                      (scalar_start, "reconfirmed"))]
VARIANTS["trueprobe_notries"] = VARIANTS["trueprobe"] + VARIANTS["notries"]
# with early dispatch a K = 1 round costs ~1.10 plain rounds: less doubt to plain (MARGIN 1.05 -> 1.02 to enter,
# STAY 1.03 -> 1.0 to stay), or fewer rounds before a choice may be left (MIN_EVIDENCE 6 -> 3)
VARIANTS["margin2"] = [(width_control, "MARGIN", 1.02), (figures, "MARGIN", 1.02), (width_control, "STAY", 1.0)]
VARIANTS["minev3"] = [(width_control, "MIN_EVIDENCE", 3)]


def _scaled_ratio(shrink: float | None):
    """T(k) / T(0) on one scale over the probe's shape: every pair, whatever its K, gives a sample of
    log T(j) / T(0) - log round_cost(j), and their median times round_cost(k) is k's ratio (`pooled`,
    shrink None); or k's own samples' median shrunk toward that scale by `shrink` pseudo-samples (`shrunk`:
    one refresh window's sample cannot flip K = 1 and K = 3)."""
    def ratio(self, k, costs, lone=False):
        d = {j: [x - math.log(costs.round_cost(j)) for x in q] for j, q in self.pairs.logs.items()}
        pooled = [x for v in d.values() for x in v]
        if len(pooled) < pairs_mod.MIN_PAIRS:
            return (costs.round_cost(k), "probe") if lone else (None, "")
        own = d.get(k, []) if shrink is not None else []
        mid = (len(own) * statistics.median(own) if own else 0.0) + (shrink or 1.0) * statistics.median(pooled)
        return math.exp(mid / (len(own) + (shrink or 1.0))) * costs.round_cost(k), "paired"
    return [(width_control.WidthControl, "ratio", ratio)]


VARIANTS["pooled"], VARIANTS["shrunk"] = _scaled_ratio(None), _scaled_ratio(4.0)


def _lone_k1(explore: bool):
    """A lone request's speculative rounds are K = 1 while its width has fewer than MIN_EVIDENCE of them
    (FIRST_K1, as a batch width's), and with `explore` also an exploration from plain (not the K of best hope)."""
    real = width_control.WidthControl.choose

    def choose(self, max_k, costs, acceptance=None, *a, **kw):
        c = real(self, max_k, costs, acceptance, *a, **kw)
        if acceptance is not None and c.k > 1 and (self.spec_rounds < width_control.MIN_EVIDENCE
                                                   or (explore and self.exploring)):
            self.current = 1
            c = dataclasses.replace(c, k=1)
        return c
    return [(width_control.WidthControl, "choose", choose)]


VARIANTS["lonek1"], VARIANTS["lonek1x"] = _lone_k1(False), _lone_k1(True)
VARIANTS["geo10"] = VARIANTS["geohope"] + VARIANTS["tries10"]  # both: a batch's deeper K's on the geometric model
# every width's untried K's on their own estimates (per-position rates: the pool's where the request has none), no hope
VARIANTS["nohope"] = [(width_control.WidthControl, "_hopes", _hopes_with(lambda lone: False))]
VARIANTS["ceil1m3"] = VARIANTS["ceil1"] + VARIANTS["minev3"]
# a lone request tries a deeper K on its hope only while this width has not measured it (once per process),
# never again when stale (LONE_TRY_WITHIN 1.0 as before early dispatch)
VARIANTS["untriedonly"] = [(width_control, "LONE_TRY_WITHIN", 1.0),
                           (width_control.WidthControl, "_hopes", _hopes_with(lambda lone: True, lone_stale=False))]
VARIANTS["span8"] = [(width_control, "SHADOW_SPAN", 8)]  # a plain width's shadows stop after one replay's records
# a plain width whose shadows stopped explores by a try, whatever K is predicted (before 2026-12-06 later)
VARIANTS["noagain"] = [(width_control, "SHADOW_AGAIN", False)]
# a shadowing width's exploration tries a K hoped under MARGIN too (before 2026-12-06 late: thresholds.KEEPABLE_TRIES)
VARIANTS["tryall"] = [(width_control, "KEEPABLE_TRIES", False)]
VARIANTS["span12"] = [(width_control, "SHADOW_SPAN", 12)]
VARIANTS["stay97"] = [(width_control, "STAY", 0.97)]  # speculation left only when predicted under 0.97x (every width)
VARIANTS["stay90"] = [(width_control, "STAY", 0.90)]
VARIANTS["nosteady"] = [(width_control, "STEADY_PAIRS", False)]  # boundary pairs alone (before 2026-12-07)


def _oracle_ratio(real=width_control.WidthControl.ratio):
    """The lone request's cost ratio is the clock's table's steady one (an upper bound for any pairing rule)."""
    def ratio(self, k, costs, lone=False):
        return (SimClock.table[1][k], "paired") if lone and k else real(self, k, costs, lone)
    return [(width_control.WidthControl, "ratio", ratio)]


VARIANTS["oracle"] = _oracle_ratio()
VARIANTS["tries6"] = [(width_control, "LONE_TRY_WITHIN", 1.0), (width_control, "LONE_MIN_EVIDENCE", 6)]
VARIANTS["notriesm3"] = VARIANTS["notries"] + VARIANTS["minev3"]


def bucket(width: int) -> int:
    return 1 if width <= 1 else 2 if width <= 2 else 4 if width <= 4 else 8


class SimClock:
    """The engine's and the control's clock, advanced by the rounds the engine runs."""

    table: dict = RATIO  # the installed clock's ratios (the `oracle` arm reads them)

    def __init__(self, model: str = "smollm2-f32", jitter: float = 0.0, switch: bool = False):
        self.plain, self.ratio, self.probe = TABLES[model]
        # --switch: charge SWITCH; the lone request's speculative rounds since its last plain one
        self.switch, self.since_plain = switch, len(SWITCH)
        self.t = 0.0
        # --jitter: each period times exp(N(0, jitter)), a seeded draw (`seed`): this machine's
        # round-to-round noise (a SmolLM2 float32 step here: 25-36 ms about a 28 ms median), which
        # the control's figures must see through; 0: every round exactly the table's
        self.jitter, self.rng = jitter, np.random.default_rng(0)
        self.rounds: Counter = Counter()  # (width bucket, K or "capture") -> rounds

    def install(self) -> None:
        SimClock.table = self.ratio
        fake = types.SimpleNamespace(perf_counter=lambda: self.t)
        engine_mod.time = width_control.time = fake
        scalar.round_costs = scalar_start.reconfirmed = lambda *a, **kw: self.probe
        run = lanes.Lanes.run

        def timed_run(lane, kind, width):
            results = run(lane, kind, width)
            b = bucket(width)
            k = (lane.scalar.last_k or 0) if kind in (Round.SCALAR, Round.SCALAR_LAST) else \
                lane.spec._asked if kind is Round.SPECULATIVE else 0
            shadowed = not k and lane.batch.shadow is not None and kind in (Round.PLAIN, Round.PLAIN_LAST)
            ratio = CAPTURE if kind is Round.CAPTURE else self.ratio[b][k] if k else SHADOW if shadowed else 1.0
            if self.switch and kind in (Round.SCALAR, Round.SCALAR_LAST):
                self.since_plain = self.since_plain + 1 if k else 0
                ratio *= SWITCH[self.since_plain - 1] if k and self.since_plain <= len(SWITCH) else 1.0
            noise = float(np.exp(self.rng.normal(0.0, self.jitter))) if self.jitter else 1.0
            self.t += self.plain[b] * ratio * noise / 1000
            self.rounds[b, "capture" if kind is Round.CAPTURE else "shadowed" if shadowed else k] += 1
            return results

        lanes.Lanes.run = timed_run


def closed_loop(lm, clock: SimClock | None, arm: str, prompts: list, c: int, n: int, carry: dict | None = None,
                seed: int = 0) -> dict:
    """c requests in flight over `prompts` on a fresh engine (nothing measured before it, or with
    `carry`, a dict kept across calls, what this arm's last run left: one process running cell after
    cell, as bench --concurrency 1,2,4 does; common.closed_loop); its rate on the simulated clock, or
    (clock None) in wall time from the first submit."""
    cfg, sw = ARMS.get(arm, ARMS["default"])
    patched = [(obj, name, getattr(obj, name)) for obj, name, _ in VARIANTS.get(arm, [])]
    for obj, name, value in VARIANTS.get(arm, []):
        setattr(obj, name, value)
    control.forget(lm.target)  # a fresh process ...
    key = control.owner(lm.target)
    for d, saved in zip(control.FIGURES, (carry or {}).get(arm, ())):  # ... or this arm's figures so far
        if saved is not None:
            d[key] = saved
    if clock is not None:
        clock.t, clock.rounds, clock.since_plain = 0.0, Counter(), len(SWITCH)
        clock.rng = np.random.default_rng(seed)  # (round i of every arm draws the same factor)
    try:
        r = run_closed_loop(Engine(lm, cfg, switches=sw), prompts, c, n)
        if carry is not None:
            carry[arm] = tuple(d.get(key) for d in control.FIGURES)
    finally:
        for obj, name, value in patched:
            setattr(obj, name, value)
    if clock is None:
        return {"tok_s": r["tok_s"], "tokens": r["tokens"], "out": r["out"]}
    return {"tok_s": r["tokens"] / clock.t, "tokens": r["tokens"], "rounds": {f"{w}:{k}": v for (w, k), v in sorted(
        clock.rounds.items(), key=str)}, "out": r["out"]}


def _mixed_prompts(lm) -> list:
    return [p for kind in ("code", "chat") for p in prompt_sets(lm, "smollm2")[kind]]


def _median_round(eng, prompts: list, w: int, rep: int, n: int, check=None) -> float:
    """w requests of n tokens on `eng` (closed after), stepped to the end: the median duration of
    its rounds at width w, the first and last two left out. `check(eng)` holds after every step."""
    for i in range(w):
        eng.submit(prompts[(rep * w + i) % len(prompts)], SamplingParams(max_tokens=n, seed=0, ignore_eos=True),
                   start=False)
    durs = []
    while eng.has_work:
        durs += [e.duration_s for e in eng.step() if e.kind.value == "round" and e.width == w]
        assert check is None or check(eng)
    eng.close()
    return statistics.median(durs[2:-2])


def measure(lm, widths: list[int], repeats: int, n: int = 40) -> dict:
    """The table's figures on this machine: median round duration per (width, K), control off,
    K fixed, interleaved repeats (the first and last two rounds of a run left out)."""
    arms = {0: EngineConfig(speculative=False, **FIXED)} | {k: EngineConfig(num_draft_tokens=k, **FIXED)
                                                             for k in (1, 2, 3)}
    prompts = _mixed_prompts(lm)
    per: dict = {}
    for rep in range(repeats):
        for w in widths:
            for k in (list(arms) if rep % 2 == 0 else list(arms)[::-1]):
                eng = Engine(lm, arms[k], switches=Switches(control=False))
                per.setdefault((w, k), []).append(_median_round(eng, prompts, w, rep, n))
    return {w: {"plain_ms": round(1000 * statistics.median(per[w, 0]), 1),
                "ratio": {k: round(statistics.median(a / b for a, b in zip(per[w, k], per[w, 0])), 3)
                          for k in (1, 2, 3)}} for w in widths}


def shadow_cost(lm, widths: list[int], repeats: int = 6, n: int = 48) -> dict:
    """SHADOW's figure on this machine: a gated batch's median plain round with shadow rounds over
    one without (the engine with the control on and every width decided plain), interleaved."""
    from gmlx.engine import speculation as spec_mod

    decided = spec_mod.Speculation.plain_widths
    spec_mod.Speculation.plain_widths = lambda self, width, rows, queued: frozenset(range(1, 64))
    prompts = _mixed_prompts(lm)
    per: dict = {}
    try:
        for rep in range(repeats):
            for w in widths:
                for on in ((True, False) if rep % 2 == 0 else (False, True)):
                    batch_shadow.SHADOWS = on
                    eng = Engine(lm, EngineConfig(prompt_cache_bytes=0), switches=Switches(control=True))
                    per.setdefault((w, on), []).append(_median_round(eng, prompts, w, rep, n, check=lambda eng, on=on: (
                        (eng.lanes.batch.shadow is not None) == on or not eng.lanes.batch.rows)))
    finally:
        spec_mod.Speculation.plain_widths, batch_shadow.SHADOWS = decided, True
    return {w: {"plain_ms": round(1000 * statistics.median(per[w, False]), 1), "with_shadows": round(
        statistics.median(a / b for a, b in zip(per[w, True], per[w, False])), 3),
        "per_repeat": [round(a / b, 3) for a, b in zip(per[w, True], per[w, False])]} for w in widths}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-f32", choices=tuple(TABLES),
                    help="the simulated clock's table is the model's (TABLES; -openblas: before the kernel;"
                    " -xeon: the Intel Xeon's of 2026-12-07, the others the AMD EPYC's)")
    ap.add_argument("--kinds", default="chat,code")
    ap.add_argument("--concurrency", default="1,2,4")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2, help="passes over the 4 prompts of each kind")
    ap.add_argument("--arms", default="plain,default,nofirst,ceil1,k1,k3")
    ap.add_argument("--wall", type=int, default=0, metavar="N",
                    help="no simulated clock: N interleaved repeats in wall time (the rules' confirmation)")
    ap.add_argument("--measure", default=None, help="widths to time the table's rounds at (nothing simulated)")
    ap.add_argument("--shadow-cost", default=None, help="widths to time a gated batch's rounds at, with shadow"
                    " rounds and without (SHADOW's figure; nothing simulated)")
    ap.add_argument("--jitter", type=float, default=0.0, metavar="SIGMA", help="each simulated period times"
                    " exp(N(0, SIGMA)) (this machine's round-to-round noise is ~0.08), --seeds runs per cell")
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--switch", action="store_true", help="charge a lone request's speculative rounds after plain"
                    " ones what they cost in wall time (SWITCH)")
    ap.add_argument("--carry", action="store_true", help="each arm's figures carry from cell to cell (one process"
                    " running the cells in order), instead of a fresh process's per cell")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "bench_results")
    a = ap.parse_args()
    lm = load(converted("float32" if a.model.startswith("smollm2-f32") else "q"))
    if a.measure:
        print(measure(lm, [int(w) for w in a.measure.split(",")], repeats=4))
        return
    if a.shadow_cost:
        print(shadow_cost(lm, [int(w) for w in a.shadow_cost.split(",")]))
        return
    clock = SimClock(a.model, a.jitter, a.switch) if not a.wall else None
    if clock is not None:
        clock.install()
    arms, cells, carry = a.arms.split(","), [], {} if a.carry else None
    for kind in a.kinds.split(","):
        for c in [int(x) for x in a.concurrency.split(",")]:
            prompts = prompt_sets(lm, "smollm2")[kind] * a.repeats
            if a.wall:  # interleaved repeats (the arm order alternates), medians of per-repeat ratios
                runs = [{arm: closed_loop(lm, None, arm, prompts, c, a.max_tokens)
                         for arm in (arms if rep % 2 == 0 else arms[::-1])} for rep in range(a.wall)]
                res = {arm: {"tok_s": statistics.median(r[arm]["tok_s"] for r in runs), "out": runs[0][arm]["out"],
                             "per_rep": [round(r[arm]["tok_s"] / r[arms[0]]["tok_s"], 3) for r in runs]}
                       for arm in arms}
                for arm in arms:  # the cell's ratio: the median of per-repeat ratios to the first arm
                    res[arm]["tok_s"] = res[arms[0]]["tok_s"] * statistics.median(res[arm]["per_rep"])
            elif a.jitter:  # one run per seed, every arm on the same draws; medians of per-seed ratios
                runs = [{arm: closed_loop(lm, clock, arm, prompts, c, a.max_tokens, carry, seed) for arm in arms}
                        for seed in range(a.seeds)]
                res = {arm: {"tok_s": statistics.median(r[arm]["tok_s"] for r in runs), "out": runs[0][arm]["out"],
                             "per_seed": [round(r[arm]["tok_s"] / r[arms[0]]["tok_s"], 3) for r in runs]}
                       for arm in arms}
                for arm in arms:
                    res[arm]["tok_s"] = res[arms[0]]["tok_s"] * statistics.median(res[arm]["per_seed"])
            else:
                res = {arm: closed_loop(lm, clock, arm, prompts, c, a.max_tokens, carry) for arm in arms}
            same = all(r["out"] == res[arms[0]]["out"] for r in res.values())
            for r in res.values():
                del r["out"]
            cells.append({"kind": kind, "c": c, "same_tokens": same, "arms": res})
            base = res.get("plain", {}).get("tok_s")
            print(kind, c, same, {arm: round(r["tok_s"] / base, 3) if base else round(r["tok_s"], 2)
                                  for arm, r in res.items()}, flush=True)
            for arm, r in res.items():
                print("   ", arm, r.get("rounds"), flush=True)
    result = {"command": command_line("sim_control.py", a), "machine": describe(), "table": {
        "plain_ms": TABLES[a.model][0], "ratio": TABLES[a.model][1], "capture": CAPTURE,
        "probe": TABLES[a.model][2].verify}, "cells": cells}
    path = write_result(a.out, "wall_control" if a.wall else "sim_control", result)
    clock_said = (f"Wall time, {a.wall} interleaved repeats, medians of per-repeat ratios to {arms[0]}" if a.wall else
                  "Simulated clock (the table in benchmarks/sim_control.py)" + (
                      f", each period jittered by exp(N(0, {a.jitter})), {a.seeds} seeds, medians of per-seed ratios"
                      if a.jitter else ""))
    same = all(c["same_tokens"] for c in cells)
    lines = [f"`{result['command']}`", "",
             f"{clock_said}; rate relative to plain; tokens identical across arms: {same}", "",
             "| prompts | c | " + " | ".join(arms) + " |", "|---|---|" + "---|" * len(arms)]
    for cell in cells:
        base = cell["arms"].get("plain", {}).get("tok_s")
        lines.append(f"| {cell['kind']} | {cell['c']} | " + " | ".join(
            f"{r['tok_s'] / base:.3f}x" if base else f"{r['tok_s']:.2f}" for r in cell["arms"].values()) + " |")
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(path)


if __name__ == "__main__":
    sys.exit(main())
