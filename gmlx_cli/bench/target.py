"""The server `gmlx bench --url` drives, as a client finds it: where it is (`probe`: GET /v1/models,
with a one-line error for an unreachable URL, a refused key or a server that does not speak
OpenAI's API) and what its /metrics counters say about speculation (`spec_counters`), the
acceptance a client cannot see per request. Driving requests into it is gmlx_cli/bench/http_backend.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import httpx

from gmlx.errors import GmlxError

PROBE_TIMEOUT_S = 10.0


class ServerError(GmlxError):
    """The server cannot be reached, refused us, or does not speak OpenAI's API."""


@dataclass(frozen=True)
class Target:
    """A server to drive: its base URL (without /v1), the model id to send, the key."""

    base_url: str
    model: str
    api_key: str | None = None
    models: tuple[str, ...] = ()  # what GET /v1/models listed


def base_url(url: str) -> str:
    """"http://h:8000/v1/" -> "http://h:8000": the form the routes are appended to."""
    u = url.strip().rstrip("/")
    if not u.startswith(("http://", "https://")):
        raise ServerError(f"--url must start with http:// or https://, got {url!r}")
    return u[: -len("/v1")] if u.endswith("/v1") else u


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def probe(url: str, api_key: str | None = None, served_model: str | None = None,
          timeout: float = PROBE_TIMEOUT_S) -> Target:
    """GET /v1/models before anything runs: a one-line error for an unreachable URL, a refused key
    or a server that is not OpenAI-compatible; the model to send (the only one listed, or
    `served_model`)."""
    base = base_url(url)
    where = base + "/v1/models"
    try:
        r = httpx.get(where, headers=_headers(api_key), timeout=timeout)
    except httpx.HTTPError as e:
        raise ServerError(f"cannot reach {base}: {type(e).__name__}: {e or 'no answer'}; is the server running"
                          " there?") from None
    if r.status_code in (401, 403):
        hint = "check --api-key" if api_key else "pass its key with --api-key"
        raise ServerError(f"{base} refused the request (HTTP {r.status_code}: {error_message(r)}); {hint}")
    if r.status_code != 200:
        raise ServerError(f"{base} does not look like an OpenAI-compatible server: GET /v1/models answered"
                          f" HTTP {r.status_code} ({error_message(r)})")
    try:
        data = r.json()["data"]
        ids = tuple(str(m["id"]) for m in data)
    except (ValueError, KeyError, TypeError):
        raise ServerError(f"{base} does not look like an OpenAI-compatible server: GET /v1/models did not answer"
                          f" with a model list (got {_snippet(r.text)})") from None
    if served_model is not None:
        return Target(base, served_model, api_key, ids)  # a server may serve more than it lists
    if len(ids) != 1:
        listed = ", ".join(ids[:5]) + (" ..." if len(ids) > 5 else "") if ids else "none"
        raise ServerError(f"{base} lists {len(ids)} models ({listed}); pick one with --served-model")
    return Target(base, ids[0], api_key, ids)


def error_message(r: httpx.Response) -> str:
    """What a failed answer says: its error message, else its status or a snippet of its body."""
    try:
        err = r.json().get("error")
        msg = err.get("message") if isinstance(err, dict) else err
        if msg:
            return _snippet(str(msg))
    except (ValueError, AttributeError):
        pass
    if "html" in r.headers.get("content-type", "") or not r.text.strip():  # a page: its status says it
        return r.reason_phrase or "no message"
    return _snippet(r.text)


def _snippet(text: str, n: int = 80) -> str:
    one = " ".join(str(text).split())
    return repr(one if len(one) <= n else one[: n - 1] + "…")


# vLLM's speculative-decoding counters (gmlx serve exposes them under `gmlx:`, vLLM under `vllm:`):
# key -> the metric name's tail. A server-wide count: read before and after a cell, the difference
# is the cell's (exact while nothing else uses the server).
SPEC_COUNTERS = {"drafts": "spec_decode_num_drafts_total", "draft_tokens": "spec_decode_num_draft_tokens_total",
                 "accepted": "spec_decode_num_accepted_tokens_total"}
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_MODEL_LABEL = re.compile(r'model_name="((?:[^"\\]|\\.)*)"')


def parse_spec_counters(text: str, model: str | None = None) -> dict[str, float] | None:
    """The SPEC_COUNTERS in Prometheus text, each summed over its samples (a prefix such as `vllm:`
    or `gmlx_` allowed). Samples are grouped by their `model_name` label: `model`'s group, else the
    only one there is; a counter declared (`# TYPE`) but without a sample yet, as prometheus_client
    leaves a labelled counter nothing has counted, is 0. None unless all three are there."""
    groups: dict[str | None, dict[str, float]] = {}
    declared = set()
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("# TYPE ") and line.endswith(" counter"):
            family = line.split()[2]
            declared |= {k for k, tail in SPEC_COUNTERS.items()
                         if _names(family, tail) or _names(family, tail.removesuffix("_total"))}
        m = _SAMPLE.match(line)
        if m is None:
            continue
        name, labels, value = m.groups()
        for key, tail in SPEC_COUNTERS.items():
            if _names(name, tail):
                label = _MODEL_LABEL.search(labels or "")
                try:
                    v = float(value)
                except ValueError:
                    continue
                group = groups.setdefault(label.group(1) if label else None, {})
                group[key] = group.get(key, 0.0) + v
    got = groups.get(model) if model in groups else next(iter(groups.values())) if len(groups) == 1 else None
    got = dict.fromkeys(declared, 0.0) | (got or {}) if got is not None or not groups else None
    return got if got is not None and len(got) == len(SPEC_COUNTERS) else None


def _names(name: str, tail: str) -> bool:
    """`name` is `tail`, bare or with a prefix (`vllm:`, `gmlx_`)."""
    return name == tail or (name.endswith(tail) and name[-len(tail) - 1] in ":_")


def spec_counters(target: Target, timeout: float = PROBE_TIMEOUT_S) -> dict[str, float] | None:
    """GET /metrics: the server's speculative-decoding counters so far, or None when it exposes none
    (no /metrics, not Prometheus text, or not these counters)."""
    try:
        r = httpx.get(target.base_url + "/metrics", headers=_headers(target.api_key), timeout=timeout)
    except httpx.HTTPError:
        return None
    return parse_spec_counters(r.text, target.model) if r.status_code == 200 else None


def counters_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, int] | None:
    """What a cell added to the server's counters; None when either read failed."""
    if before is None or after is None:
        return None
    return {k: int(round(after[k] - before[k])) for k in SPEC_COUNTERS}


