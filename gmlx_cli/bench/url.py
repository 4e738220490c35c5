"""`gmlx bench --url URL`: the bench workloads against a running OpenAI-compatible server (gmlx
serve, mlx_lm.server, vLLM, ...), with the same live view, tables and files as the in-process
bench; the driver and what it times are in gmlx_cli/bench/http_backend.py, the probe and the counters in target.py. What only the in-process
engine knows (mode, switches, transitions) is left out rather than guessed; acceptance is the
server's own, from its /metrics counters around each run; HTTP 429 refusals are "rejected".

Several servers can be compared in one run from Python (`run_matrix_http` with several targets:
benchmarks/bench_servers.py does that): each (concurrency, repeat) runs every server in turn,
the order alternating (ABBA), so drift on a shared machine hits them alike.
"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import replace
from pathlib import Path


from gmlx.errors import GmlxError, InvalidRequest
from gmlx.finish import FinishReason
from gmlx_cli.bench.arms import Arm, Run
from gmlx_cli.bench.live import LiveView, print_table
from gmlx_cli.bench.workload import Request


class MissingClient(GmlxError):
    """The HTTP client packages are not installed."""


def _client():
    """The HTTP driver and the server probe (gmlx_cli/bench/http_backend.py, target.py), or a
    one-line error: the openai client is not a core dependency."""
    try:
        import openai  # noqa: F401
        from gmlx_cli.bench import http_backend, target
    except ImportError as e:
        raise MissingClient(f"gmlx bench --url needs the openai client ({e.name} is missing): pip install 'gmlx[client]'")
    return http_backend, target

# bench options that configure the in-process engine: meaningless against a server
ENGINE_ONLY = ("--model", "--ab", "--baseline", "--verify", "--num-draft-tokens", "--draft-model", "--drafter",
               "--speculative-width-cap", "--distributed")
URL_ONLY = ("--served-model", "--label")  # --api-key may come from GMLX_API_KEY, set for the server


def check_options(url: str | None, given: dict[str, object]) -> None:
    """One line naming the first option that does not go with (or without) --url."""
    on = [k for k, v in given.items() if v not in (None, False, [], ())]
    if url is not None:
        bad = [k for k in ENGINE_ONLY if k in on]
        if bad:
            raise InvalidRequest(f"{bad[0]} configures the in-process engine; with --url the server decides that"
                                 " (start it with the options you want to measure)")
    else:
        bad = [k for k in URL_ONLY if k in on]
        if bad:
            raise InvalidRequest(f"{bad[0]} needs --url (the server to benchmark)")


def server_health(target) -> dict | None:
    """GET /health as JSON when the server has one (gmlx serve reports its mode there); else None."""
    import httpx

    try:
        r = httpx.get(target.base_url + "/health", timeout=5.0)
        return r.json() if r.status_code == 200 and "json" in r.headers.get("content-type", "") else None
    except (httpx.HTTPError, ValueError):
        return None


def run_matrix_http(targets: dict, requests: list[Request], concurrencies: list[int], repeats: int,
                    view, runs: list[Run], ignore_eos: bool = False,
                    request_timeout_s: float | None = None) -> list[Run]:
    """Every (concurrency, repeat) runs every target, in ABBA order. Each run is appended to `runs`
    before it starts, so an interrupt leaves the caller the partial one too. Around each run the
    server's spec_decode counters are read from its /metrics (`run.server_spec`: their difference,
    None where it exposes none): the acceptance a client cannot see per request."""
    http, server = _client()
    bound = {} if request_timeout_s is None else {"request_timeout_s": request_timeout_s}
    arms = [Arm(name, backend="http", speculative=False) for name in targets]
    for c in concurrencies:
        for rep in range(repeats):
            for arm in arms if rep % 2 == 0 else arms[::-1]:
                target = targets[arm.name]
                run = Run(arm, c, rep)
                runs.append(run)
                view.begin(f"{arm.name} c={c} rep {rep}", engine=False)
                before = server.spec_counters(target)
                asyncio.run(http.drive_http(target, requests, c, ignore_eos=ignore_eos, on_event=view.on_event,
                                            on_submit=view.submitted, done=run.outcomes, **bound))
                run.server_spec = server.counters_delta(before, server.spec_counters(target) if before else None)
                run.complete = True
                view.end(run.outcomes)
    return runs


def warm_up(targets: dict, requests: list[Request], ignore_eos: bool) -> None:
    """Two short requests per server, not recorded (its first request may compile or load)."""
    http, server = _client()
    short = [replace(r, params=replace(r.params, max_tokens=min(4, r.params.max_tokens)), arrival_s=0.0,
                     after_start=False) for r in requests[:2]]
    for target in targets.values():
        outs = asyncio.run(http.drive_http(target, short, 2, ignore_eos=ignore_eos))
        failed = [o for o in outs if o.finish_reason == FinishReason.ERROR]
        if failed:
            raise server.ServerError(f"{target.base_url} failed a warm-up request: {failed[0].error}")


def errors_of(runs: list[Run]) -> list[dict]:
    """Requests that failed (a refusal with HTTP 429 is not one: finish reason "rejected")."""
    return [{"arm": r.arm.name, "concurrency": r.concurrency, "repeat": r.repeat, "request_id": o.request.request_id,
             "error": o.error} for r in runs for o in r.outcomes if getattr(o, "error", None)]


def eos_notice(runs: list[Run]) -> str | None:
    """With --ignore-eos: requests that still ended at EOS before their budget (the server does not
    know the extension); their tokens are counted as generated, not padded."""
    short = [(r.arm.name, o) for r in runs for o in r.outcomes
             if o.finish_reason == FinishReason.STOP and o.num_generated < o.request.params.max_tokens]
    if not short:
        return None
    arms = sorted({a for a, _ in short})
    return (f"{len(short)} requests ended at EOS before their budget although --ignore-eos was sent"
            f" ({', '.join(arms)}): the server does not honour `ignore_eos`; their tokens are reported as generated")


def bench_url(url: str, api_key: str | None, served_model: str | None, label: str | None, *, requests: list[Request],
              concurrencies: list[int], repeats: int, warmup: bool, ignore_eos: bool, out: Path, json_output: bool,
              options: dict, seed: int, seed_drawn: bool) -> None:
    from gmlx_cli.bench import results, summary  # pandas: only when a command needs it
    from gmlx_cli.bench.report import write_files

    http, server = _client()
    target = server.probe(url, api_key, served_model)
    name = label or "server"
    targets = {name: target}
    human = sys.stderr if json_output else sys.stdout
    if seed_drawn:
        print(f"seed: {seed} (drawn at random; --seed {seed} replays this workload)", file=human, flush=True)
    print(f"server: {target.base_url} model {target.model}", file=human, flush=True)
    view = LiveView(len(concurrencies) * repeats * len(requests), human)
    runs: list[Run] = []
    interrupted = False
    try:
        if warmup:
            warm_up(targets, requests, ignore_eos)
        with view:
            run_matrix_http(targets, requests, concurrencies, repeats, view, runs, ignore_eos)
    except KeyboardInterrupt:
        interrupted = True
    req_df = results.requests_frame(runs)
    cell_df = results.cells_frame(runs, req_df, repeats)
    errors = errors_of(runs)
    meta = results.metadata(
        command="bench", url=target.base_url, model=target.model, server_models=list(target.models),
        server_health=server_health(target), seed=seed, seed_drawn=seed_drawn, interrupted=interrupted,
        options={k: v for k, v in options.items() if k != "api_key"},
        config={"arms": [{"name": name, "backend": "http", "url": target.base_url, "model": target.model}]},
        acceptance_source="the server's /metrics spec_decode counters, before and after each run"
        if runs and all(r.server_spec is not None for r in runs) else None)
    payload = {"meta": meta, "cells": results.records(cell_df), "requests": results.records(req_df),
               "runs": results.run_aggregates(runs, req_df), "errors": errors}
    # Over HTTP the engine's mode and transitions are not seen: those columns are absent, and
    # acceptance is the server's own (its /metrics), shown where it has the counters.
    tables = summary.summary_tables(cell_df)
    notes = summary.summary_notes(cell_df, req_df)
    if ignore_eos and (line := eos_notice(runs)):
        notes.append(line)
    for i, table in enumerate(tables):
        print_table(*table, human, notes=notes if i == len(tables) - 1 else ())
    paths = write_files(out, payload, req_df, cell_df, human, json_output, interrupted)
    if errors:
        total = sum(len(r.outcomes) for r in runs)
        raise server.ServerError(f"{len(errors)} of {total} requests failed (first: request {errors[0]['request_id']}:"
                          f" {errors[0]['error']}); results written to {paths['json']}")
