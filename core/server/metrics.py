"""Prometheus metrics of one server, in its own ``CollectorRegistry`` (several apps, one process: no clashes).

Under ``hookllm serve --api-server-count N`` each API server process counts its own requests,
in prometheus_client's multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``, set by the parent), and
``/metrics`` from any of them sums every process's counters and histograms. The engine's gauges
are read from the stats the engine last reported, the same in every process; its first report
comes as it starts, so they are right (``hookllm:num_kv_blocks`` the cache's size) before any request.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

from hookllm.sched.scheduler import SchedulerStats

from hookllm.engine.async_llm import AsyncLLM

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)


class ServerMetrics:
    def __init__(self, engine: AsyncLLM, model_name: str):
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        self.engine_gauges = EngineGauges(engine, model_name)
        self.registry.register(self.engine_gauges)
        self.prompt_tokens = Counter("hookllm:prompt_tokens", "Prompt tokens of admitted requests.",
                                     list(labels), registry=self.registry).labels(**labels)
        self.generation_tokens = Counter("hookllm:generation_tokens", "Generated tokens.",
                                         list(labels), registry=self.registry).labels(**labels)
        self.ttft = Histogram("hookllm:time_to_first_token_seconds", "Time from arrival to the first token.",
                              list(labels), buckets=LATENCY_BUCKETS, registry=self.registry).labels(**labels)
        self.tpot = Histogram("hookllm:time_per_output_token_seconds", "Time between output tokens.",
                              list(labels), buckets=LATENCY_BUCKETS, registry=self.registry).labels(**labels)
        self._finished = Counter("hookllm:request_success", "Finished requests by finish reason "
                                 "(stop, length, abort, error).", ["model_name", "finished_reason"],
                                 registry=self.registry)
        self._model_name = model_name

    def request_finished(self, reason: str) -> None:
        self._finished.labels(model_name=self._model_name, finished_reason=reason).inc()

    def render(self) -> bytes:
        if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
            return generate_latest(self.registry)
        # Every API server process's counters and histograms, summed; the engine's gauges once.
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        registry.register(self.engine_gauges)
        return generate_latest(registry)


class EngineGauges:
    """The engine's state as gauges, read at scrape time from the stats of its last report."""

    GAUGES: tuple[tuple[str, str, Callable[[SchedulerStats], float]], ...] = (
        ("hookllm:num_requests_running", "Requests in the running batch.", lambda s: s.num_running_reqs),
        ("hookllm:num_requests_waiting", "Requests waiting to be scheduled.", lambda s: s.num_waiting_reqs),
        ("hookllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).", lambda s: s.kv_cache_usage),
        ("hookllm:num_used_kv_blocks", "KV-cache blocks in use.", lambda s: s.num_used_blocks),
        ("hookllm:num_kv_blocks", "KV-cache blocks in all.", lambda s: s.num_blocks),
    )

    def __init__(self, engine: AsyncLLM, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[GaugeMetricFamily]:
        stats = self.engine.get_stats()
        for name, doc, read in self.GAUGES:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], read(stats))
            yield family


class RequestTimer:
    """One request's token timings: the first token feeds TTFT, each later one TPOT."""

    def __init__(self, metrics: ServerMetrics, num_prompt_tokens: int):
        self.metrics = metrics
        self.arrival = self.last = time.perf_counter()
        self.num_tokens = 0
        metrics.prompt_tokens.inc(num_prompt_tokens)

    def tokens(self, count: int) -> None:
        if count <= 0:
            return
        now = time.perf_counter()
        if self.num_tokens == 0:
            self.metrics.ttft.observe(now - self.arrival)
        else:
            self.metrics.tpot.observe((now - self.last) / count)
        self.num_tokens += count
        self.last = now
        self.metrics.generation_tokens.inc(count)
