"""The soak's workload (see `soak_harness`): a reproducible random schedule of requests, the
clients that submit, stream and cancel them from their own threads, and the cap flipper.

The *workload* is reproducible (schedule, seeds, cap sequence come from one numpy Generator);
the interleaving is not, which is the point: the streams must not depend on it.
"""

from __future__ import annotations

import collections
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import numpy as np

from gmlx.policy import user_config
from gmlx.config import SamplingParams
from gmlx.engine import Engine
from gmlx.engine.stream import FinalRecord
from gmlx.switches import CONFIG, WIDTH_CAP

CAP_ENV = WIDTH_CAP.name
# Integers go through the env; "off" is the env unset, falling through to the run's own user
# config, which says "off" (the env takes integers only: "off" there is a ConfigError).
CAP_VALUES = ("1", "2", "4", "8", "0", "off")
STOPS = ("\n\n", "return", ":\n", ")")


@dataclass(frozen=True)
class Profile:
    requests: int
    max_tokens: int  # budgets are drawn from 1..max_tokens
    max_concurrency: int  # live streams at most (well under max_queued: no Overloaded)
    pause_s: tuple[float, float]  # an idle pause: all streams drained, then this long
    p_pause: float  # chance that a phase starts with an idle pause
    trickle_gap_s: float  # mean gap inside a trickle
    cancel_fraction: float
    cancel_delay_s: float  # cancel-after-delay draws from 0..this
    flip_s: tuple[float, float]  # time between cap flips
    timeout_s: float  # the whole run, bounded


FULL = Profile(1000, 64, 16, (0.2, 0.8), 0.3, 0.08, 0.2, 0.5, (0.05, 0.4), 3600.0)
QUICK = Profile(48, 24, 8, (0.05, 0.2), 0.3, 0.03, 0.25, 0.2, (0.02, 0.1), 300.0)


@dataclass(frozen=True)
class Item:
    index: int
    prompt: list[int] | str  # a str is submitted as text (the engine tokenizes it)
    params: SamplingParams  # seed always concrete, so the reference is reproducible
    gap_s: float  # sleep before submitting
    drain: bool  # wait until no stream is live before the gap (the engine goes idle)
    cancel: str | None = None  # None | "pieces" (after cancel_at pieces) | "delay" (after cancel_at s)
    cancel_at: float = 0.0


def _params(rng: np.random.Generator, max_tokens: int) -> SamplingParams:
    budget = int(rng.integers(1, 4)) if rng.random() < 0.1 else int(rng.integers(1, max_tokens + 1))
    return SamplingParams(
        temperature=float(rng.choice([0.0, 0.5, 0.8, 1.0])),
        top_p=float(rng.choice([0.9, 0.95])) if rng.random() < 0.25 else 1.0,
        top_k=int(rng.choice([10, 40])) if rng.random() < 0.25 else 0,
        min_p=0.05 if rng.random() < 0.1 else 0.0,
        max_tokens=budget, seed=int(rng.integers(0, 2**31)),
        stop=(str(rng.choice(STOPS)),) if rng.random() < 0.1 else (),
        ignore_eos=bool(rng.random() < 0.1))


def _prompt(rng: np.random.Generator, texts: list[str], tokens: list[list[int]]) -> list[int] | str:
    r, i = rng.random(), int(rng.integers(len(texts)))
    if r < 0.2:
        return texts[i]
    if r < 0.5:
        return list(tokens[i])
    if r < 0.8:  # a truncated prompt, down to one token
        return list(tokens[i][: int(rng.integers(1, len(tokens[i]) + 1))])
    parts = rng.choice(len(tokens), size=int(rng.integers(2, 4)), replace=False)
    return [t for j in parts for t in tokens[int(j)]][:400]  # well inside the 1024 context


def make_schedule(texts: list[str], tokens: list[list[int]], profile: Profile, rng: np.random.Generator) -> list[Item]:
    """Phases of bursts, trickles and a lone request joined by others (a preempt), each phase
    sometimes after an idle pause, so the engine walks idle -> scalar -> preempt -> batch ->
    gate -> resume again and again."""
    items: list[Item] = []

    def add(gap: float, drain: bool = False, params: SamplingParams | None = None) -> None:
        cancel, at = None, 0.0
        params = params or _params(rng, profile.max_tokens)
        if rng.random() < profile.cancel_fraction:
            cancel = str(rng.choice(["pieces", "delay"]))
            at = float(rng.integers(0, params.max_tokens + 1)) if cancel == "pieces" else \
                float(rng.uniform(0, profile.cancel_delay_s))
        items.append(Item(len(items), _prompt(rng, texts, tokens), params, gap, drain, cancel, at))

    while len(items) < profile.requests:
        pause = rng.random() < profile.p_pause
        gap = float(rng.uniform(*profile.pause_s)) if pause else 0.0
        phase = rng.choice(["burst", "trickle", "join"], p=[0.4, 0.35, 0.25])
        if phase == "burst":
            for j in range(int(rng.integers(2, profile.max_concurrency + 1))):
                add(gap if j == 0 else 0.0, pause and j == 0)
        elif phase == "trickle":
            for j in range(int(rng.integers(2, 9))):
                add(gap if j == 0 else float(rng.exponential(profile.trickle_gap_s)), pause and j == 0)
        else:  # a long lone request, then waiters while it runs: the preempt path
            long = replace(_params(rng, profile.max_tokens), max_tokens=profile.max_tokens, ignore_eos=True)
            add(gap, True, long)
            join_gap = float(rng.uniform(0.02, 0.2))
            for j in range(int(rng.integers(1, 6))):
                add(join_gap if j == 0 else 0.0)
    return items[: profile.requests]


@dataclass
class Outcome:
    item: Item
    record: FinalRecord | None = None
    tokens: list[int] = field(default_factory=list)  # as streamed
    text: str = ""  # as streamed
    cancel_sent: bool = False
    client_error: str | None = None  # submit refused or the stream never finished



def set_cap(value: str) -> None:
    """One cap flip: an integer through the env, "off" as the env unset (the run's config says off)."""
    WIDTH_CAP.put(None if value == "off" else value)


def use_private_config(path, model_key: str = user_config.DEFAULT_MODEL_KEY) -> None:
    """Point GMLX_CONFIG at a file of the run's own, whose entry says "off" (never the user's)."""
    CONFIG.put(str(path))
    user_config.write_cap(model_key, user_config.OFF, path=path, source="soak")


def _client(eng: Engine, out: Outcome, timeout: float) -> None:
    item = out.item
    try:
        stream = eng.submit(item.prompt, item.params)
    except Exception as e:  # refused (Overloaded, EngineClosed after a hang): counted, not raised
        out.client_error = f"{type(e).__name__}: {e}"
        return
    if item.cancel == "pieces" and item.cancel_at == 0:
        stream.cancel()  # most likely still queued: the reap-from-queue path
        out.cancel_sent = True
    elif item.cancel == "delay":
        try:
            stream.wait(item.cancel_at)
        except TimeoutError:
            stream.cancel()
            out.cancel_sent = True
    # Iteration ends at the final record; should the engine hang, the run's deadline closes
    # the engine, which ends every stream, so this loop is bounded too.
    for piece in stream:
        out.text += piece.text
        if piece.token >= 0:
            out.tokens.append(piece.token)
            if item.cancel == "pieces" and not out.cancel_sent and len(out.tokens) >= item.cancel_at:
                stream.cancel()
                out.cancel_sent = True
    try:
        out.record = stream.wait(timeout)
    except TimeoutError as e:
        out.client_error = str(e)


def run(eng: Engine, items: list[Item], profile: Profile, rng: np.random.Generator) -> dict:
    """Drive the schedule against the engine's own thread (clients in a pool, one per live
    stream) while a second thread flips the cap. Returns outcomes and the run's counts."""
    outcomes = [Outcome(it) for it in items]
    cond, live, stop = threading.Condition(), [0], threading.Event()
    flips: list[str] = []
    deadline = time.monotonic() + profile.timeout_s
    saved = WIDTH_CAP.raw()

    def flipper() -> None:
        while not stop.wait(float(rng.uniform(*profile.flip_s))):
            value = CAP_VALUES[int(rng.integers(len(CAP_VALUES)))]
            set_cap(value)
            flips.append(value)

    def client(out: Outcome) -> None:
        try:
            _client(eng, out, timeout=max(1.0, deadline - time.monotonic()))
        finally:
            with cond:
                live[0] -= 1
                cond.notify_all()

    def wait_live(pred) -> None:
        with cond:
            if not cond.wait_for(pred, timeout=max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"streams still live after {profile.timeout_s} s")

    hung = None
    flip_thread = threading.Thread(target=flipper, name="soak-cap-flipper", daemon=True)
    t0 = time.perf_counter()
    flip_thread.start()
    try:
        with ThreadPoolExecutor(max_workers=profile.max_concurrency, thread_name_prefix="soak-client") as pool:
            try:
                for out in outcomes:
                    if out.item.drain:
                        wait_live(lambda: live[0] == 0)
                    time.sleep(out.item.gap_s)
                    wait_live(lambda: live[0] < profile.max_concurrency)
                    with cond:
                        live[0] += 1
                    pool.submit(client, out)
                wait_live(lambda: live[0] == 0)
            except TimeoutError as e:
                hung = str(e)
                eng.close()  # ends every live stream, so the clients (and the pool) finish
    finally:
        stop.set()
        flip_thread.join(timeout=10)
        set_cap(saved if saved is not None else "off")  # "off" here: the env as it was, unset
    return {"outcomes": outcomes, "wall_s": time.perf_counter() - t0, "hung": hung,
            "flips": len(flips), "flip_values": dict(collections.Counter(flips))}
