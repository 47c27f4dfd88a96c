"""Prometheus metrics of the server (`GET /metrics`), in a registry of their own.

Counters and histograms are updated by the TokenizerManager as outputs arrive; gauges describing the
scheduler (running/queued requests, KV slots, radix hit rate) are refreshed from a live `GetLoadReqInput`
round trip on every scrape. So are the handover metrics, which a custom collector reports from that same
snapshot: the memory ledger's totals per release reason (`tide:memory_releases_total`,
`tide:memory_release_stall_seconds_total`, `tide:memory_release_freed_bytes_total`, label `reason`;
known reasons are reported at 0 before their first release), the weight version
(`tide:weight_version_info{weight_version=...} 1`), the pause state (`tide:generation_paused` 0/1,
label `mode`), and the scheduler process's device memory: `tide:memory_reserved_bytes`,
`tide:memory_allocated_bytes`, `tide:memory_fragmentation_bytes` (reserved − allocated; on a CPU-only
process allocated is the RSS and reserved 0) and `tide:memory_released_bytes{tag}` (bytes given back by
`release_memory_occupation`, 0 once resumed; every tag reported).
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
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0,
)  # fmt: skip

_UPDATE_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
)  # fmt: skip
# Release points named by the design; reported at zero until they first happen.
KNOWN_RELEASE_REASONS = ("flush_cache", "weight_update", "continue_generation", "release_memory",
                         "oom_recovery")
MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")

CONTENT_TYPE = CONTENT_TYPE_LATEST


class _HandoverCollector(Collector):
    """Memory ledger totals, weight version and pause state from the last scheduler snapshot."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.load: dict[str, Any] = {}

    def collect(self) -> Any:
        load, name = self.load, self.model_name
        ledger: dict[str, dict[str, float]] = {r: {} for r in KNOWN_RELEASE_REASONS}
        ledger.update(load.get("memory_ledger") or {})
        labels = ["model_name", "reason"]
        count = CounterMetricFamily("tide:memory_releases",
                                    "Device allocator cache releases (empty_device_cache) by reason",
                                    labels=labels)
        stall = CounterMetricFamily("tide:memory_release_stall_seconds",
                                    "Host time blocked in allocator cache releases, by reason",
                                    labels=labels)
        freed = CounterMetricFamily("tide:memory_release_freed_bytes",
                                    "Reserved bytes returned to the device by releases, by reason",
                                    labels=labels)
        for reason, totals in sorted(ledger.items()):
            count.add_metric([name, reason], float(totals.get("count", 0)))
            stall.add_metric([name, reason], float(totals.get("stall_s", 0.0)))
            freed.add_metric([name, reason], float(totals.get("freed_bytes", 0)))
        yield from (count, stall, freed)
        if "weight_version" in load:
            info = InfoMetricFamily("tide:weight_version", "Version of the weights being served",
                                    labels=["model_name"])
            info.add_metric([name], {"weight_version": str(load["weight_version"])})
            yield info
        if "paused" in load:
            paused = GaugeMetricFamily(
                "tide:generation_paused",
                "1 while generation is paused (pause_generation), with the pause mode",
                labels=["model_name", "mode"])
            mode = load["paused"]
            paused.add_metric([name, mode or "none"], 1.0 if mode else 0.0)
            yield paused
            blocked = GaugeMetricFamily(
                "tide:num_pending_weight_updates",
                "Weight updates waiting for running requests to finish", labels=["model_name"])
            blocked.add_metric([name], float(load.get("num_pending_weight_updates", 0)))
            yield blocked
        replicas = load.get("replicas")
        if replicas:  # --dp-size N: one entry per replica, dead ones included
            yield from _replica_metrics(name, replicas)
        memory = load.get("memory")
        if memory:
            yield from _memory_metrics(name, memory)
        ranks = load.get("ranks")
        if ranks:
            yield from _rank_metrics(name, ranks)


def _rank_metrics(name: str, ranks: list[dict[str, Any]]) -> Any:
    """Per tensor-parallel rank (tp_size > 1): device memory, released bytes, release points."""
    labels = ["model_name", "rank"]
    families = {key: GaugeMetricFamily(f"tide:rank_memory_{key}", help_text, labels=labels)
                for key, help_text in (
                    ("reserved_bytes", "Bytes reserved by the device caching allocator of a "
                                       "tensor-parallel rank"),
                    ("allocated_bytes", "Bytes allocated by the device caching allocator of a "
                                        "tensor-parallel rank (its RSS without CUDA)"))}
    released = GaugeMetricFamily("tide:rank_memory_released_bytes",
                                 "Bytes a tensor-parallel rank gave back by "
                                 "release_memory_occupation, by tag", labels=labels + ["tag"])
    releases = CounterMetricFamily("tide:rank_memory_releases",
                                   "Device allocator cache releases of a tensor-parallel rank, by "
                                   "reason", labels=labels + ["reason"])
    for entry in ranks:
        rank = str(entry.get("rank", 0))
        for key, family in families.items():
            family.add_metric([name, rank], float(entry.get(key, 0)))
        tags = {tag: 0 for tag in MEMORY_TAGS}
        tags.update(entry.get("released_bytes") or {})
        for tag, nbytes in sorted(tags.items()):
            released.add_metric([name, rank, tag], float(nbytes))
        totals: dict[str, dict[str, float]] = {r: {} for r in KNOWN_RELEASE_REASONS}
        totals.update(entry.get("release_totals") or {})
        for reason, t in sorted(totals.items()):
            releases.add_metric([name, rank, reason], float(t.get("count", 0)))
    yield from (*families.values(), released, releases)


def _memory_metrics(name: str, memory: dict[str, Any]) -> Any:
    for key, help_text in (
        ("reserved_bytes", "Bytes reserved by the device caching allocator of the scheduler "
                           "process (0 without CUDA)"),
        ("allocated_bytes", "Bytes allocated by the device caching allocator of the scheduler "
                            "process (its resident set size without CUDA)"),
        ("fragmentation_bytes", "Reserved but not allocated bytes (reserved - allocated): "
                                "allocator cache and fragmentation"),
    ):
        gauge = GaugeMetricFamily(f"tide:memory_{key}", help_text, labels=["model_name"])
        gauge.add_metric([name], float(memory.get(key, 0)))
        yield gauge
    released = {tag: 0 for tag in MEMORY_TAGS}
    released.update(memory.get("released_bytes") or {})
    gauge = GaugeMetricFamily("tide:memory_released_bytes",
                              "Bytes given back by release_memory_occupation, by tag (0 once resumed)",
                              labels=["model_name", "tag"])
    for tag, nbytes in sorted(released.items()):
        gauge.add_metric([name, tag], float(nbytes))
    yield gauge


def _replica_metrics(name: str, replicas: list[dict[str, Any]]) -> Any:
    """Data-parallel replicas (`--dp-size`): how many live, and which."""
    alive = GaugeMetricFamily("tide:dp_replicas_alive", "Data-parallel replicas alive (of dp_size)",
                              labels=["model_name"])
    alive.add_metric([name], float(sum(1 for r in replicas if r.get("alive"))))
    yield alive
    up = GaugeMetricFamily("tide:dp_replica_up", "1 while a data-parallel replica lives",
                           labels=["model_name", "replica"])
    for replica in replicas:
        up.add_metric([name, str(replica.get("index"))], 1.0 if replica.get("alive") else 0.0)
    yield up


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
        self.kv_pool = Gauge(
            "tide:kv_pool_slots", "KV slots per pool (full; swa for hybrid sliding-window models) "
            "by state: capacity, used (held or cached), evictable (cached, no request uses them)",
            labels + ["pool", "state"], registry=r)
        self.hit_rate = Gauge(
            "tide:cache_hit_rate", "Radix cache hit rate: cached / (cached + computed) prompt tokens",
            labels, registry=r)
        self.retractions = Gauge(
            "tide:num_retractions", "Requests retracted for lack of KV slots (since start)", labels,
            registry=r)
        self.weight_updates = Counter(
            "tide:weight_updates", "Weight update requests by source and outcome",
            labels + ["source", "success"], registry=r)
        self.weight_update_time = Histogram(
            "tide:weight_update_seconds",
            "Weight update time as the client sees it (waiting for running requests included)",
            labels + ["source"], buckets=_UPDATE_BUCKETS, registry=r)
        self.handover = _HandoverCollector(model_name)
        r.register(self.handover)
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

    def on_weight_update(self, source: str, success: bool, seconds: float) -> None:
        self.weight_updates.labels(source=source, success=str(success).lower(), **self.label).inc()
        self.weight_update_time.labels(source=source, **self.label).observe(seconds)

    def set_load(self, load: dict[str, Any]) -> None:
        self.handover.load = dict(load)
        lb = self.label
        self.running.labels(**lb).set(load["num_running_reqs"])
        self.queued.labels(**lb).set(load["num_queued_reqs"])
        self.kv_used.labels(**lb).set(load["kv_used_slots"])
        self.kv_held.labels(**lb).set(load["kv_held_slots"])
        self.kv_total.labels(**lb).set(load["max_total_tokens"])
        self.kv_usage.labels(**lb).set(load["kv_used_slots"] / max(1, load["max_total_tokens"]))
        for pool, counts in load.get("kv_pools", {}).items():
            for state in ("capacity", "used", "evictable"):
                self.kv_pool.labels(pool=pool, state=state, **lb).set(counts[state])
        seen = load["num_cached_tokens"] + load["num_prefill_tokens"]
        self.hit_rate.labels(**lb).set(load["num_cached_tokens"] / seen if seen else 0.0)
        self.retractions.labels(**lb).set(load["num_retractions"])

    def render(self) -> bytes:
        return generate_latest(self.registry)
