"""A load test over HTTP, shared by tests/test_serve_load.py (short) and benchmarks/load_serve.py
(full): many requests from the async openai client (random prompts, budgets, temperatures, seeds,
stop strings, streaming or not, clients that disconnect mid-request) against the server on a
thread of this process, while GMLX_MTP_WIDTH_CAP flips live. Afterwards every completed stream is
compared with the same request decoded alone without speculation (tie-aware), every stream cut
by its client as a prefix of it, and MLX active memory (idle, prompt cache emptied) with the start.

Needs the `openai` package (the test extra); imported only here.
"""

from __future__ import annotations

import asyncio
import collections
import random
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field

import httpx
import openai

from gmlx import Engine, EngineConfig, SamplingParams
from gmlx.engine.intake import tokenize
from gmlx.finish import COMPLETE
from gmlx.serve import Background, create_app
from gmlx.engine.memory import memory_now, settle
from gmlx.engine.oracle import compare_streams, run_scalar
from gmlx.switches import WIDTH_CAP

TIMEOUT = 120.0  # per request: bounded, generous for a loaded machine
TEMPERATURES = (0.0, 0.0, 0.5, 0.8, 1.0)


@dataclass(frozen=True)
class Profile:
    requests: int
    max_concurrency: int
    max_tokens: int  # budgets drawn from 1..max_tokens (a lone request's: max_tokens..2 x max_tokens)
    disconnect_rate: float = 0.15
    stream_rate: float = 0.7
    stop_rate: float = 0.1
    flip_cap_s: float | None = 0.05  # GMLX_MTP_WIDTH_CAP flips among 1, 2, 4, 0 and unset; None: never


QUICK = Profile(requests=32, max_concurrency=8, max_tokens=12)
FULL = Profile(requests=240, max_concurrency=16, max_tokens=48)


@dataclass(frozen=True)
class Item:
    index: int
    prompt: str
    params: SamplingParams
    stream: bool
    cut_after: int | None = None  # streams: the client leaves after this many chunks
    give_up_s: float | None = None  # plain requests: the client leaves after this long
    delay_s: float = 0.0  # before this arrival
    drain_first: bool = False  # arrive only once every earlier request has ended (the engine is idle)


@dataclass
class Outcome:
    item: Item
    status: int | None = None  # HTTP status; None: the client left before an answer
    tokens: list[int] = field(default_factory=list)
    prompt_ids: list[int] | None = None
    finish_reason: str | None = None
    left: bool = False  # the client disconnected before the end
    error: str | None = None
    ttft_s: float | None = None
    seconds: float = 0.0


def plan(profile: Profile, seed: int, prompts: list[str]) -> list[Item]:
    """Episodes, so that the engine goes through all its transitions: a lone request on an idle
    engine (scalar) joined by waiters (preempt; over the cap: gate; the waiters done: resume), a
    burst, a trickle; each episode starts on a drained engine or not, at random."""
    rng = random.Random(seed)
    items: list[Item] = []

    def add(budget: int, delay_s: float = 0.0, drain_first: bool = False) -> None:
        text = rng.choice(prompts)
        text = text[: rng.randint(min(8, len(text)), len(text))]
        t = rng.choice(TEMPERATURES)
        params = SamplingParams(max_tokens=budget, temperature=t, top_p=rng.choice((1.0, 0.95, 0.9)) if t else 1.0,
                                seed=rng.randrange(2**31), stop=("\n\n",) if rng.random() < profile.stop_rate else ())
        stream, leave = rng.random() < profile.stream_rate, rng.random() < profile.disconnect_rate
        items.append(Item(len(items), text, params, stream, cut_after=rng.randint(1, 3) if leave and stream else None,
                          give_up_s=rng.uniform(0.02, 0.3) if leave and not stream else None, delay_s=delay_s,
                          drain_first=drain_first))

    short = profile.max_tokens
    while len(items) < profile.requests:
        kind = rng.choice(("lone_join", "burst", "trickle"))
        if kind == "lone_join":
            add(rng.randint(short, 2 * short), drain_first=True)
            for j in range(rng.randint(1, 6)):
                add(rng.randint(1, short), delay_s=rng.uniform(0.1, 0.4) if j == 0 else 0.0)
        elif kind == "burst":
            drain = rng.random() < 0.5
            for j in range(rng.randint(2, 12)):
                add(rng.randint(1, short), drain_first=drain and j == 0)
        else:
            for _ in range(rng.randint(2, 8)):
                add(rng.randint(1, short), delay_s=rng.expovariate(10.0))
    return items[: profile.requests]


def _args(model: str, it: Item) -> dict:
    p = it.params
    args = dict(model=model, prompt=it.prompt, max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p,
                seed=p.seed, extra_body={"return_token_ids": True})
    return args | ({"stop": list(p.stop)} if p.stop else {})


async def _one(client: openai.AsyncOpenAI, model: str, it: Item) -> Outcome:
    out, t0 = Outcome(it), time.perf_counter()
    try:
        if it.stream:
            await _streamed(client, model, it, out, t0)
        else:
            r = await client.with_options(timeout=it.give_up_s or TIMEOUT).completions.create(**_args(model, it))
            c = r.choices[0]
            out.status, out.finish_reason = 200, c.finish_reason
            out.tokens, out.prompt_ids = c.model_extra["token_ids"], c.model_extra["prompt_token_ids"]
    except openai.APITimeoutError:
        out.left = it.give_up_s is not None
        out.error = None if out.left else "timed out"
    except openai.APIStatusError as e:
        out.status, out.error = e.status_code, e.message
    except openai.APIError as e:  # an error event inside a stream, a broken connection
        out.error = f"{type(e).__name__}: {e}"
    out.seconds = time.perf_counter() - t0
    return out


async def _streamed(client, model: str, it: Item, out: Outcome, t0: float) -> None:
    stream = await client.completions.create(stream=True, **_args(model, it))
    out.status = 200
    chunks = 0
    async for c in stream:
        if not c.choices:
            continue
        ch = c.choices[0]
        out.tokens += ch.model_extra.get("token_ids") or []
        if out.ttft_s is None and out.tokens:
            out.ttft_s = time.perf_counter() - t0
        if ch.finish_reason:
            out.finish_reason, out.prompt_ids = ch.finish_reason, ch.model_extra.get("prompt_token_ids")
        chunks += 1
        if it.cut_after is not None and chunks >= it.cut_after and out.finish_reason is None:
            out.left = True
            await stream.close()
            return


async def drive(url: str, model: str, items: list[Item], max_concurrency: int) -> list[Outcome]:
    sem = asyncio.Semaphore(max_concurrency)
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT) as client:
        async def run(it: Item) -> Outcome:
            try:
                return await _one(client, model, it)
            finally:
                sem.release()

        tasks = []
        for it in items:
            if it.drain_first and tasks:
                await asyncio.wait(tasks)
            await asyncio.sleep(it.delay_s)
            await sem.acquire()
            tasks.append(asyncio.create_task(run(it)))
        return list(await asyncio.gather(*tasks))


class CapFlipper:
    """A thread flipping GMLX_MTP_WIDTH_CAP (the engine re-reads it every round); restores it."""

    def __init__(self, every_s: float | None, seed: int):
        self.every_s, self.rng, self.flips = every_s, random.Random(seed), 0
        self._stop = threading.Event()
        self._saved = WIDTH_CAP.raw()
        self._thread = threading.Thread(target=self._run, name="gmlx-load-cap", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            v = self.rng.choice(("1", "2", "4", "0", ""))
            WIDTH_CAP.put(v)
            self.flips += 1

    def __enter__(self) -> "CapFlipper":
        if self.every_s:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        WIDTH_CAP.put(self._saved)


def check(lm, outcomes: list[Outcome]) -> dict:
    """Every answered stream against its solo plain decode: complete ones whole, cut ones as a prefix."""
    refs: dict = {}
    counts = collections.Counter()
    bad = []
    for o in outcomes:
        it = o.item
        if o.status != 200 or o.error:
            continue
        ids = tokenize(lm, it.prompt)
        if o.prompt_ids is not None and o.prompt_ids != ids:
            bad.append({"index": it.index, "kind": "prompt_ids", "got": o.prompt_ids, "want": ids})
            continue
        key = (tuple(ids), it.params)
        if key not in refs:
            refs[key] = run_scalar(lm, ids, it.params, speculative=False).tokens
        ref = refs[key]
        if o.finish_reason not in COMPLETE:  # cut by its client (or cancelled server-side)
            ref = ref[: len(o.tokens)]
        c = compare_streams(lm, ids, ref, o.tokens, it.params)
        counts["checked"] += 1
        counts["ties"] += c.tie and not c.equal
        if not c.ok:
            bad.append({"index": it.index, "kind": "tokens", "position": c.position, "margin": c.margin,
                        "params": asdict(it.params), "finish_reason": o.finish_reason, "got": o.tokens, "want": ref})
    return {"checked": counts["checked"], "ties": counts["ties"], "mismatches": len(bad), "mismatch_details": bad}


def _pct(xs: list[float], q: float) -> float | None:
    return statistics.quantiles(xs, n=100)[q - 1] if len(xs) >= 2 else (xs[0] if xs else None)


def summarize(outcomes: list[Outcome]) -> dict:
    statuses = collections.Counter("left before an answer" if o.status is None and o.left else str(o.status)
                                   for o in outcomes)
    complete = [o for o in outcomes if o.status == 200 and o.finish_reason in COMPLETE and not o.error]
    ttfts = [o.ttft_s for o in outcomes if o.ttft_s is not None]
    return {"statuses": dict(statuses), "status_5xx": sum(o.status is not None and o.status >= 500 for o in outcomes),
            "completed": len(complete), "left": sum(o.left for o in outcomes),
            "streams": sum(o.item.stream for o in outcomes),
            "finish_reasons": dict(collections.Counter(str(o.finish_reason) for o in outcomes)),
            "errors": [f"#{o.item.index}: {o.error}" for o in outcomes if o.error and not o.left],
            "tokens": sum(len(o.tokens) for o in outcomes),
            "client_ttft_s": {"p50": _pct(ttfts, 50), "p90": _pct(ttfts, 90)}}


def run_load(lm, profile: Profile, seed: int, prompts: list[str], *, mem_tolerance: float = 0.05) -> dict:
    """The whole load test; returns the report (its `failures` list is empty on a pass)."""
    eng = Engine(lm, EngineConfig())
    app = create_app(eng)
    model = app.state.api.model_name
    items = plan(profile, seed, prompts)
    try:
        with Background(app) as bg:
            warm = [Item(-1 - i, prompts[i % len(prompts)], SamplingParams(max_tokens=4, seed=i), i % 2 == 0)
                    for i in range(4)]
            asyncio.run(drive(bg.url, model, warm, 4))
            mem_start = memory_now(eng)
            t0 = time.perf_counter()
            with CapFlipper(profile.flip_cap_s, seed) as flipper:
                outcomes = asyncio.run(asyncio.wait_for(drive(bg.url, model, items, profile.max_concurrency),
                                                        TIMEOUT * 10))
            wall = time.perf_counter() - t0
            settle(eng)
            metrics = httpx.get(bg.url + "/metrics", timeout=30).text
            health = httpx.get(bg.url + "/health", timeout=30).json()
            mem_end = memory_now(eng)
            open_streams = eng.service.open_streams
    finally:
        eng.close()
    res = summarize(outcomes) | check(lm, outcomes)
    ratio = mem_end["active"] / mem_start["active"] if mem_start["active"] else None
    failures = []
    if res["mismatches"]:
        failures.append(f"{res['mismatches']} streams differ from their solo plain decode")
    if res["status_5xx"] or res["errors"]:
        failures.append(f"{res['status_5xx']} responses >= 500, {len(res['errors'])} client-side errors")
    if open_streams or health["running"] or health["waiting"]:
        failures.append(f"left behind: {open_streams} open streams, health {health}")
    if ratio is None or ratio > 1 + mem_tolerance:
        failures.append(f"MLX active memory at the end {mem_end['active']} vs start {mem_start['active']}")
    return {"requests": len(items), "profile": asdict(profile), "seed": seed, "wall_s": wall, **res,
            "cap_flips": flipper.flips, "transitions": {str(k): v for k, v in eng.counters.transitions.items()},
            "rounds": eng.counters.rounds, "engine_tokens": eng.counters.tokens,
            "memory": {"start": mem_start, "end": mem_end, "end_over_start": ratio},
            "health_after": health, "metrics_after": metrics, "failures": failures}
