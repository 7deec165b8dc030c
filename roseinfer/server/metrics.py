"""Prometheus metrics, named like vLLM's (`vllm:` becomes `roseinfer:`), on a registry of their own.

The three gauges a load balancer in front of several replicas reads are also exposed under
vLLM's own names, the defaults of the Kubernetes Gateway API Inference Extension's endpoint
picker: `vllm:num_requests_waiting`, `vllm:num_requests_running`, `vllm:kv_cache_usage_perc`, and
`vllm:cache_config_info` (labels block_size, num_gpu_blocks) for its prefix-cache scorer.

Gauges, and the counters the engine core keeps itself (preemptions, prefix-cache lookups), are
read at scrape time from the engine's latest stats snapshot; the other counters and the histograms
are fed by `record` with each batch of outputs (AsyncLLM calls it, as a stat logger).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from roseinfer.common.messages import SchedulerStats
from roseinfer.engine.stats import IterationStats

CONTENT_TYPE = CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)
_TOKEN_LATENCY_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                          0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class _EngineTotals(Collector):
    """Counters whose running totals the engine core keeps; exposed as `<name>_total`."""

    def __init__(self, model_name: str, snapshot: Callable[[], SchedulerStats]) -> None:
        self._model = model_name
        self._snapshot = snapshot

    def collect(self) -> Iterator[CounterMetricFamily]:
        stats = self._snapshot()
        for name, doc, value in (
            ("roseinfer:num_preemptions", "Requests preempted for lack of KV blocks.", stats.num_preemptions),
            ("roseinfer:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             stats.prefix_cache_queries),
            ("roseinfer:prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_cache_hits),
        ):
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self._model], value)
            yield family


class PrometheusStatLogger:
    def __init__(
        self, model_name: str, snapshot: Callable[[], SchedulerStats], num_waiting: Callable[[], int],
        cache_config: dict[str, int] | None = None,
    ) -> None:
        """`snapshot` gives the engine core's latest SchedulerStats; `num_waiting` the requests
        accepted and not running yet (which the front end knows best); `cache_config` the KV
        cache's block_size and num_gpu_blocks."""
        self.registry = CollectorRegistry()
        labels = {"labelnames": ["model_name"], "registry": self.registry}
        self._model = model_name

        def gauge(name: str, doc: str, read: Callable[[], float]) -> None:
            Gauge(name, doc, **labels).labels(model_name).set_function(read)

        gauge("roseinfer:num_requests_running", "Requests in the running batch.", lambda: snapshot().num_running)
        gauge("roseinfer:num_requests_waiting", "Requests waiting to be scheduled.", num_waiting)
        gauge("roseinfer:kv_cache_usage_perc", "Fraction of KV-cache blocks held by requests (0..1).",
              lambda: snapshot().kv_cache_usage)
        gauge("roseinfer:max_num_batched_requests", "The most requests one engine step has run together.",
              lambda: snapshot().max_batch_requests)
        self.registry.register(_EngineTotals(model_name, snapshot))

        # The Gateway API Inference Extension's defaults (its "model server protocol").
        gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", num_waiting)
        gauge("vllm:num_requests_running", "Requests in the running batch.", lambda: snapshot().num_running)
        gauge("vllm:kv_cache_usage_perc", "KV-cache usage (0..1).", lambda: snapshot().kv_cache_usage)
        if cache_config is not None:
            info = Gauge("vllm:cache_config_info", "KV cache configuration (labels); always 1.",
                         labelnames=sorted(cache_config), registry=self.registry)
            info.labels(**{name: str(value) for name, value in cache_config.items()}).set(1)

        self.prompt_tokens = Counter("roseinfer:prompt_tokens", "Prompt tokens processed.", **labels).labels(model_name)
        self.generation_tokens = Counter(
            "roseinfer:generation_tokens", "Tokens generated.", **labels
        ).labels(model_name)
        self.request_success = Counter(
            "roseinfer:request_success", "Requests finished, by finish reason.",
            labelnames=["model_name", "finished_reason"], registry=self.registry,
        )
        self.structured_output_requests = Counter(
            "roseinfer:structured_output_requests", "Finished requests with a structured output, by kind.",
            labelnames=["model_name", "kind"], registry=self.registry,
        )
        self.time_to_first_token = Histogram(
            "roseinfer:time_to_first_token_seconds", "Time from arrival to the first token.",
            buckets=_LATENCY_BUCKETS, **labels,
        ).labels(model_name)
        self.inter_token_latency = Histogram(
            "roseinfer:inter_token_latency_seconds", "Time between two tokens of a request.",
            buckets=_TOKEN_LATENCY_BUCKETS, **labels,
        ).labels(model_name)
        self.e2e_latency = Histogram(
            "roseinfer:e2e_request_latency_seconds", "Time from arrival to the last token.",
            buckets=_LATENCY_BUCKETS, **labels,
        ).labels(model_name)
        self.queue_time = Histogram(
            "roseinfer:request_queue_time_seconds", "Time from arrival to first scheduling.",
            buckets=_LATENCY_BUCKETS, **labels,
        ).labels(model_name)

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats) -> None:
        if iteration_stats.num_prompt_tokens:
            self.prompt_tokens.inc(iteration_stats.num_prompt_tokens)
        if iteration_stats.num_generation_tokens:
            self.generation_tokens.inc(iteration_stats.num_generation_tokens)
        for seconds in iteration_stats.time_to_first_tokens:
            self.time_to_first_token.observe(seconds)
        for seconds in iteration_stats.inter_token_latencies:
            self.inter_token_latency.observe(seconds)
        for finished in iteration_stats.finished_requests:
            for reason in finished.finish_reasons:
                self.request_success.labels(self._model, reason).inc()
            if finished.structured_output_kind is not None:
                self.structured_output_requests.labels(self._model, finished.structured_output_kind).inc()
            self.e2e_latency.observe(finished.e2e_latency)
            if finished.queue_time is not None:
                self.queue_time.observe(finished.queue_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)
