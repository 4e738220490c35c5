"""`gmlx bench`: simulated concurrent streams through the engine, per arm and concurrency.

Arms: the engine as configured, or the PREEMPT/RESUME A/B (switches passed to a fresh Engine per
run: never the process environment, so arms cannot leak into each other), plus baselines: the
same engine without speculation, mlx-lm's BatchGenerator and stream_generate. Arms alternate
(ABBA) within every cell so that drift on a shared machine hits them alike (docs/design.md §8).
"""

from __future__ import annotations

import itertools
import secrets
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path


from gmlx import blas
from gmlx.config import EngineConfig, Switches
from gmlx.engine import Engine
from gmlx.errors import InvalidRequest
from gmlx.drafters.select import can_draft
from gmlx.engine.intake import make_row, tokenize
from gmlx_cli import dist, ui
from gmlx_cli import generate as _gen
from gmlx_cli.bench_report import VerificationFailed, report  # noqa: F401 - VerificationFailed: re-exported
from gmlx_cli.baselines import MlxBatchBackend, MlxStreamBackend
from gmlx_cli.fit import fit_requests
from gmlx_cli.live import LiveView
from gmlx_cli.options import (AbOpt, ArrivalOpt, BaselineOpt, BenchApiKeyOpt, ConcurrencyOpt, DebugOpt, DistributedOpt,
                              DrafterOpt, DraftModelOpt, IgnoreEosOpt, JoinAfterOpt, LabelOpt, LongTokensOpt,
                              MaxTokensRangeOpt, ModelOpt, NumDraftOpt, OutDirOpt, PromptsFileOpt, RateOpt, RepeatsOpt,
                              RequestsOpt, ResultsJsonOpt, SeedOpt, ServedModelOpt, StaggerOpt, TempOpt, UrlOpt,
                              VerifyOpt, WarmupOpt, WidthCapOpt)
from gmlx_cli.outdir import DEFAULT_OUT, check_out_dir
from gmlx_cli.workload import (Arrival, Backend, EngineBackend, build_requests, drive, load_prompt_specs,
                               parse_int_list, parse_token_range)

AB_VALUES = ("preempt", "resume", "both")
BASELINES = ("plain", "mlx-lm")



@dataclass(frozen=True)
class Arm:
    name: str
    backend: str = "gmlx"  # gmlx | mlx-lm-batch | mlx-lm-stream | http (bench --url)
    speculative: bool = True
    preempt: bool = True
    resume: bool = True


@dataclass
class Run:
    arm: Arm
    concurrency: int
    repeat: int
    cap: str = "-"
    outcomes: list = field(default_factory=list)
    transitions: dict = field(default_factory=dict)
    complete: bool = False  # False: interrupted (or still running); its cell is marked partial
    server_spec: dict | None = None  # bench --url: what the run added to the server's spec_decode counters


def parse_choices(values: list[str], allowed: tuple[str, ...], option: str) -> list[str]:
    out = [v.strip() for raw in values for v in raw.split(",") if v.strip()]
    bad = [v for v in out if v not in allowed]
    if bad:
        raise InvalidRequest(f"{option} must be one of {', '.join(allowed)}; got {bad[0]!r}")
    return list(dict.fromkeys(out))


def plan_arms(ab: str | None, baselines: list[str], env: Switches, has_drafter: bool) -> list[Arm]:
    base = Arm("gmlx", speculative=has_drafter, preempt=env.preempt, resume=env.resume)
    if ab == "preempt":
        arms = [replace(base, name=f"gmlx-preempt{int(p)}", preempt=p) for p in (True, False)]
    elif ab == "resume":
        arms = [replace(base, name=f"gmlx-resume{int(r)}", resume=r) for r in (True, False)]
    elif ab == "both":
        arms = [replace(base, name=f"gmlx-preempt{int(p)}-resume{int(r)}", preempt=p, resume=r)
                for p, r in itertools.product((True, False), repeat=2)]
    else:
        arms = [base]
    if "plain" in baselines:
        arms.append(replace(base, name="gmlx-plain", speculative=False))
    if "mlx-lm" in baselines:
        arms += [Arm("mlx-lm-batch", "mlx-lm-batch", False), Arm("mlx-lm-stream", "mlx-lm-stream", False)]
    return arms


def make_backend(lm, arm: Arm, config: EngineConfig, concurrency: int, ignore_eos: bool,
                 new_engine=Engine) -> tuple[Backend, str]:
    """A fresh backend for one run, and the cap it runs under (for the view and the tables).
    `new_engine`: Engine, or a cluster's (--distributed: the same engine on every rank)."""
    if arm.backend == "mlx-lm-batch":
        return MlxBatchBackend(lm, ignore_eos, concurrency), "-"
    if arm.backend == "mlx-lm-stream":
        return MlxStreamBackend(lm, ignore_eos), "-"
    engine = new_engine(lm, replace(config, speculative=arm.speculative),
                        switches=Switches(preempt=arm.preempt, resume=arm.resume))
    return EngineBackend(engine), engine.cap_in_force.text if arm.speculative else "-"


def run_matrix(lm, arms, requests, ids, concurrencies, repeats, config, view, runs, ignore_eos=False,
               new_engine=Engine) -> list[Run]:
    """Every (concurrency, repeat) runs every arm, in ABBA order. Each run is appended to `runs`
    before it starts, so an interrupt leaves the caller the partial one too."""
    for c in concurrencies:
        for rep in range(repeats):
            for arm in arms if rep % 2 == 0 else arms[::-1]:
                backend, cap = make_backend(lm, arm, config, c, ignore_eos, new_engine)
                run = Run(arm, c, rep, cap)
                runs.append(run)
                view.begin(f"{arm.name} c={c} rep {rep}", speculative=arm.speculative, cap=cap)
                try:
                    drive(backend, requests, ids, c, view.on_event, view.submitted, done=run.outcomes)
                    run.complete = True
                finally:
                    run.transitions = backend.transitions()
                view.end(run.outcomes)
    return runs


def verify_runs(lm, runs) -> tuple[int, int, list[str]]:
    """Every finished gmlx stream against a solo plain run of the same request (docs/design.md §3):
    (checked, near-ties, mismatch lines). Each distinct request is decoded once."""
    from gmlx.testing import compare_streams, run_scalar

    refs: dict = {}
    checked, ties, bad = 0, 0, []
    for run in runs:
        for o in run.outcomes:
            if run.arm.backend != "gmlx" or o.finish_reason not in ("length", "stop"):
                continue
            p = o.request.params
            key = (tuple(o.prompt_tokens), p)
            if key not in refs:
                refs[key] = run_scalar(lm, o.prompt_tokens, p, speculative=False,
                                       eos_ids=() if p.ignore_eos else None).tokens
            cmp = compare_streams(lm, o.prompt_tokens, refs[key], o.tokens, p)
            checked, ties = checked + 1, ties + (cmp.tie and not cmp.equal)
            if not cmp.ok:
                bad.append(f"{run.arm.name} c={run.concurrency} rep {run.repeat} request {o.request.request_id}:"
                           f" differs at token {cmp.position} (top-2 margin {cmp.margin:.3g})")
    return checked, ties, bad


def check_run_options(ab: str | None, baseline: list[str] | None, repeats: int, requests: int, distributed: bool,
                      verify: bool) -> list[str]:
    """The run options' one-line errors, before any model loads; returns the baselines."""
    if ab is not None and ab not in AB_VALUES:
        raise InvalidRequest(f"--ab must be one of {', '.join(AB_VALUES)}; got {ab!r}")
    baselines = parse_choices(baseline or [], BASELINES, "--baseline")
    if repeats < 1:
        raise InvalidRequest(f"--repeats must be >= 1, got {repeats}")
    if requests < 1:
        raise InvalidRequest(f"--requests must be >= 1, got {requests}")
    if distributed and ("mlx-lm" in baselines or verify):
        raise InvalidRequest("--baseline mlx-lm and --verify run the model outside the engine, on rank 0 alone;"
                             " with --distributed use --baseline plain (tests/test_distributed.py checks the streams)")
    return baselines


def bench(
    concurrency: ConcurrencyOpt = "1,2,4,8",
    requests: RequestsOpt = 16,
    arrival: ArrivalOpt = "burst",
    stagger: StaggerOpt = 0.25,
    rate: RateOpt = 4.0,
    join_after: JoinAfterOpt = 0.5,
    long_tokens: LongTokensOpt = None,
    prompts: PromptsFileOpt = None,
    max_tokens: MaxTokensRangeOpt = "64",
    temp: TempOpt = 0.0,
    seed: SeedOpt = None,
    ignore_eos: IgnoreEosOpt = False,
    model: ModelOpt = None,
    num_draft_tokens: NumDraftOpt = None,
    draft_model: DraftModelOpt = None,
    drafter: DrafterOpt = None,
    speculative_width_cap: WidthCapOpt = None,
    ab: AbOpt = None,
    baseline: BaselineOpt = None,
    verify: VerifyOpt = False,
    repeats: RepeatsOpt = 1,
    warmup: WarmupOpt = True,
    out: OutDirOpt = DEFAULT_OUT,
    json_output: ResultsJsonOpt = False,
    url: UrlOpt = None,
    api_key: BenchApiKeyOpt = None,
    served_model: ServedModelOpt = None,
    label: LabelOpt = None,
    distributed: DistributedOpt = False,
    debug: DebugOpt = False,  # noqa: ARG001 - read by the error boundary
) -> None:
    """Benchmark simulated concurrent requests: live view, per-cell summary, CSV/JSON/PNG in --out.

    Default workload: 16 requests cycling through the shipped held-out code prompts (none ends at
    EOS before its first token, greedy, on the embedded model or SmolLM2), 64 tokens each (or
    fewer where a request ends at EOS; --ignore-eos for fixed lengths), greedy, all at once
    (burst). agg tok/s = a run's tokens / (last end - first submit), every request counted. Results
    go to ./runs unless --out says otherwise.
    """
    options = {k: str(v) if isinstance(v, Path) else v for k, v in locals().items()}  # recorded with the results
    # Every check that needs no model comes first: a typo must not cost a load.
    from gmlx_cli import bench_url as _url

    _url.check_options(url, {"--model": model, "--ab": ab, "--baseline": baseline, "--verify": verify,
                             "--num-draft-tokens": num_draft_tokens, "--draft-model": draft_model, "--drafter": drafter,
                             "--speculative-width-cap": speculative_width_cap, "--api-key": api_key,
                             "--served-model": served_model, "--label": label, "--distributed": distributed})
    check_out_dir(out)
    concs = parse_int_list(concurrency, "--concurrency")
    budget = parse_token_range(max_tokens)
    arr = Arrival(arrival, stagger, rate, join_after, long_tokens).validated()
    baselines = check_run_options(ab, baseline, repeats, requests, distributed, verify)
    seed_drawn = seed is None
    seed = secrets.randbits(31) if seed is None else seed
    specs = load_prompt_specs(prompts)
    reqs = build_requests(specs, requests, arr, budget, temp, seed, ignore_eos)
    if url is not None:  # a running server: no model here (gmlx_cli/bench_url.py)
        return _url.bench_url(url, api_key, served_model, label, requests=reqs, concurrencies=concs, repeats=repeats,
                              warmup=warmup, ignore_eos=ignore_eos, out=out, json_output=json_output, options=options,
                              seed=seed, seed_drawn=seed_drawn)
    config = EngineConfig(num_draft_tokens=num_draft_tokens, width_cap=speculative_width_cap, drafter=drafter,
                          draft_model=str(draft_model) if draft_model else None).validated()
    env = Switches.from_env()
    blas.warn_if_reference()
    cluster = dist.join(distributed)
    lm = dist.load(cluster, model, _gen._load_model)
    new_engine = cluster.engine if cluster else Engine
    # The whole workload against the context first: advice that holds for every prompt, not one.
    ids = {r.request_id: tokenize(lm, r.prompt) for r in reqs}
    reqs, notices = fit_requests(lm.context_length, reqs, ids, budget, max_tokens, long_tokens)
    for line in notices:
        ui.notice(line)
    for r in reqs:  # the engine's own validation, as submit() will do it
        make_row(lm, ids[r.request_id], r.params)
    arms = plan_arms(ab, baselines, env, bool(draft_model) or can_draft(lm, drafter))
    human = sys.stderr if json_output else sys.stdout
    if seed_drawn:  # the workload (budgets, arrivals, sampling) replays only with this seed
        print(f"seed: {seed} (drawn at random; --seed {seed} replays this workload)", file=human, flush=True)
    view = LiveView(len(arms) * len(concs) * repeats * len(reqs), human)
    runs: list[Run] = []
    interrupted, verdict = False, None
    try:
        if warmup:  # compile and fill allocator caches per arm: not recorded
            for arm in arms:
                short = [replace(r, params=replace(r.params, max_tokens=min(4, r.params.max_tokens)), arrival_s=0.0,
                                 after_start=False) for r in reqs[:2]]
                drive(make_backend(lm, arm, config, 2, ignore_eos, new_engine)[0], short, ids, 2)
        with view:
            run_matrix(lm, arms, reqs, ids, concs, repeats, config, view, runs, ignore_eos, new_engine)
        if verify:
            verdict = verify_runs(lm, runs)
    except KeyboardInterrupt:
        interrupted = True
    report(lm, runs, arms, config, out, human, json_output, interrupted, verdict, options=options, seed=seed,
           seed_drawn=seed_drawn, repeats=repeats, meta_config={
               "num_draft_tokens": num_draft_tokens, "default_k": lm.default_k,
               "speculative_width_cap": speculative_width_cap, "arms": [a.__dict__ for a in arms],
               "distributed": cluster.stats if cluster else None})

