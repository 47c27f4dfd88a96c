"""Prometheus metrics of the server (`GET /metrics`), in a registry of their own.

Counters and histograms are updated by the TokenizerManager as outputs arrive; gauges describing the
scheduler (running/queued requests, KV slots, radix hit rate) are refreshed from a live `GetLoadReqInput`
round trip on every scrape.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0,
)  # fmt: skip

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    """All metrics of one server. Names use the `tide:` prefix (as sglang uses `sglang:`)."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        r = self.registry
        self.prompt_tokens = Counter(
            "tide:prompt_tokens", "Prompt tokens of finished requests", labels, registry=r)
        self.generation_tokens = Counter(
            "tide:generation_tokens", "Generated tokens (counted as they stream)", labels, registry=r)
        self.cached_tokens = Counter(
            "tide:cached_tokens", "Prompt tokens served from the radix cache", labels, registry=r)
        self.requests = Counter(
            "tide:num_requests", "Finished requests by finish reason", labels + ["finish_reason"],
            registry=r)
        self.ttft = Histogram(
            "tide:time_to_first_token_seconds", "Time to first token", labels,
            buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(
            "tide:inter_token_latency_seconds", "Time between consecutive output tokens", labels,
            buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram(
            "tide:e2e_request_latency_seconds", "Request latency from arrival to finish", labels,
            buckets=_LATENCY_BUCKETS, registry=r)
        self.running = Gauge("tide:num_running_reqs", "Requests running", labels, registry=r)
        self.queued = Gauge("tide:num_queue_reqs", "Requests waiting in the queue", labels, registry=r)
        self.kv_used = Gauge(
            "tide:kv_used_slots", "KV slots in use (held by requests or kept by the radix cache)",
            labels, registry=r)
        self.kv_held = Gauge(
            "tide:kv_held_slots", "KV slots held by live requests", labels, registry=r)
        self.kv_total = Gauge("tide:kv_total_slots", "KV slots in the pool", labels, registry=r)
        self.kv_usage = Gauge(
            "tide:token_usage", "Fraction of KV slots in use", labels, registry=r)
        self.hit_rate = Gauge(
            "tide:cache_hit_rate", "Radix cache hit rate: cached / (cached + computed) prompt tokens",
            labels, registry=r)
        self.retractions = Gauge(
            "tide:num_retractions", "Requests retracted for lack of KV slots (since start)", labels,
            registry=r)
        self.label = {"model_name": model_name}

    def on_first_token(self, ttft: float) -> None:
        self.ttft.labels(**self.label).observe(ttft)

    def on_tokens(self, count: int, gap: float | None) -> None:
        """`count` new tokens arrived `gap` seconds after the previous ones (None for the first)."""
        self.generation_tokens.labels(**self.label).inc(count)
        if gap is not None and count > 0:
            per_token = gap / count
            hist = self.itl.labels(**self.label)
            for _ in range(count):
                hist.observe(per_token)

    def on_finish(self, prompt_tokens: int, cached_tokens: int, e2e: float, reason: str) -> None:
        self.prompt_tokens.labels(**self.label).inc(prompt_tokens)
        self.cached_tokens.labels(**self.label).inc(cached_tokens)
        self.requests.labels(finish_reason=reason, **self.label).inc()
        self.e2e.labels(**self.label).observe(e2e)

    def set_load(self, load: dict[str, Any]) -> None:
        lb = self.label
        self.running.labels(**lb).set(load["num_running_reqs"])
        self.queued.labels(**lb).set(load["num_queued_reqs"])
        self.kv_used.labels(**lb).set(load["kv_used_slots"])
        self.kv_held.labels(**lb).set(load["kv_held_slots"])
        self.kv_total.labels(**lb).set(load["max_total_tokens"])
        self.kv_usage.labels(**lb).set(load["kv_used_slots"] / max(1, load["max_total_tokens"]))
        seen = load["num_cached_tokens"] + load["num_prefill_tokens"]
        self.hit_rate.labels(**lb).set(load["num_cached_tokens"] / seen if seen else 0.0)
        self.retractions.labels(**lb).set(load["num_retractions"])

    def render(self) -> bytes:
        return generate_latest(self.registry)
