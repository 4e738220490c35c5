"""The bench workloads: what is sent, to whom it does not matter. Prompts (the shipped held-out
code prompts or a user's file), arrival patterns and per-request budgets and seeds, all drawn from
one seed so the same command replays the same workload; every option parsed before the model load
(a typo must not cost one). Driving the requests into a backend is gmlx_cli/bench/driver.py.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from gmlx.config import SamplingParams
from gmlx.errors import InvalidRequest

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
