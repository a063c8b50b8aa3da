"""Prometheus metrics: engine counters/gauges (fetched from the engine process) plus latency
histograms measured here, in the API process, from request arrival (as vLLM does).

Names are vLLM's with the `impasto:` prefix; counters get `_total` on the wire. The overload
counters (`impasto:request_rejected_total{reason}`, `impasto:request_timeout_total`) are
impasto's own, counted here where the refusal or the timeout reaches the client.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)
_PER_POS = re.compile(r"^(?P<name>.+)\[(?P<pos>\d+)\]$")
# Finished-request counts are per finish reason, measured here (aborts never reach the engine's
# counters), so the engine's unlabelled versions are not exported.
_FRONTEND_OWNED = {"impasto:request_success", "impasto:request_failure"}


class _EngineCollector(Collector):
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        # [name, value, kind, documentation] or, with data parallelism, [..., engine index]
        self.snapshot: list[list] = []

    def collect(self) -> Iterable[Metric]:
        families: dict[str, Metric] = {}
        for name, value, kind, doc, *engine in self.snapshot:
            if name in _FRONTEND_OWNED:
                continue
            labels, label_values = ["model_name"], [self.model_name]
            if engine:  # one series per data-parallel engine
                labels.append("engine")
                label_values.append(str(engine[0]))
            m = _PER_POS.match(name)
            if m:
                name = m["name"] + "_per_pos"
                labels.append("position")
                label_values.append(m["pos"])
            fam = families.get(name)
            if fam is None:
                cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
                fam = families[name] = cls(name, doc or name, labels=labels)
            fam.add_metric(label_values, value)
        yield from families.values()


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.engine = _EngineCollector(model_name)
        self.registry.register(self.engine)
        labels = ["model_name"]
        r, name = self.registry, model_name

        def hist(metric: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(metric, doc, labels, buckets=buckets, registry=r).labels(name)

        self.ttft = hist(
            "impasto:time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS
        )
        self.itl = hist(
            "impasto:inter_token_latency_seconds", "Time between outputs.", _LATENCY_BUCKETS
        )
        self.e2e = hist(
            "impasto:e2e_request_latency_seconds", "Arrival to last token.", _LATENCY_BUCKETS
        )
        self.prompt_tokens = hist(
            "impasto:request_prompt_tokens", "Prompt tokens per request.", _TOKEN_BUCKETS
        )
        self.generation_tokens = hist(
            "impasto:request_generation_tokens", "Generated tokens per request.", _TOKEN_BUCKETS
        )
        self.success = Counter(
            "impasto:request_success",
            "Finished requests, by finish reason (stop, length, abort, error).",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.rejected = Counter(
            "impasto:request_rejected",
            "Requests refused at admission, by reason (queue_full: the waiting queue was at "
            "--max-waiting-requests).",
            ["model_name", "reason"],
            registry=r,
        )
        self.timeouts = Counter(
            "impasto:request_timeout",
            "Requests aborted because they ran past --request-timeout.",
            labels,
            registry=r,
        ).labels(name)
        self.rejected.labels(name, "queue_full")  # exported as 0 before the first refusal
        self._model_name = model_name

    def finished(self, reason: str) -> None:
        self.success.labels(self._model_name, reason).inc()

    def rejected_request(self, reason: str) -> None:
        self.rejected.labels(self._model_name, reason).inc()

    def render(self, engine_snapshot: list[list] | None) -> bytes:
        if engine_snapshot is not None:
            self.engine.snapshot = engine_snapshot
        return generate_latest(self.registry)


class RequestTimer:
    """Per-request latency bookkeeping; all times from `time.monotonic()` in this process."""

    def __init__(self, metrics: ServerMetrics, num_prompt_tokens: int) -> None:
        self.metrics = metrics
        self.arrival = time.monotonic()
        self.last: float | None = None
        self.num_prompt_tokens = num_prompt_tokens

    def on_tokens(self) -> None:
        now = time.monotonic()
        if self.last is None:
            self.metrics.ttft.observe(now - self.arrival)
        else:
            self.metrics.itl.observe(now - self.last)
        self.last = now

    def on_finish(self, reason: str, num_generated: int) -> None:
        self.metrics.e2e.observe(time.monotonic() - self.arrival)
        self.metrics.prompt_tokens.observe(self.num_prompt_tokens)
        self.metrics.generation_tokens.observe(num_generated)
        self.metrics.finished(reason)
