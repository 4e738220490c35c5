"""Simulated concurrent request streams, driven into an in-process backend (the gmlx engine or an
mlx-lm baseline) by one loop in the caller's thread.

Why the caller's thread and `step()` rather than the engine thread: the loop then decides, between
two rounds, exactly which requests have arrived and whether a slot is free, so a run is
reproducible (join-late waiters always meet a running request) and Ctrl-C lands in our code, not
in a thread we would have to unwind. Rounds and admission are the engine's own, as in serving.

Timing is taken where a streaming client would see it: when a round's pieces are handed over
(the end of `step()`). TTFT = first piece - submit; ITL = gaps between successive piece arrivals
that carried tokens (vLLM's per-chunk definition: a speculative round delivers several tokens at
once, and a client waits for the chunk, not for each token). Every request also has an end: the
round that finished it (one that ended at EOS before any token included), or the interrupt; a
run's aggregate throughput is its tokens / (last end - first submit), `aggregate_tokens_per_s`.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from gmlx.config import SamplingParams
from gmlx.errors import InvalidRequest
from gmlx.engine.metrics import Event, EventKind
from gmlx.finish import FinishReason

ARRIVALS = ("burst", "staggered", "poisson", "join-late")
DEFAULT_LONG = "default --long-tokens"  # join-late's long budget when no flag or prompts file set it


# -- parsing (all before the model load: a typo must not cost one) ---------------------------
def parse_int_list(text: str, option: str) -> list[int]:
    """"1,2,4" -> [1, 2, 4]; every value an integer >= 1, duplicates dropped, order kept."""
    values = []
    for part in str(text).split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            raise InvalidRequest(f"{option} takes a comma-separated list of integers >= 1, e.g. 1,2,4; got {text!r}")
        if int(part) not in values:
            values.append(int(part))
    return values


def parse_token_range(text: str) -> tuple[int, int]:
    """"64" -> (64, 64); "32-64" -> (32, 64): each request draws its budget in [A, B]."""
    parts = str(text).strip().split("-")
    if len(parts) not in (1, 2) or not all(p.strip().isdigit() for p in parts):
        raise InvalidRequest(f"--max-tokens takes N or a range A-B of positive integers, got {text!r}")
    lo, hi = int(parts[0]), int(parts[-1])
    if lo < 1 or hi < lo:
        raise InvalidRequest(f"--max-tokens range must satisfy 1 <= A <= B, got {text!r}")
    return lo, hi


@dataclass(frozen=True)
class PromptSpec:
    """One prompt and the per-request overrides a JSONL line may carry."""

    prompt: str
    max_tokens: int | None = None
    temperature: float | None = None
    seed: int | None = None
    prediction: str | None = None  # predicted output (OpenAI's `prediction`): a re-ask workload gives the previous answer


def load_prompt_specs(path: Path | None) -> list[PromptSpec]:
    """The shipped held-out code prompts, or a user file: plain lines (one prompt per line), or
    JSONL (detected by a first line starting with `{`) with prompt / max_tokens / temperature / seed /
    prediction (a predicted output: the previous answer of a re-asked request, the file an edit rewrites)."""
    if path is None:
        from gmlx.data import load_prompts

        return [PromptSpec(p) for p in load_prompts()]
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise InvalidRequest(f"prompts file {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidRequest(f"cannot read prompts file {str(path)!r}: {e}") from None
    numbered = [(i, ln) for i, ln in enumerate(lines, 1) if ln.strip()]
    if not numbered:
        raise InvalidRequest(f"prompts file {str(path)!r} has no prompts")
    if not numbered[0][1].lstrip().startswith("{"):
        return [PromptSpec(ln) for _, ln in numbered]
    return [_spec_from_json(ln, f"prompts file {str(path)!r} line {i}") for i, ln in numbered]


def _spec_from_json(line: str, where: str) -> PromptSpec:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise InvalidRequest(f"{where} is not valid JSON ({e.msg}); use one object per line") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"]:
        raise InvalidRequest(f'{where}: each line needs a non-empty string "prompt"')
    unknown = sorted(set(obj) - {"prompt", "max_tokens", "temperature", "seed", "prediction"})
    if unknown:
        raise InvalidRequest(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: prompt, max_tokens, temperature,"
                             " seed, prediction")

    def get(key, ok, want):
        v = obj.get(key)
        if v is not None and (isinstance(v, bool) or not ok(v)):
            raise InvalidRequest(f"{where}: {key} = {v!r} is invalid; {want}")
        return v

    return PromptSpec(
        obj["prompt"],
        max_tokens=get("max_tokens", lambda v: isinstance(v, int) and v >= 1, "use an integer >= 1"),
        temperature=get("temperature", lambda v: isinstance(v, (int, float)) and v >= 0, "use a number >= 0"),
        seed=get("seed", lambda v: isinstance(v, int) and v >= 0, "use an integer >= 0"),
        prediction=get("prediction", lambda v: isinstance(v, str), "use a string (the predicted output)"))


# -- the workload ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Arrival:
    kind: str = "burst"
    stagger_s: float = 0.25  # staggered: one request every S seconds
    rate: float = 4.0  # poisson: mean requests per second
    join_after_s: float = 0.5  # join-late: waiters arrive T s after the long request started
    long_tokens: int | None = None  # join-late: the long request's budget (default 4 x the largest)

    def validated(self) -> "Arrival":
        if self.kind not in ARRIVALS:
            raise InvalidRequest(f"--arrival must be one of {', '.join(ARRIVALS)}; got {self.kind!r}")
        if self.stagger_s < 0 or self.join_after_s < 0:
            raise InvalidRequest("--stagger and --join-after must be >= 0 seconds")
        if not self.rate > 0:
            raise InvalidRequest(f"--rate must be > 0 requests per second, got {self.rate!r}")
        if self.long_tokens is not None and self.long_tokens < 1:
            raise InvalidRequest(f"--long-tokens must be >= 1, got {self.long_tokens!r}")
        return self


@dataclass(frozen=True)
class Request:
    request_id: int
    prompt: str
    params: SamplingParams  # concrete seed: every arm and repeat replays the same request
    arrival_s: float  # offset from the start of the run
    after_start: bool = False  # join-late waiter: never before the long request has run a round
    budget_from: str = "--max-tokens"  # what set max_tokens: a flag, "prompts file" or DEFAULT_LONG (for errors)


def build_requests(specs: list[PromptSpec], n: int, arrival: Arrival, max_tokens: tuple[int, int],
                   temperature: float, seed: int, ignore_eos: bool = False) -> list[Request]:
    """N requests cycling through the prompts; budgets, gaps and seeds drawn from `seed` so the
    same command replays the same workload."""
    if n < 1:
        raise InvalidRequest(f"--requests must be >= 1, got {n}")
    rng = random.Random(seed)
    out, t = [], 0.0
    for i in range(n):
        spec = specs[i % len(specs)]
        budget = spec.max_tokens or rng.randint(*max_tokens)
        source = "prompts file" if spec.max_tokens else "--max-tokens"
        after = False
        if arrival.kind == "staggered":
            t = i * arrival.stagger_s
        elif arrival.kind == "poisson":
            t = 0.0 if i == 0 else t + rng.expovariate(arrival.rate)
        elif arrival.kind == "join-late" and i == 0:
            budget = arrival.long_tokens or spec.max_tokens or 4 * max_tokens[1]
            source = "--long-tokens" if arrival.long_tokens else source if spec.max_tokens else DEFAULT_LONG
        elif arrival.kind == "join-late":
            t, after = arrival.join_after_s, True
        params = SamplingParams(
            temperature=temperature if spec.temperature is None else float(spec.temperature), max_tokens=budget,
            seed=seed + i if spec.seed is None else spec.seed, ignore_eos=ignore_eos,
            prediction=spec.prediction).validated()
        out.append(Request(i, spec.prompt, params, t, after, source))
    return out


# -- driving -----------------------------------------------------------------------------------
@dataclass
class Outcome:
    """What one request did in one run (times relative to the run's start)."""

    request: Request
    prompt_tokens: list[int]
    submit_s: float
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival time, tokens in it)
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # a FinishReason; from a server, whatever it sent
    stats: dict = field(default_factory=dict)
    end_s: float | None = None  # when it ended, whatever the reason (EOS first, cancelled, rejected included)

    @property
    def num_generated(self) -> int:
        return len(self.tokens)

    @property
    def ended_s(self) -> float:
        """Its end time: `end_s` as the driver recorded it; for an outcome built without one, its
        last chunk (else its submit time)."""
        if self.end_s is not None:
            return self.end_s
        return self.chunks[-1][0] if self.chunks else self.submit_s

    @property
    def ttft_s(self) -> float | None:
        return self.chunks[0][0] - self.submit_s if self.chunks else None

    @property
    def itl_s(self) -> list[float]:
        return [b[0] - a[0] for a, b in zip(self.chunks, self.chunks[1:])]

    @property
    def tokens_per_s(self) -> float:
        """Decode rate after the first token, as RequestStats: (n - 1) / (last - first)."""
        n = sum(c for _, c in self.chunks)
        dt = self.chunks[-1][0] - self.chunks[0][0] if self.chunks else 0.0
        return (n - 1) / dt if n > 1 and dt > 0 else 0.0


def aggregate_tokens_per_s(tokens: Iterable[int], submit_s: Iterable[float], end_s: Iterable[float]) -> float:
    """A run's aggregate throughput, the one figure the live line, the summary, the JSON, the CSV and
    the PNG show: all its tokens / (its last end - its first submit). Every request counts, however
    it ended (at EOS before a token, cancelled, rejected): each has an end, and the span covers it.
    NaN for a run with no requests or no time."""
    tokens, submit_s, end_s = list(tokens), list(submit_s), list(end_s)
    if not submit_s or not end_s:
        return math.nan
    span = max(end_s) - min(submit_s)
    return sum(tokens) / span if span > 0 else math.nan


def run_aggregate(outcomes: Iterable[Outcome]) -> tuple[int, float]:
    """(tokens, aggregate tok/s) of one run's outcomes (`aggregate_tokens_per_s`)."""
    outs = list(outcomes)
    tokens = [o.num_generated for o in outs]
    return sum(tokens), aggregate_tokens_per_s(tokens, [o.submit_s for o in outs], [o.ended_s for o in outs])


class Backend:
    """What the driver needs: submit ids, run one round (returning engine-style Events), and the
    final tokens of a finished request. Engine and mlx-lm baselines implement it alike."""

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> int: ...
    def step(self) -> list[Event]: ...
    def result(self, rid: int) -> tuple[list[int], str, dict]: ...
    @property
    def has_work(self) -> bool: ...
    def close(self) -> None: ...

    def transitions(self) -> dict[str, int]:
        return {}  # only the engine has loops to move between


class EngineBackend(Backend):
    def __init__(self, engine):
        self.engine = engine
        self._streams = {}

    def submit(self, prompt_ids, params):
        stream = self.engine.submit(prompt_ids, params, start=False)  # we drive step() ourselves
        self._streams[stream.request_id] = stream
        return stream.request_id

    def step(self):
        return self.engine.step()

    def result(self, rid):
        rec = self._streams.pop(rid).wait(0)
        return list(rec.tokens), rec.finish_reason, dict(rec.stats)

    @property
    def has_work(self):
        return self.engine.has_work

    def transitions(self):  # and the online control's switches, counted like a transition
        return {**self.engine.counters.transitions, "control_switches": self.engine.counters.control_switches}

    def close(self):
        self.engine.close()  # in-flight requests end "cancelled"


def drive(backend: Backend, requests: list[Request], prompt_ids: dict[int, list[int]], concurrency: int,
          on_event: Callable[[Event], None] | None = None, on_submit: Callable[[int, float], None] | None = None,
          done: list[Outcome] | None = None, clock=time.perf_counter, sleep=time.sleep) -> list[Outcome]:
    """Run the workload to the end: submit in arrival order while fewer than `concurrency` are in
    flight, one round per iteration. Finished outcomes are appended to `done` as they finish, so a
    Ctrl-C leaves the caller everything measured so far (the in-flight ones are then cancelled)."""
    done = [] if done is None else done
    pending = deque(sorted(requests, key=lambda r: (r.arrival_s, r.request_id)))
    live: dict[int, Outcome] = {}
    stepped = False  # join-late: a waiter arrives only after the long request has run a round
    t0 = clock()
    ok = False
    try:
        while pending or live:
            now = clock() - t0
            while pending and len(live) < concurrency and pending[0].arrival_s <= now \
                    and (stepped or not pending[0].after_start):
                req = pending.popleft()
                ids = prompt_ids[req.request_id]
                rid = backend.submit(ids, req.params)
                live[rid] = Outcome(req, ids, submit_s=clock() - t0)
                if on_submit:
                    on_submit(rid, live[rid].submit_s)
            if not backend.has_work:  # idle until the next arrival
                if live:  # a backend that dropped a request would otherwise spin here forever
                    raise RuntimeError(f"the backend has no work but requests {sorted(live)} never finished")
                if pending:
                    sleep(min(0.05, max(0.0, pending[0].arrival_s - (clock() - t0))))
                continue
            events = backend.step()
            stepped = True
            t = clock() - t0
            for ev in events:
                if ev.kind is EventKind.ROUND:
                    for rid, _, _, n in ev.rows:
                        if n and rid in live:
                            live[rid].chunks.append((t, n))
                elif ev.kind is EventKind.FINISH and ev.rid in live:
                    out = live.pop(ev.rid)
                    out.tokens, out.finish_reason, out.stats = backend.result(ev.rid)
                    out.end_s = t
                    done.append(out)
                if on_event:
                    on_event(ev)
        ok = True
    finally:
        try:
            backend.close()
        except Exception:
            if ok:  # after an interrupt, a failing close must not mask the interrupt
                raise
        cut = clock() - t0
        for rid, out in live.items():  # interrupted: keep what they produced
            out.end_s = cut
            reason = None
            try:  # the engine's record says "cancelled", or how it ended if that was this very round
                out.tokens, reason, out.stats = backend.result(rid)
            except Exception:  # noqa: BLE001 - a baseline keeps no record of a cut-off request
                pass
            out.finish_reason = reason or FinishReason.CANCELLED
            done.append(out)
    return done

