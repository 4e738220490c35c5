"""/metrics in Prometheus's text format, through prometheus_client, on a registry of the app's own.

Names are vLLM's (so its dashboards and queries carry over) under a `gmlx:` prefix, with the
served model as the `model_name` label:

| gmlx | vLLM | from |
|---|---|---|
| gmlx:request_success_total{finished_reason} | vllm:request_success_total | the HTTP layer, per final record (length, stop, cancelled, error) |
| gmlx:num_requests_running, gmlx:num_requests_waiting | vllm:num_requests_* | the engine's open and queued streams, read at scrape time |
| gmlx:time_to_first_token_seconds | same | the engine's per-request stats (submit -> first token), at finish |
| gmlx:inter_token_latency_seconds | same | engine round events: per request, once per round that emitted tokens |
| gmlx:e2e_request_latency_seconds | same | the HTTP layer: body read -> final record |
| gmlx:prompt_tokens_total, gmlx:generation_tokens_total | same | final records / engine counters |
| gmlx:spec_decode_num_drafts_total | same | engine round events: rows that drafted |
| gmlx:spec_decode_num_draft_tokens_total, ..._num_accepted_tokens_total | same | engine counters |

and gmlx's own: `gmlx:transitions_total{transition}` (start_scalar, form_batch, preempt, gate,
resume, capture; the engine's counters), `gmlx:speculative_width_cap` (the cap in force: N, 0 =
uncapped, -1 = off; its source as a label), `gmlx:engine_rounds_total` and
`gmlx:speculative_rounds_total` (those that checked drafts: the rest decoded plain), and
`gmlx:http_rejected_total{status}` (requests answered with an error before reaching the engine),
`gmlx:control_switches_total` and `gmlx:speculation_k{width,reason}` (the online control's choice
per width: gmlx/policy/control.py).

The engine-side listener runs on the engine thread inside every step, so it only updates a dict
and prometheus_client's (thread-safe) histograms: microseconds, no device sync, no lock held
across anything slow. Engine counters are read at scrape time (monotone ints; a scrape racing a
round sees the round or not).
"""

from __future__ import annotations

import sys

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from gmlx.engine.metrics import Event, EventKind
from gmlx.engine.stream import FinalRecord

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


class EngineCollector:
    """The engine's own counters and state, read when /metrics is scraped."""

    def __init__(self, engine, model_name: str):
        self.engine = engine
        self.model = model_name

    def collect(self):
        eng, m = self.engine, [self.model]
        waiting = eng.service.queued
        running = max(0, eng.service.open_streams - waiting)  # popped into a loop (or about to be)
        for name, doc, value in (("num_requests_running", "Requests being decoded.", running),
                                 ("num_requests_waiting", "Requests queued for the engine.", waiting)):
            g = GaugeMetricFamily(f"gmlx:{name}", doc, labels=["model_name"])
            g.add_metric(m, value)
            yield g
        c = eng.counters
        for name, doc, value in (
                ("generation_tokens", "Tokens emitted.", c.tokens),
                ("spec_decode_num_draft_tokens", "Tokens drafted.", c.drafted),
                ("spec_decode_num_accepted_tokens", "Drafted tokens accepted.", c.accepted),
                ("engine_rounds", "Engine rounds (one forward each: plain, speculative, capture).", c.rounds),
                ("speculative_rounds", "Engine rounds that checked drafts.", c.speculative_rounds)):
            f = CounterMetricFamily(f"gmlx:{name}", doc, labels=["model_name"])
            f.add_metric(m, value)
            yield f
        t = CounterMetricFamily("gmlx:transitions", "Engine transitions (docs/design.md §2).",
                                labels=["model_name", "transition"])
        for tr, n in c.transitions.items():
            t.add_metric([self.model, str(tr)], n)
        yield t
        cap = eng.cap_in_force
        g = GaugeMetricFamily("gmlx:speculative_width_cap", "The cap in force: N, 0 = uncapped, -1 = off.",
                              labels=["model_name", "source"])
        g.add_metric([self.model, cap.source], -1 if cap.cap is None else cap.cap)
        yield g
        sw = CounterMetricFamily("gmlx:control_switches", "The online control's plain <-> speculative switches.",
                                 labels=["model_name"])
        sw.add_metric(m, c.control_switches)
        yield sw
        # The K in force per width (0: plain), as the online control last chose it; the reason is a
        # label (a gauge per width that ran, so a dashboard sees speculation stop and resume).
        ctl = getattr(getattr(eng, "spec", None), "control", None)
        if ctl is not None:
            k = GaugeMetricFamily("gmlx:speculation_k", "Drafts per round in force per width (0: plain).",
                                  labels=["model_name", "width", "reason"])
            for width, choice in sorted(ctl.last.items()):
                k.add_metric([self.model, str(width), choice.reason], choice.k)
            yield k


class ServeMetrics:
    def __init__(self, engine, model_name: str):
        self.model = model_name
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        self.success = Counter("gmlx:request_success", "Requests finished, by finish reason.",
                               ["model_name", "finished_reason"], registry=r)
        self.rejected = Counter("gmlx:http_rejected", "Requests answered with an HTTP error.", ["model_name", "status"],
                                registry=r)
        self.prompt_tokens = Counter("gmlx:prompt_tokens", "Prompt tokens of finished requests.", labels, registry=r)
        self.drafts = Counter("gmlx:spec_decode_num_drafts", "Speculative rounds, per row that drafted.", labels,
                              registry=r)
        self.ttft = Histogram("gmlx:time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("gmlx:inter_token_latency_seconds", "Time between rounds that emitted a request's tokens.",
                             labels, buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("gmlx:e2e_request_latency_seconds", "Request latency (HTTP body read to final record).",
                             labels, buckets=E2E_BUCKETS, registry=r)
        r.register(EngineCollector(engine, model_name))
        self._last_emit: dict[int, float] = {}  # request id -> when its last tokens were emitted
        engine.listeners.append(self.on_event)

    def on_event(self, ev: Event) -> None:
        """Engine thread: per-round timings. Cheap by contract (see the module docstring)."""
        if ev.kind is EventKind.ROUND:
            drafted_rows = 0
            for rid, drafted, _accepted, emitted in ev.rows:
                drafted_rows += drafted > 0
                if emitted:
                    last = self._last_emit.get(rid)
                    if last is not None:
                        self.itl.labels(self.model).observe(ev.time - last)
                    self._last_emit[rid] = ev.time
            if drafted_rows:
                self.drafts.labels(self.model).inc(drafted_rows)
        elif ev.kind is EventKind.DECISION:  # said once per switch, on stderr like the other notices
            print(f"gmlx: notice: width {ev.width}: {ev.reason}", file=sys.stderr, flush=True)
        elif ev.kind is EventKind.FINISH:
            self._last_emit.pop(ev.rid, None)
            if ev.stats and ev.stats.get("ttft_s") is not None:
                self.ttft.labels(self.model).observe(ev.stats["ttft_s"])

    def finished(self, rec: FinalRecord, seconds: float) -> None:
        """The HTTP layer saw a final record."""
        self._last_emit.pop(rec.request_id, None)  # rows ended by close() or a fault get no FINISH event
        self.success.labels(self.model, rec.finish_reason).inc()
        self.prompt_tokens.labels(self.model).inc(len(rec.prompt_tokens))
        self.e2e.labels(self.model).observe(seconds)

    def rejected_with(self, status: int) -> None:
        self.rejected.labels(self.model, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(_WithoutCreated(self.registry))


class _WithoutCreated:
    """The registry's metrics without prometheus_client's `*_created` series (the time each
    counter or histogram was created: noise to vLLM-style dashboards). Filtered here rather than
    with `disable_created_metrics()`, which would change every registry in the process."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry

    def collect(self):
        for metric in self.registry.collect():
            metric.samples = [s for s in metric.samples if not s.name.endswith("_created")]
            yield metric
