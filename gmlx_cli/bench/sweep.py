"""`gmlx sweep-cap`: measure where speculation stops paying as the batch widens, and recommend
`speculative_width_cap` from the measurement instead of a guess.

At each width W, W fixed-length requests (ignore_eos) are submitted together to a fresh engine,
once with speculation forced on at every width (cap 0 = uncapped) for each K, once plain. Only
steady-state rounds count: the step that forms the batch (prefill) is skipped, as is any round
after the first row finished (the width is no longer W). A cell's tokens/s is the online
control's estimator over those rounds (`gmlx.policy.figures.steady_rate`: W x mean tokens per
row and round / median round period), so sweep-cap and the control rank K alike. Arms alternate
per width and repeat; figures are medians, speedups medians of paired ratios (docs/design.md §8).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from gmlx import blas
from gmlx.policy import user_config
from gmlx.policy.figures import steady_rate
from gmlx.config import EngineConfig, SamplingParams, Switches
from gmlx.engine import Engine
from gmlx.errors import InvalidRequest
from gmlx.engine.metrics import EventKind
from gmlx.drafters.select import can_draft
from gmlx_cli import ui
from gmlx_cli.bench import ideal
from gmlx_cli.bench.fit import check_prompts, fit_requests, max_tokens_error
from gmlx_cli.bench.live import LiveView, print_table
from gmlx_cli.options import (DebugOpt, DrafterOpt, DraftModelOpt, ModelOpt, OutDirOpt, PromptsFileOpt, RepeatsOpt,
                              ResultsJsonOpt, WarmupOpt)
from gmlx_cli.bench.outdir import DEFAULT_OUT, check_out_dir
from gmlx_cli.bench.recommend import at_cap, explain, lone_request_k, recommend
from gmlx_cli.bench.workload import Arrival, build_requests, load_prompt_specs, parse_int_list
from gmlx_cli.loader import loader

DEFAULT_WIDTHS = "1,2,3,4,6,8,12,16"


LONE_PROMPTS = 4  # width 1 is a lone request: measured on several prompts in turn (acceptance varies by prompt)


def measure(lm, prompts: list[list[int]], width: int, max_tokens: int, config: EngineConfig, seed: int = 0) -> dict:
    """Steady-state aggregate tokens/s of `width` requests decoding together in a fresh engine
    (width 1: LONE_PROMPTS requests, each alone, one after another)."""
    engine = Engine(lm, config, switches=Switches())
    groups = ([[prompts[j % len(prompts)]] for j in range(LONE_PROMPTS)] if width == 1
              else [[prompts[i % len(prompts)] for i in range(width)]])
    steady, total = ([], []), [0, 0.0]  # (periods, tokens per row) of steady rounds; tokens, seconds
    streams = []
    try:
        for group in groups:
            streams += [engine.submit(p, SamplingParams(max_tokens=max_tokens, seed=seed + len(streams) + i,
                                                        ignore_eos=True), start=False) for i, p in enumerate(group)]
            _decode(engine, width, steady, total)
    finally:
        engine.close()
    rate = steady_rate(width, *steady)  # the online control's estimator (gmlx/policy/figures.py)
    tokens, seconds = total
    recs = [s.wait(0) for s in streams]
    drafted = sum(r.stats.get("num_drafted", 0) for r in recs)
    accepted = sum(r.stats.get("num_accepted", 0) for r in recs)
    rounds = sum(r.stats.get("num_rounds", 0) for r in recs)  # per row: rounds that drafted
    if rate is None:  # too short for a steady state: all of it
        rate = tokens / seconds if seconds > 0 else 0.0
    return {"tokens_per_s": rate, "tokens": tokens, "seconds": seconds, "steady_rounds": len(steady[0]),
            "draft_acceptance_rate": accepted / drafted if drafted else float("nan"), "rounds": rounds,
            "tokens_per_round": (rounds + accepted) / rounds if rounds else float("nan"),
            "drafts_per_round": drafted / rounds if rounds else float("nan")}


def _decode(engine: Engine, width: int, steady: tuple[list, list], total: list) -> None:
    """Step until idle, adding tokens and seconds to `total`, and to `steady` each round where all
    `width` rows decode (the first step, the prefill, excluded): its period and tokens per row."""
    first = True
    while engine.has_work:
        t = time.perf_counter()
        events = engine.step()
        dt = time.perf_counter() - t
        rounds = [e for e in events if e.kind is EventKind.ROUND]
        n = sum(row[3] for e in rounds for row in e.rows)
        total[0], total[1] = total[0] + n, total[1] + dt
        if not first and rounds and all(e.width == width for e in rounds):
            steady[0].append(dt)
            steady[1].append(n / width)
        first = False


def measure_all(lm, ids, ws: list[int], arms: list, config, max_tokens: int, seed: int, repeats: int, warmup: bool,
                rows: list[dict], human) -> bool:
    """Every (repeat, width, arm), the arms' order alternating; appends to `rows` as it goes (an
    interrupt keeps what was measured). Returns whether it was interrupted."""
    try:
        if warmup:
            for _, k in arms:
                measure(lm, ids, min(ws), min(8, max_tokens), config(k), seed)
        for rep in range(repeats):
            for i, w in enumerate(ws):
                for arm, k in arms if (rep + i) % 2 == 0 else arms[::-1]:
                    m = measure(lm, ids, w, max_tokens, config(k), seed)
                    rows.append({"width": w, "arm": arm, "k": k, "repeat": rep, **m})
                    print(f"width {w:>3} rep {rep} {arm:5} {'' if k is None else f'K={k}':4} "
                          f"{m['tokens_per_s']:8.1f} tok/s", file=human, flush=True)
    except KeyboardInterrupt:
        return True
    return False


def recommend_and_store(summary: list[dict], ks: list[int], margin: float, cap, payload: dict, human, write: bool,
                        mkey: str, machine: str) -> None:
    """The table, the recommended cap and K per width (width 1: the lone request's K, or 0 =
    plain), written to the user config with --write."""
    from gmlx_cli.bench import sweep_results

    payload["recommendation"] = explain(summary, margin, cap)
    k_by_width = {r["width"]: r["best_k"] for r in summary if cap != user_config.OFF and 2 <= r["width"] <= cap}
    k_by_width.update(lone_request_k(summary, margin))
    payload["num_draft_tokens_by_width"] = k_by_width
    print_table("speculative vs plain, aggregate tokens/s (steady state, medians)",
                *sweep_results.sweep_table(summary, ks, margin, [at_cap(r["width"], cap, k_by_width) for r in summary]),
                human)
    print(f"recommended speculative_width_cap: {cap} ({payload['recommendation']})", file=human, flush=True)
    if 1 in k_by_width:
        print(f"a lone request: {'K = %d' % k_by_width[1] if k_by_width[1] else 'plain (speculation lost at width 1)'}",
              file=human, flush=True)
    if write:
        path = user_config.write_cap(mkey, cap, k_by_width=k_by_width or None, machine=machine)
        payload["written"] = str(path)
        print(f"wrote speculative_width_cap = {cap} for {mkey} on {machine} to {path}", file=human, flush=True)


def sweep_cap(
    ctx: typer.Context,
    model: ModelOpt = None,
    draft_model: DraftModelOpt = None,
    drafter: DrafterOpt = None,
    widths: Annotated[str, typer.Option("--widths", help="Batch widths to measure, a comma list.")] = DEFAULT_WIDTHS,
    num_draft_tokens: Annotated[str | None, typer.Option(
        "--num-draft-tokens", help="K to measure, a comma list (several: the best K per width is recorded)."
        " Default: the model's.", show_default=False)] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Tokens per request (fixed length).")] = 64,
    margin: Annotated[float, typer.Option("--margin", help="Speculation must beat plain by this factor.")] = 1.05,
    prompts: PromptsFileOpt = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the first request (the others count up).")] = 0,
    repeats: RepeatsOpt = 3,
    warmup: WarmupOpt = True,
    write: Annotated[bool, typer.Option("--write", help="Store the cap (and K per width) in the user config,"
                                        " keyed by model and machine.")] = False,
    validate: Annotated[bool, typer.Option("--validate", help="Then run the PREEMPT/RESUME A/B on a join-late"
                                           " workload at the new cap.")] = False,
    out: OutDirOpt = DEFAULT_OUT,
    json_output: ResultsJsonOpt = False,
    debug: DebugOpt = False,  # noqa: ARG001 - read by the error boundary
) -> None:
    """Measure speculative vs plain throughput per batch width and recommend speculative_width_cap."""
    options = {k: str(v) if isinstance(v, Path) else v for k, v in locals().items() if k != "ctx"}
    from gmlx_cli.bench import plots, results, sweep_results  # pandas, matplotlib: only when a command needs them

    ws = sorted(parse_int_list(widths, "--widths"))
    ks_given = parse_int_list(num_draft_tokens, "--num-draft-tokens") if num_draft_tokens is not None else None
    check_out_dir(out)
    if max_tokens < 2:
        raise InvalidRequest(f"--max-tokens must be >= 2 for a steady state, got {max_tokens}")
    if repeats < 1:
        raise InvalidRequest(f"--repeats must be >= 1, got {repeats}")
    if not margin > 0:
        raise InvalidRequest(f"--margin must be > 0, got {margin}")
    specs = load_prompt_specs(prompts)
    blas.warn_if_reference()
    lm = loader(ctx)(model)
    if not draft_model and not can_draft(lm, drafter):
        raise InvalidRequest(f"{lm.name} has no MTP or assistant head: there is no speculation to calibrate"
                             " (--draft-model PATH drafts with a small model; --drafter ngram needs none)")
    draft = str(draft_model) if draft_model else None
    ks = ks_given or [lm.default_k]
    ids = [list(lm.tokenizer.encode(s.prompt)) for s in specs]
    used = [(f"prompt {i + 1}", ids[i]) for i in range(min(len(ids), max(*ws, LONE_PROMPTS)))]  # measure() cycles through these
    check_prompts(lm.context_length, used)
    if lm.context_length is not None and any(len(p) + max_tokens > lm.context_length for _, p in used):
        raise max_tokens_error("--max-tokens", str(max_tokens), lm.context_length, used)
    human = sys.stderr if json_output else sys.stdout
    arms = [("plain", None)] + [("spec", k) for k in ks]

    def config(k):
        return EngineConfig(speculative=k is not None, num_draft_tokens=k, width_cap=0 if k else None,
                            drafter=drafter, draft_model=draft)

    rows: list[dict] = []
    interrupted = measure_all(lm, ids, ws, arms, config, max_tokens, seed, repeats, warmup, rows, human)
    df = sweep_results.sweep_frame(rows)
    summary = sweep_results.sweep_summary(df, ws, ks)
    cap = recommend(summary, margin) if summary and not interrupted else None
    if cap is not None:
        ideal.annotate(summary, lm, config)
    mkey, machine = Engine(lm, config(ks[0])).model_key, user_config.machine_key()
    payload = {"meta": results.metadata(command="sweep-cap", model=lm.name, model_path=str(lm.path), options=options,
                                        interrupted=interrupted, model_key=mkey, machine_key=machine),
               "widths": ws, "num_draft_tokens": ks, "margin": margin, "max_tokens": max_tokens, "repeats": repeats,
               "per_width": [{**r, "spec": {str(k): v for k, v in r["spec"].items()}} for r in summary],
               "measurements": results.records(df), "recommended_cap": cap, "written": None, "validate": None}
    if cap is not None:
        recommend_and_store(summary, ks, margin, cap, payload, human, write, mkey, machine)
        if validate:
            interrupted = _validate(lm, cap, bool(payload["written"]), specs, max_tokens, seed, repeats, payload,
                                    human, drafter, draft)
    paths = results.write_tables(out, "sweep", payload, {"measurements": df})
    if summary:
        paths["png"] = plots.plot_sweep(summary, cap, margin, paths["json"].with_suffix(".png"),
                                          payload.get("recommendation"))
    print("results: " + ", ".join(str(p) for p in paths.values()), file=human, flush=True)
    if json_output:
        sys.stdout.write(json.dumps(payload, default=str) + "\n")
        sys.stdout.flush()
    if interrupted:
        # typer turns a KeyboardInterrupt into a silent exit 130; say what was kept.
        ui.error(f"interrupted; partial results written to {paths['json']}")
        raise typer.Exit(130)


def _validate(lm, cap, written: bool, specs, max_tokens: int, seed: int, repeats: int, payload: dict, human,
              drafter: str | None = None, draft: str | None = None) -> bool:
    """PREEMPT/RESUME A/B on join-late at the new cap: TTFT and throughput per arm. Returns
    whether it was interrupted (its partial figures are kept)."""
    from gmlx_cli.bench import results
    from gmlx_cli.bench.arms import plan_arms, run_matrix
    from gmlx_cli.bench.summary import PARTIAL_MARK

    if cap == user_config.OFF and not written:
        # EngineConfig.width_cap takes no "off"; the engine reads it only from the user config.
        ui.notice('--validate at cap "off" needs --write (the engine takes "off" from the user config only); skipped')
        return False
    n = (cap if isinstance(cap, int) and cap > 0 else 2) + 2  # the waiters overflow the cap: gate, then resume
    budget = (max(1, max_tokens // 2), max_tokens)
    reqs = build_requests(specs, n, Arrival("join-late", join_after_s=0.0), budget, 0.0, seed, ignore_eos=True)
    ids = {r.request_id: list(lm.tokenizer.encode(r.prompt)) for r in reqs}
    reqs, notices = fit_requests(lm.context_length, reqs, ids, budget, str(max_tokens))  # 4 x: lowered to fit
    for line in notices:
        ui.notice(line)
    arms = plan_arms("both", [], Switches(), True)
    config = EngineConfig(width_cap=None if cap == user_config.OFF else cap, drafter=drafter, draft_model=draft)
    runs, interrupted = [], False
    view = LiveView(len(arms) * repeats * n, human)
    try:
        with view:
            run_matrix(lm, arms, reqs, ids, [n], repeats, config, view, runs, ignore_eos=True)
    except KeyboardInterrupt:
        interrupted = True
    cells = results.cells_frame(runs, results.requests_frame(runs), repeats)
    payload["validate"] = {"cap": cap, "requests": n, "cells": results.records(cells),
                           "transitions": results.transitions_by_arm(runs)}
    print_table(f"validate: join-late, {n} requests at cap {cap}",
                ["arm", "TTFT p50 ms", "TTFT p95 ms", "agg tok/s", "preempt", "gate", "resume", "capture"],
                [[c.arm + (PARTIAL_MARK if c.partial else ""), c.ttft_p50_s * 1e3, c.ttft_p95_s * 1e3,
                  c.aggregate_tokens_per_s, c.preempt, c.gate, c.resume, c.capture] for c in cells.itertuples()], human)
    return interrupted
