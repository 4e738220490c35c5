"""What rank 0 tells the other ranks, as JSON-ready values (gmlx/distributed/channel.py carries it).

Messages, by kind `k`:
- "hello": a new engine (session `sid`): its EngineConfig, switches, and the model's fingerprint;
- "step":  one engine step: the requests submitted since the last step (`new`: rid, prompt ids,
  sampling params with their concrete seed), the rids cancelled (`c`), the newest rid the step
  may admit (`h`), the cap decision when it changed (`cap`), and rank 0's plan (`p`);
- "costs": the round costs rank 0 measured for the session's engine (every rank measured them
  together, its forwards' all_sums paired; all decide with rank 0's figures);
- "close": the session's engine closed (its live and queued requests end "cancelled");
- "exit":  the run is over; the other ranks exit with `code`.
Tokens are never sent: every rank samples them itself (position-keyed noise, docs/design.md §3).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

from gmlx.config import EngineConfig, SamplingParams, Switches
from gmlx.policy.admission import Plan
from gmlx.policy.caps import CapDecision
from gmlx.policy.costs import Costs

HELLO, STEP, COSTS, CLOSE, EXIT = "hello", "step", "costs", "close", "exit"
_PARAMS = ("temperature", "top_p", "top_k", "min_p", "max_tokens", "seed", "stop", "ignore_eos",
           "repetition_penalty", "repetition_context_size", "presence_penalty", "presence_context_size",
           "frequency_penalty", "frequency_context_size", "logit_bias", "min_tokens", "logprobs", "prompt_logprobs",
           "prediction")


def encode_params(p: SamplingParams) -> list:
    """Validated params (a concrete seed) as a list; stop_fn cannot travel and is refused earlier."""
    return [list(v) if name == "stop" or name == "prediction" and isinstance(v, tuple)
            else [list(t) for t in v] if name == "logit_bias" and v else v
            for name in _PARAMS for v in [getattr(p, name)]]


def decode_params(v: list) -> SamplingParams:
    d = dict(zip(_PARAMS, v))
    d["stop"] = tuple(d["stop"])
    if d.get("logit_bias"):
        d["logit_bias"] = tuple((int(t), b) for t, b in d["logit_bias"])
    if isinstance(d.get("prediction"), list):  # token ids (made at intake): every rank drafts from them
        d["prediction"] = tuple(d["prediction"])
    return SamplingParams(**d)


def encode_plan(plan: Plan) -> list:
    """The plan's substance; its `reason` is a note for events, not state."""
    return [[t.value for t in plan.transitions], plan.admit, int(plan.arm_newcomers), plan.round.value, int(plan.held)]


def plan_digest(plan: Plan) -> int:
    return int.from_bytes(hashlib.blake2b(json.dumps(encode_plan(plan)).encode(), digest_size=4).digest(), "little")


def encode_caps(c: CapDecision) -> list:
    return [c.cap, c.source, [list(p) for p in c.k_by_width], c.notice]


def decode_caps(v: list) -> CapDecision:
    return CapDecision(cap=v[0], source=v[1], k_by_width=tuple(tuple(p) for p in v[2]), notice=v[3])


def costs(sid: int, c: Costs) -> dict:
    return {"k": COSTS, "sid": sid, "verify": list(c.verify), "draft": c.draft, "source": c.source,
            "rows": [list(p) for p in c.rows]}


def costs_of(msg: dict) -> Costs:
    return Costs(tuple(msg["verify"]), msg["draft"], msg["source"] + " on rank 0",
                 tuple((int(n), float(v)) for n, v in msg["rows"]))


def hello(sid: int, config: EngineConfig, switches: Switches, fingerprint: str) -> dict:
    return {"k": HELLO, "sid": sid, "config": dataclasses.asdict(config),
            "switches": dataclasses.asdict(switches), "model": fingerprint}


def config_of(msg: dict) -> tuple[EngineConfig, Switches]:
    return EngineConfig(**msg["config"]), Switches(**msg["switches"])


def fingerprint(lm) -> str:
    """What every rank must have loaded alike: the model's config, its drafter head's kind and
    its default K (a different checkpoint on another host is caught at the first engine)."""
    text = json.dumps([lm.config, lm.drafter_kind, lm.default_k], sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
